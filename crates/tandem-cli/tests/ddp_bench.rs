//! `tandem bench ddp` end to end: spawns its ranks, reports every configuration, cleans up.
//! No speed assertions (those live in the benchmark's own ratios); the numbers must exist and be
//! consistent with each other.
use std::process::Command;
use std::time::Duration;

/// `tandem bench ddp ARGS --json` with one thread per rank: its JSON object.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["bench", "ddp"])
            .args(args)
            .arg("--json")
            .env("RAYON_NUM_THREADS", "1"),
        Duration::from_secs(180),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout {stdout}\nstderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

#[test]
fn bench_ddp_json_reports_all_configurations() {
    let v = bench_json(&["--nproc", "2", "--batch", "8", "--steps", "2", "--rounds", "1"]);
    for k in
        ["plain_samples_per_s", "ddp1_samples_per_s", "ddpN_samples_per_s", "scaling_efficiency"]
    {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
    let ratio =
        v["ddpN_samples_per_s"].as_f64().unwrap() / v["plain_samples_per_s"].as_f64().unwrap();
    assert!((ratio - v["scaling_efficiency"].as_f64().unwrap()).abs() < 1e-9);
    assert_eq!(v["nproc"], 2);
}

#[test]
fn bench_ddp_rejects_a_batch_that_does_not_split() {
    let out = tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["bench", "ddp", "--nproc", "3", "--batch", "8"]),
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--batch 8") && err.contains("--nproc 3"), "{err}");
}

#[test]
fn bench_ddp_runs_the_resnet() {
    let v = bench_json(&[
        "--model", "resnet18", "--width", "4", "--nproc", "2", "--batch", "4", "--steps", "1",
        "--rounds", "1",
    ]);
    assert_eq!(
        (v["model"].as_str(), v["width"].as_u64(), v["mode"].as_str()),
        (Some("resnet18"), Some(4), Some("varmap"))
    );
    for k in
        ["plain_samples_per_s", "ddp1_samples_per_s", "ddpN_samples_per_s", "localN_samples_per_s"]
    {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
}
