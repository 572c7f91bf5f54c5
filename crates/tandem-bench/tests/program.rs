//! The program's face: every benchmark is listed, and bad flags fail naming the flag before any
//! work starts (cheap checks; the benchmarks themselves are run by tandem-cli's tests through
//! `tandem bench`).
use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem-bench")).args(args).output().unwrap()
}

#[test]
fn help_lists_every_benchmark() {
    let out = bench(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for which in [
        "allreduce",
        "ddp",
        "ckpt",
        "save-stall",
        "zero",
        "face",
        "live",
        "partial-fc",
        "ops",
        "conv",
        "report",
    ] {
        assert!(text.contains(which), "{which} missing from:\n{text}");
    }
}

#[test]
fn a_bad_value_fails_naming_the_flag() {
    let out = bench(&["face", "--nproc", "0"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("--nproc"), "{text}");
}
