//! `tandem bench allreduce` end to end: spawns real ranks and prints one JSON object per size.
use std::process::Command;
use std::time::Duration;

fn run_bench(backend: &str) -> Vec<serde_json::Value> {
    let out = tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem")).args([
            "bench",
            "allreduce",
            "--nproc",
            "2",
            "--sizes",
            "4,4K,64K",
            "--backend",
            backend,
            "--json",
            "--seconds-per-size",
            "0.02",
        ]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

#[test]
fn bench_allreduce_json_has_every_field_per_collective_and_size() {
    for backend in ["tcp", "shm"] {
        let rows = run_bench(backend);
        assert_eq!(rows.len(), 9, "{rows:?}");
        // Each rank's input; the splitting collectives round 4 B up to one f32 per rank.
        let expected = [
            ("all_reduce", 4u64),
            ("all_reduce", 4096),
            ("all_reduce", 65536),
            ("reduce_scatter", 8),
            ("reduce_scatter", 4096),
            ("reduce_scatter", 65536),
            ("all_to_all", 8),
            ("all_to_all", 4096),
            ("all_to_all", 65536),
        ];
        for (row, (op, size)) in rows.iter().zip(expected) {
            assert_eq!(row["op"].as_str(), Some(op), "{row}");
            assert_eq!(row["size_bytes"].as_u64(), Some(size), "{row}");
            assert_eq!(row["transport"].as_str(), Some(backend));
            let t = row["time_s"].as_f64().expect("time_s");
            let alg = row["algbw_gbs"].as_f64().expect("algbw");
            let bus = row["busbw_gbs"].as_f64().expect("busbw");
            assert!(t > 0.0 && t < 1.0, "{row}");
            assert!((alg - size as f64 / t / 1e9).abs() <= 1e-9 * alg.max(1.0), "{row}");
            // 2 ranks: all_reduce's busbw = algbw * 2(n-1)/n = algbw, the others' algbw / 2.
            let factor = if op == "all_reduce" { 1.0 } else { 0.5 };
            assert!((bus - factor * alg).abs() <= 1e-12 + 1e-9 * alg, "{row}");
            let (lo, hi) =
                (row["busbw_min_gbs"].as_f64().unwrap(), row["busbw_max_gbs"].as_f64().unwrap());
            assert!(lo <= bus && bus <= hi, "{row}");
            assert!(row["memcpy_gbs"].as_f64().expect("memcpy") > 0.0, "{row}");
            assert!(row["gloo_busbw_gbs"].is_null(), "no --torch, no gloo figure: {row}");
        }
    }
}

#[test]
fn bench_rejects_bad_sizes() {
    let out = tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["bench", "allreduce", "--sizes", "4,5"]),
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--sizes"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_rejects_unknown_collectives() {
    let out = tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem")).args([
            "bench",
            "allreduce",
            "--ops",
            "all_reduce,gossip",
        ]),
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--ops") && err.contains("gossip"), "{err}");
}
