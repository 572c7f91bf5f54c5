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

/// A worker rank started by hand, without the job its benchmark hands it, says where the job
/// comes from instead of running on defaults.
#[test]
fn a_worker_without_its_job_names_the_variable() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-bench"))
        .args(["worker", "zero"])
        .env_remove("TANDEM_BENCH_JOB")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("TANDEM_BENCH_JOB"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem-bench"))
        .args(["worker", "zero"])
        .env("TANDEM_BENCH_JOB", "{\"dims\": [4]}")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("TANDEM_BENCH_JOB") && text.contains("steps"), "{text}");
}
