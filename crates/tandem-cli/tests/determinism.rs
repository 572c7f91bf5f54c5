//! Same seed, same data, same world size: the same bits, run after run. Each recipe is trained
//! twice on one rank with two compute threads and twice on two ranks; every tensor of the final
//! checkpoint (weights, optimizer moments, the head's shards) and every epoch's loss, read from
//! the run's `metrics.jsonl`, must be equal bit for bit. (Thread-scheduling-dependent reductions,
//! unseeded draws and hash-map order all show up here as a weight difference.)
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tandem::ckpt::Value;
use tandem::train::metrics::{last_summary, read_metrics, MetricsRecord};
use tandem_testutil::{output_with_deadline, without_world};

const LIMIT: Duration = Duration::from_secs(300);

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Runs `tandem train ARGS --out OUT` with `threads` compute threads per rank; returns OUT.
fn train(args: &[&str], out: &Path, threads: usize) -> PathBuf {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tandem"));
    without_world(&mut c);
    c.env("RAYON_NUM_THREADS", threads.to_string()).arg("train").args(args).args(["--out", p(out)]);
    let o = output_with_deadline(&mut c, LIMIT);
    assert!(
        o.status.success(),
        "tandem train {args:?} failed ({:?})\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    out.to_path_buf()
}

/// Every tensor under `v`, by its path of keys, as raw bytes.
fn tensors(v: &Value, at: &str, out: &mut BTreeMap<String, Vec<u8>>) {
    match v {
        Value::Tensor(t) => {
            let bits: Vec<u8> =
                t.to_f32_vec().iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
            out.insert(at.to_string(), bits);
        }
        Value::Dict(items) => {
            for (k, v) in items {
                let key = match k {
                    Value::Str(s) => s.clone(),
                    Value::Int(i) => i.to_string(),
                    other => format!("{other:?}"),
                };
                tensors(v, &format!("{at}/{key}"), out);
            }
        }
        Value::List(items) | Value::Tuple(items) => {
            for (i, v) in items.iter().enumerate() {
                tensors(v, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The tensors of a run's last checkpoint (the summary names it: a file, or a directory of
/// per-rank files) and its epoch losses.
fn outcome(run: &Path) -> (BTreeMap<String, Vec<u8>>, Vec<u64>) {
    let metrics = run.join("metrics.jsonl");
    let summary = last_summary(&metrics).unwrap().expect("a summary record");
    let ckpt = summary.checkpoint.expect("a checkpoint");
    let files: Vec<PathBuf> = if ckpt.is_dir() {
        let mut f: Vec<PathBuf> = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pt"))
            .collect();
        f.sort();
        f
    } else {
        vec![ckpt]
    };
    let mut all = BTreeMap::new();
    for f in &files {
        tensors(&tandem::ckpt::load(f).unwrap(), p(f.file_name().unwrap().as_ref()), &mut all);
    }
    let losses = read_metrics(&metrics)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Epoch(e) => Some(e.train_loss.to_bits()),
            _ => None,
        })
        .collect();
    (all, losses)
}

/// The largest |a − b| over all tensors, and how many tensors differ at all.
fn compare(a: &BTreeMap<String, Vec<u8>>, b: &BTreeMap<String, Vec<u8>>) -> (f32, usize) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "other tensors");
    let (mut worst, mut differing) = (0f32, 0);
    for (k, x) in a {
        let y = &b[k];
        if x != y {
            differing += 1;
            let f = |v: &[u8]| -> Vec<f32> {
                v.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
            };
            for (p, q) in f(x).iter().zip(f(y)) {
                worst = worst.max((p - q).abs());
            }
        }
    }
    (worst, differing)
}

/// Trains `args` twice on one rank x 2 threads and twice on 2 ranks x 1 thread; asserts equal
/// bits within each pair.
fn twice_each(name: &str, args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    for (ranks, threads) in [(1usize, 2usize), (2, 1)] {
        let n = ranks.to_string();
        let mut a = args.to_vec();
        a.extend(["--nproc-per-node", &n]);
        let first = outcome(&train(&a, &dir.path().join(format!("{ranks}-a")), threads));
        let second = outcome(&train(&a, &dir.path().join(format!("{ranks}-b")), threads));
        let (worst, differing) = compare(&first.0, &second.0);
        println!(
            "{name}: {ranks} rank(s) x {threads} thread(s), two runs: {} tensors, max |dw| = {worst:e}, {differing} differ; losses {}",
            first.0.len(),
            if first.1 == second.1 { "equal" } else { "differ" }
        );
        assert_eq!(differing, 0, "{name} on {ranks} rank(s) x {threads} threads: max |dw| {worst}");
        assert!(!first.1.is_empty(), "no epoch losses recorded");
        assert_eq!(first.1, second.1, "{name}: epoch losses differ between two runs");
    }
}

#[test]
fn classifier_runs_are_bitwise_repeatable() {
    // The CIFAR ResNet on synthetic images: 3x3 convolutions (Winograd), BatchNorm, pooling.
    twice_each(
        "resnet18",
        &[
            "--model",
            "resnet18",
            "--width",
            "8",
            "--data",
            "synthetic-cifar:64",
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--lr-scheduler",
            "cosine",
            "--seed",
            "3",
        ],
    );
}

#[test]
fn face_recipe_runs_are_bitwise_repeatable() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("faces");
    let mut c = Command::new(env!("CARGO_BIN_EXE_tandem"));
    without_world(&mut c);
    c.args([
        "data",
        "synth-faces",
        p(&data),
        "--classes",
        "8",
        "--per-class",
        "4",
        "--pairs",
        "40",
    ]);
    assert!(output_with_deadline(&mut c, LIMIT).status.success(), "synth-faces failed");
    let rec = format!("rec:{}", data.display());
    let val = data.join("pairs.bin");
    twice_each(
        "iresnet18",
        &[
            "--model",
            "iresnet18",
            "--width",
            "8",
            "--embedding-size",
            "16",
            "--data",
            &rec,
            "--val",
            p(&val),
            "--batch-size",
            "4",
            "--epochs",
            "2",
            "--sample-rate",
            "0.5",
            "--augment",
            "--lr-scheduler",
            "poly",
            "--warmup-steps",
            "1",
            "--clip-grad-norm",
            "5",
            "--seed",
            "7",
        ],
    );
}
