//! End-to-end tests of the main job, `tandem train`, with real ranks on loopback.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use tandem::train::metrics::{last_summary, RunSummary};
use tandem_testutil::{output_with_deadline, torch_python};

const LIMIT: Duration = Duration::from_secs(180);

fn tandem() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tandem"));
    // Each test is its own job: never inherit a world from an outer launcher.
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TANDEM_TRAIN_WORKER",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
    ] {
        c.env_remove(v);
    }
    c
}

fn run(args: &[&str]) -> Output {
    let out = output_with_deadline(tandem().args(args), LIMIT);
    if !out.status.success() {
        panic!(
            "tandem {args:?} failed ({:?})\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

/// Parses `final: k=v k=v ...` (the one summary line) into pairs.
fn final_line(stdout: &[u8]) -> Vec<(String, String)> {
    let text = String::from_utf8_lossy(stdout);
    let finals: Vec<&str> = text.lines().filter(|l| l.starts_with("final: ")).collect();
    assert_eq!(finals.len(), 1, "exactly one final line expected in:\n{text}");
    assert_eq!(
        text.lines().last(),
        Some(finals[0]),
        "the final line must be the last line:\n{text}"
    );
    finals[0]["final: ".len()..]
        .split(' ')
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("k=v");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Runs `tandem ARGS` (which name the run directory with `--out`) and returns its output and the
/// run's typed summary, read from the run directory's `metrics.jsonl` (not from stdout).
fn train(args: &[&str]) -> (Output, RunSummary) {
    let out = run(args);
    let dir = args
        .iter()
        .position(|a| *a == "--out")
        .map(|i| Path::new(args[i + 1]))
        .expect("tests name the run directory with --out");
    let metrics = dir.join("metrics.jsonl");
    let summary = last_summary(&metrics)
        .unwrap_or_else(|e| panic!("reading {}: {e}", metrics.display()))
        .unwrap_or_else(|| panic!("no run summary in {}", metrics.display()));
    (out, summary)
}

/// The run's last checkpoint as one dict (a sharded one, `--zero`'s, consolidated).
fn checkpoint_of(s: &RunSummary) -> tandem::ckpt::Value {
    let path = s.checkpoint.as_ref().expect("the run wrote a checkpoint");
    tandem::train::checkpoint::Saved::open(path)
        .and_then(|saved| saved.consolidated())
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

fn get<'a>(kv: &'a [(String, String)], key: &str) -> &'a str {
    &kv.iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no `{key}` in final line {kv:?}"))
        .1
}

fn weights(path: &Path) -> Vec<(String, tandem::ckpt::TensorData)> {
    let v = tandem::ckpt::load(path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let mut out: Vec<(String, tandem::ckpt::TensorData)> = v
        .as_dict()
        .expect("a state dict")
        .iter()
        .map(|(k, t)| {
            (k.as_str().expect("str key").to_string(), t.as_tensor().expect("tensor").clone())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn two_ranks_learn_digits_and_leave_a_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let (out, summary) =
        train(&["train", "--epochs", "4", "--out", out_dir.to_str().unwrap(), "--tensorboard"]);
    assert_eq!(summary.epochs, 4);
    let acc = summary.eval_accuracy.expect("an eval accuracy");
    assert!(acc >= 0.9, "eval accuracy {acc} after 4 epochs on digits");
    let steps = summary.steps;
    // 1500 training digits over 2 ranks, 32 per rank per step: 24 steps an epoch.
    assert_eq!(steps, 4 * 24);
    assert_eq!(summary.epochs_seen.len(), 4);
    // The printed `final:` line (an interface kept for people and scripts) says the same.
    let kv = final_line(&out.stdout);
    assert_eq!(get(&kv, "epochs"), "4");
    assert_eq!(get(&kv, "steps"), steps.to_string());
    assert_eq!(get(&kv, "eval_accuracy"), format!("{acc:.4}"));
    let ckpt = summary.checkpoint.clone().expect("a checkpoint");
    assert_eq!(get(&kv, "checkpoint"), ckpt.display().to_string());
    assert!(ckpt.starts_with(&out_dir), "checkpoint {ckpt:?} outside the run directory");
    let value = tandem::ckpt::load(&ckpt).unwrap();
    for key in [
        "epoch",
        "global_step",
        "model",
        "optimizer",
        "scheduler",
        "sampler",
        "rng",
        "world_size",
        "config",
        "tandem_version",
    ] {
        assert!(value.get(key).is_some(), "checkpoint lacks `{key}`");
    }
    assert_eq!(value.get("global_step").and_then(|v| v.as_int()), Some(steps as i64));
    assert_eq!(value.get("world_size").and_then(|v| v.as_int()), Some(2));
    let config = std::fs::read_to_string(out_dir.join("config.toml")).unwrap();
    assert!(config.contains("epochs = 4"), "config.toml:\n{config}");
    // One line per epoch before the summary.
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().filter(|l| l.starts_with("epoch ")).count(), 4, "{text}");

    // TensorBoard reads the event file (when a Python with tensorboard is around).
    if let Some(py) = torch_python() {
        let script = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1]); acc.Reload()
tags = acc.Tags()["scalars"]
print(sorted(tags)); print(len(acc.Scalars("eval/accuracy")), acc.Scalars("eval/accuracy")[-1].value)
"#;
        let o = output_with_deadline(
            Command::new(py).args(["-c", script, out_dir.join("tensorboard").to_str().unwrap()]),
            Duration::from_secs(120),
        );
        let s = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "tensorboard could not read the events: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for tag in ["train/loss", "train/lr", "eval/accuracy", "train/samples_per_s"] {
            assert!(s.contains(tag), "tag {tag} missing from {s}");
        }
        let last = s.lines().nth(1).unwrap();
        let (n, v) = last.split_once(' ').unwrap();
        assert_eq!(n, "4");
        assert!((v.parse::<f64>().unwrap() - acc).abs() < 1e-4, "tensorboard {v} vs final {acc}");
    }
}

/// Trains `common` whole into `dir/a`, and again into `dir/b` stopped after `stop_at` steps then
/// resumed; asserts the resume message and bit-identical final weights, and returns the whole
/// run's output, run directory and final weights (written as `ext`).
fn whole_and_resumed_agree(
    dir: &Path,
    common: &[&str],
    stop_at: &str,
    ext: &str,
) -> (RunSummary, PathBuf, Vec<(String, tandem::ckpt::TensorData)>) {
    let whole = dir.join(format!("whole.{ext}"));
    let a = dir.join("a");
    let mut args =
        vec!["train", "--out", a.to_str().unwrap(), "--save-final", whole.to_str().unwrap()];
    args.extend(common);
    let (_, whole_summary) = train(&args);

    let b = dir.join("b");
    let resumed = dir.join(format!("resumed.{ext}"));
    let mut first = vec!["train", "--out", b.to_str().unwrap(), "--steps", stop_at];
    first.extend(common);
    run(&first);
    let mut second = vec![
        "train",
        "--out",
        b.to_str().unwrap(),
        "--resume",
        "--save-final",
        resumed.to_str().unwrap(),
    ];
    second.extend(common);
    let (out, summary) = train(&second);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("resumed from"), "no resume message:\n{err}");
    assert_eq!(summary.steps, whole_summary.steps);

    let (x, y) = (weights(&whole), weights(&resumed));
    assert_eq!(x.len(), y.len());
    for ((kx, tx), (ky, ty)) in x.iter().zip(&y) {
        assert_eq!(kx, ky);
        assert!(tx.contiguous_bytes() == ty.contiguous_bytes(), "{kx} differs after resume");
    }
    (whole_summary, a, x)
}

#[test]
fn interrupted_and_resumed_run_ends_with_bitwise_identical_weights() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["--epochs", "2", "--batch-size", "50", "--hidden", "32"];
    // Stop mid-epoch 1 (epoch has 15 steps), then resume to the end.
    let (summary, _, _) = whole_and_resumed_agree(dir.path(), &common, "7", "pt");
    assert_eq!(summary.steps, 30);
}

/// `--resume` with another `--nproc-per-node` (2 -> 3 -> 2, and 4 -> 1): the rest of the epoch is
/// split over the new world, so the step counts are those of each sample seen once.
#[test]
fn resume_on_another_world_size_splits_the_rest_of_the_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out = out.to_str().unwrap();
    let resume_run = |extra: &[&str]| {
        let mut args = vec!["train", "--out", out];
        args.extend(extra);
        let (o, summary) = train(&args);
        (summary, String::from_utf8_lossy(&o.stderr).into_owned())
    };
    // 1500 digits, 32 per rank per step. 2 ranks: 24 steps an epoch; 30 steps end 6 steps
    // (384 samples) into epoch 1.
    resume_run(&["--steps", "30"]);
    // 3 ranks: 1116 samples left, 96 a step: 10 steps stop mid-split, 960 more samples used.
    let (kv, err) = resume_run(&["--resume", "--nproc-per-node", "3", "--steps", "40"]);
    assert_eq!(kv.steps, 40);
    assert!(
        err.contains("written by 2 ranks, this run has 3")
            && err.contains("the rest of epoch 1 (1116 samples not yet seen, after the first 384"),
        "{err}"
    );
    let ck = checkpoint_of(&kv);
    let sampler = ck.get("sampler").unwrap();
    assert_eq!(sampler.get("start").and_then(|v| v.as_int()), Some(384));
    assert_eq!(sampler.get("num_replicas").and_then(|v| v.as_int()), Some(3));
    // Back to 2 ranks: 1500 - 384 - 960 = 156 left, 64 a step: 3 steps close epoch 1, then
    // epoch 2 is an ordinary 24-step epoch.
    let (kv, err) = resume_run(&["--resume", "--epochs", "3"]);
    assert!(err.contains("156 samples not yet seen, after the first 1344"), "{err}");
    assert_eq!(kv.steps, 40 + 3 + 24);
    assert_eq!(kv.epochs, 3);

    // 4 -> 1: 12 steps an epoch (375 per rank); 10 steps use 1280; 220 left for 1 rank: 7 steps.
    let four = dir.path().join("four");
    let four = four.to_str().unwrap();
    run(&["train", "--out", four, "--nproc-per-node", "4", "--steps", "10"]);
    let (o, kv) =
        train(&["train", "--out", four, "--nproc-per-node", "1", "--resume", "--epochs", "1"]);
    assert_eq!(kv.steps, 17);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("written by 4 ranks, this run has 1"), "{err}");
}

#[test]
fn matches_pytorch_ddp_from_a_pytorch_init() {
    // Fixture: crates/tandem/tests/fixtures/train_mnist/make_fixture.py (2 gloo ranks, SGD momentum).
    let dir = tempfile::tempdir().unwrap();
    let data = format!("mnist:{}", fixture("train_mnist/mnist").display());
    let init = fixture("train_mnist/init.pt");
    let out = dir.path().join("final.pt");
    run(&[
        "train",
        "--data",
        &data,
        "--model",
        "mlp",
        "--hidden",
        "32",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
        "--no-shuffle",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--nproc-per-node",
        "2",
        "--init-from",
        init.to_str().unwrap(),
        "--save-final",
        out.to_str().unwrap(),
        "--out",
        dir.path().join("run").to_str().unwrap(),
    ]);
    let ours = weights(&out);
    let torch = weights(&fixture("train_mnist/final.pt"));
    assert_eq!(ours.len(), 4);
    let mut moved = 0.0f64;
    let init_w = weights(&init);
    for (((k, t), (tk, tt)), (_, it)) in ours.iter().zip(&torch).zip(&init_w) {
        assert_eq!(format!("module.{k}"), *tk, "torch saved DDP keys");
        let (a, b, i) = (t.to_f64_vec(), tt.to_f64_vec(), it.to_f64_vec());
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(diff <= 1e-4, "{k}: max abs difference {diff} from PyTorch DDP");
        moved = moved.max(b.iter().zip(&i).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max));
    }
    assert!(moved > 1e-3, "training must have moved the weights (max change {moved})");
}

#[test]
fn bad_flags_and_files_are_named_in_the_error() {
    let o = output_with_deadline(tandem().args(["train", "--batch-size", "0"]), LIMIT);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--batch-size"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // The GPU flags: nccl needs CUDA buffers; a CPU-only build says how to get CUDA.
    let o = output_with_deadline(tandem().args(["train", "--backend", "nccl"]), LIMIT);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--backend nccl: reduces GPU buffers: set --device to cuda"), "{err}");
    if !cfg!(feature = "cuda") {
        let o = output_with_deadline(tandem().args(["train", "--device", "cuda"]), LIMIT);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("--device cuda: this build has no CUDA support"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
    }

    // A negative learning rate is a value with a reason, not clap's usage for an unknown `-1`.
    for (lr, shown) in [("-1", "-1"), ("0", "0"), ("nan", "NaN")] {
        let o = output_with_deadline(tandem().args(["train", "--lr", lr]), LIMIT);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "--lr {lr}: {err}");
        assert!(err.contains(&format!("--lr {shown}: must be a positive number")), "{err}");
    }

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.pt");
    let o = output_with_deadline(
        tandem().args([
            "train",
            "--nproc-per-node",
            "1",
            "--epochs",
            "1",
            "--init-from",
            missing.to_str().unwrap(),
            "--out",
            dir.path().join("r").to_str().unwrap(),
        ]),
        LIMIT,
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("nope.pt"), "error must name the file:\n{err}");

    // A checkpoint of another model shape is refused with the key named, not loaded silently.
    let o = output_with_deadline(
        tandem().args([
            "train",
            "--nproc-per-node",
            "1",
            "--epochs",
            "1",
            "--init-from",
            fixture("train_mnist/init.pt").to_str().unwrap(),
            "--out",
            dir.path().join("r2").to_str().unwrap(),
        ]),
        LIMIT,
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("fc1.weight"), "error must name the mismatched key:\n{err}");
}

#[test]
fn the_cnn_trains_on_three_channel_cifar_shaped_data() {
    let dir = tempfile::tempdir().unwrap();
    let o = output_with_deadline(
        tandem().args([
            "train",
            "--nproc-per-node",
            "1",
            "--model",
            "cnn",
            "--data",
            "synthetic-cifar:64",
            "--epochs",
            "1",
            "--out",
            dir.path().join("r").to_str().unwrap(),
        ]),
        LIMIT,
    );
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("final: epochs=1"), "{out}\n{err}");
}

/// Largest absolute difference per key between two state dicts with the same keys, and the
/// largest change of any float parameter (not a buffer) from `init` in `reference`.
fn state_dict_gap(
    ours: &[(String, tandem::ckpt::TensorData)],
    reference: &[(String, tandem::ckpt::TensorData)],
    init: &[(String, tandem::ckpt::TensorData)],
) -> (f64, String, f64) {
    let names = |s: &[(String, tandem::ckpt::TensorData)]| {
        s.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>()
    };
    assert_eq!(names(ours), names(reference), "the same keys as PyTorch's state dict");
    let (mut worst, mut worst_key, mut moved) = (0.0f64, String::new(), 0.0f64);
    for (((k, a), (_, b)), (_, i)) in ours.iter().zip(reference).zip(init) {
        let (a, b, i) = (a.to_f64_vec(), b.to_f64_vec(), i.to_f64_vec());
        let gap = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        if gap > worst {
            (worst, worst_key) = (gap, k.clone());
        }
        if !k.contains("running_") && !k.ends_with("num_batches_tracked") {
            moved = moved.max(b.iter().zip(&i).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max));
        }
    }
    (worst, worst_key, moved)
}

#[test]
fn resnet18_matches_pytorch_ddp_and_sync_batchnorm() {
    // Reference: tests/fixtures/train_resnet/reference.py (2 gloo ranks, DistributedSampler
    // shuffle with seed 3, SGD momentum 0.9, batch 8 per rank, ResNet-18 at width 8).
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = tandem_testutil::free_port().to_string();
    let script = fixture("train_resnet/reference.py");
    let made = output_with_deadline(
        Command::new(&python).args([script.to_str().unwrap(), d.to_str().unwrap(), &port]),
        LIMIT,
    );
    assert!(
        made.status.success(),
        "reference.py failed:\n{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let init = weights(&d.join("init.pt"));
    for (reference, sync) in [("ddp.pt", false), ("syncbn.pt", true)] {
        let ours = d.join(format!("ours-{reference}"));
        let data = format!("cifar10:{}", d.join("cifar").display());
        let mut args = vec![
            "train",
            "--model",
            "resnet18",
            "--width",
            "8",
            "--data",
            &data,
            "--batch-size",
            "8",
            "--epochs",
            "2",
            "--lr",
            "0.002",
            "--momentum",
            "0.9",
            "--seed",
            "3",
            "--nproc-per-node",
            "2",
        ];
        if sync {
            args.push("--sync-batchnorm");
        }
        let init_path = d.join("init.pt");
        let out_dir = d.join(format!("run-{sync}"));
        args.extend(["--init-from", init_path.to_str().unwrap()]);
        args.extend(["--save-final", ours.to_str().unwrap(), "--out", out_dir.to_str().unwrap()]);
        let (_, summary) = train(&args);
        assert_eq!(summary.steps, 6);
        let (gap, key, moved) =
            state_dict_gap(&weights(&ours), &weights(&d.join(reference)), &init);
        eprintln!(
            "{reference}: max |tandem - torch| = {gap:.3e} ({key}); weights moved {moved:.3e}"
        );
        assert!(gap <= 2e-3, "{reference}: `{key}` differs from PyTorch by {gap}");
        assert!(moved > 5e-3, "{reference}: training must move the weights (max change {moved})");
    }
}

#[test]
fn resnet18_with_augmentation_resumes_mid_epoch_to_bitwise_identical_weights() {
    let dir = tempfile::tempdir().unwrap();
    // 48 images, 2 ranks x batch 8: 3 steps per epoch, 6 in all.
    let common = [
        "--model",
        "resnet18",
        "--width",
        "4",
        "--data",
        "synthetic-cifar:48",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--normalize",
        "--augment",
        "--sync-batchnorm",
        "--nproc-per-node",
        "2",
    ];
    let (summary, a, x) = whole_and_resumed_agree(dir.path(), &common, "4", "safetensors");
    assert_eq!(summary.steps, 6);
    let config = std::fs::read_to_string(a.join("config.toml")).unwrap();
    for line in ["model = \"resnet18\"", "width = 4", "augment = true", "normalize = true"] {
        assert!(config.contains(line), "config.toml lacks `{line}`:\n{config}");
    }
    assert_eq!(x.len(), 122, "62 parameters and 60 BatchNorm buffers");
}

#[test]
fn resnet_flags_that_cannot_apply_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    for (args, expect) in [
        (vec!["--model", "mlp", "--sync-batchnorm"], "--sync-batchnorm"),
        (vec!["--model", "resnet18", "--data", "digits"], "--model resnet18: needs 3x32x32"),
        (vec!["--model", "resnet18", "--width", "0"], "--width"),
        (vec!["--data", "synthetic:64:10:3", "--augment"], "--augment: needs square images"),
    ] {
        let mut all =
            vec!["train", "--nproc-per-node", "1", "--epochs", "1", "--out", out.to_str().unwrap()];
        all.extend(&args);
        let o = output_with_deadline(tandem().args(&all), LIMIT);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(expect), "{args:?}: {err}");
    }
}

/// `--zero` (ZeRO-1): the same weights and optimizer state as the unsharded optimizer, bit for
/// bit; its checkpoints are directories of each rank's optimizer entries (nothing gathered),
/// whose consolidated state equals the unsharded run's, and a run resumes on another world size
/// and another mode.
#[test]
fn zero_sharded_optimizer_trains_the_same_weights_and_resumes_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let base = ["train", "--optimizer", "adamw", "--lr", "0.01", "--model", "cnn", "--steps", "10"];
    let mut finals = Vec::new();
    for (name, extra) in [("zero", &["--zero"][..]), ("plain", &[][..])] {
        let mut args: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        args.extend([
            "--out".into(),
            path(name),
            "--save-final".into(),
            path(&format!("{name}.pt")),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let (_, summary) = train(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let ck = checkpoint_of(&summary);
        let at = summary.checkpoint.clone().unwrap();
        assert_eq!(at.is_dir(), name == "zero", "{}: sharded only with --zero", at.display());
        finals.push((weights(Path::new(&path(&format!("{name}.pt")))), ck));
    }
    let ((zw, zck), (pw, pck)) = (&finals[0], &finals[1]);
    assert!(zck.get("optimizer").unwrap().get("state").unwrap().as_dict().unwrap().len() > 2);
    assert_eq!(zw, pw, "--zero changed the weights");
    assert_eq!(zck.get("optimizer"), pck.get("optimizer"), "--zero changed the optimizer state");
    let groups = zck.get("optimizer").unwrap().get("param_groups").unwrap().as_list().unwrap();
    let listed = groups[0].get("params").unwrap().as_list().unwrap().len();
    assert_eq!(
        listed,
        zw.iter().filter(|(k, _)| !k.contains("running") && !k.contains("num_batches")).count()
    );

    // The --zero run resumed on 3 ranks (with --zero) and the plain run resumed with --zero.
    for (name, ranks) in [("zero", "3"), ("plain", "2")] {
        let (o, kv) = train(&[
            "train",
            "--optimizer",
            "adamw",
            "--lr",
            "0.01",
            "--model",
            "cnn",
            "--steps",
            "14",
            "--out",
            &path(name),
            "--resume",
            "--zero",
            "--nproc-per-node",
            ranks,
        ]);
        assert_eq!(kv.steps, 14, "{name}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("resumed from"), "{name}");
        let ck = checkpoint_of(&kv);
        assert_eq!(ck.get("world_size").and_then(|v| v.as_int()), Some(ranks.parse().unwrap()));
    }
}

/// `--precision bf16|f16`: the MLP computes in 16 bits over float32 weights (the weights differ
/// from a float32 run's but learn as well); f16 runs a GradScaler whose state is in every
/// checkpoint and continues on resume; a float32 checkpoint resumed with f16 says it starts a
/// fresh scale; the cnn trains under f16 as well.
#[test]
fn mixed_precision_trains_and_its_grad_scaler_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let mut finals = Vec::new();
    for precision in ["f32", "bf16", "f16"] {
        let (o, kv) = train(&[
            "train",
            "--precision",
            precision,
            "--steps",
            "48",
            "--out",
            &path(precision),
            "--save-final",
            &path(&format!("{precision}.pt")),
        ]);
        let acc = kv.eval_accuracy.expect("an eval accuracy");
        assert!(acc >= 0.85, "--precision {precision}: eval accuracy {acc} after 2 epochs");
        let w = weights(Path::new(&path(&format!("{precision}.pt"))));
        assert!(w.iter().all(|(_, t)| t.dtype == tandem::ckpt::ElemType::F32), "{precision}");
        let ck = checkpoint_of(&kv);
        finals.push((w, ck, String::from_utf8_lossy(&o.stdout).to_string()));
    }
    let (f32w, f32ck, _) = &finals[0];
    let (bf16w, _, _) = &finals[1];
    let (_, f16ck, f16out) = &finals[2];
    assert_ne!(f32w, bf16w, "bf16 computation left the weights bit-identical to float32's");
    assert!(f32ck.get("scaler").is_none(), "a float32 run has no scaler state");
    assert!(f16out.contains("loss_scale="), "{f16out}");
    let scaler = f16ck.get("scaler").expect("the f16 checkpoint holds the GradScaler");
    let num = |v: &tandem::ckpt::Value, k: &str| match v.get(k) {
        Some(tandem::ckpt::Value::Float(f)) => *f,
        Some(tandem::ckpt::Value::Int(i)) => *i as f64,
        other => panic!("scaler `{k}`: {other:?}"),
    };
    assert_eq!(num(scaler, "growth_interval"), 2000.0);
    let (scale, tracker) = (num(scaler, "scale"), num(scaler, "_growth_tracker"));
    assert!(scale > 0.0 && (1.0..=48.0).contains(&tracker), "scale {scale}, tracker {tracker}");

    // Resumed for 12 more steps, the scaler continues from the checkpoint (this run skips no
    // step: the tracker adds up).
    let (_, summary) =
        train(&["train", "--precision", "f16", "--steps", "60", "--out", &path("f16"), "--resume"]);
    let ck = checkpoint_of(&summary);
    let after = ck.get("scaler").unwrap();
    assert_eq!(num(after, "scale"), scale);
    assert_eq!(num(after, "_growth_tracker"), tracker + 12.0);
    // A float32 checkpoint resumed in f16: a fresh scaler, said so.
    let o =
        run(&["train", "--precision", "f16", "--steps", "50", "--out", &path("f32"), "--resume"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("no GradScaler state"), "{stderr}");

    // The convolution nets train under f16 too (f32 kernels, 16-bit input and logits, loss
    // scaling), as well as in f32.
    let (o, summary) = train(&[
        "train",
        "--precision",
        "f16",
        "--model",
        "cnn",
        "--epochs",
        "2",
        "--out",
        &path("cnn"),
    ]);
    let acc = summary.eval_accuracy.expect("an eval accuracy");
    assert!(acc >= 0.85, "--model cnn --precision f16: eval accuracy {acc}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("loss_scale="));
}

/// `--lr-scheduler` steps after every optimizer step (arcface_torch's order) over the whole of
/// --epochs, its state is in every checkpoint and continues on resume; `--clip-grad-norm` runs.
#[test]
fn lr_scheduler_is_checkpointed_and_continues_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("poly");
    let out = out.to_str().unwrap();
    let sched_of = |args: &[&str]| {
        let ck = checkpoint_of(&train(args).1);
        ck.get("scheduler").cloned().expect("a scheduler state")
    };
    let int = |v: &tandem::ckpt::Value, k: &str| v.get(k).and_then(|x| x.as_int()).unwrap();
    let args = [
        "train",
        "--lr-scheduler",
        "poly",
        "--warmup-steps",
        "4",
        "--clip-grad-norm",
        "1",
        "--epochs",
        "2",
        "--out",
        out,
    ];
    let mut first = args.to_vec();
    first.extend(["--steps", "10"]);
    let s = sched_of(&first);
    assert_eq!(int(&s, "last_epoch"), 9, "10 steps taken: {s:?}");
    assert_eq!(int(&s, "warmup_steps"), 4);
    let max_steps = int(&s, "max_steps");
    let mut second = args.to_vec();
    second.extend(["--steps", "14", "--resume"]);
    let s = sched_of(&second);
    assert_eq!(int(&s, "last_epoch"), 13, "the schedule continued: {s:?}");
    assert_eq!(int(&s, "max_steps"), max_steps, "the same curve after a same-world resume");
    // The lr after step t+1 is insightface's formula at t (the first two steps run at lr 0).
    let lr = s.get("_last_lr").and_then(|l| l.as_list()).and_then(|l| l[0].as_float()).unwrap();
    let want = 0.05 * (1.0 - (13.0 - 4.0) / (max_steps as f64 - 4.0)).powi(2);
    assert!((lr - want).abs() < 1e-12, "lr {lr}, formula {want}");
    for kind in ["cosine", "step"] {
        let dir = format!("{out}-{kind}");
        let s = sched_of(&["train", "--lr-scheduler", kind, "--steps", "5", "--out", &dir]);
        assert!(s.get("last_epoch").is_some(), "--lr-scheduler {kind}");
    }
}

/// `--no-checkpoints`: a run saves nothing (no epoch-end, periodic or final checkpoint), its
/// summary names none, and `--save-final` still writes the final weights.
#[test]
fn no_checkpoints_writes_none_and_still_saves_the_final_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let weights_path = dir.path().join("final.pt");
    let (out, summary) = train(&[
        "train",
        "--epochs",
        "2",
        "--save-every",
        "5",
        "--no-checkpoints",
        "--save-final",
        weights_path.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert_eq!(summary.epochs, 2);
    assert!(summary.checkpoint.is_none(), "{:?}", summary.checkpoint);
    let kv = final_line(&out.stdout);
    assert_eq!(get(&kv, "checkpoint"), "-", "the final line names no checkpoint");
    let ckpts = out_dir.join("checkpoints");
    let written = std::fs::read_dir(&ckpts).map(|d| d.count()).unwrap_or(0);
    assert_eq!(written, 0, "{} holds checkpoints", ckpts.display());
    assert!(!weights(&weights_path).is_empty(), "--save-final wrote no weights");
}

/// The largest difference between two state dicts with the same keys, and where.
fn max_gap(
    a: &[(String, tandem::ckpt::TensorData)],
    b: &[(String, tandem::ckpt::TensorData)],
) -> (f64, String) {
    let (worst, at, _) = state_dict_gap(a, b, b);
    (worst, at)
}

/// `--fsdp` (the model sharded, FSDP2's `fully_shard`): the cnn (BatchNorm statistics kept per
/// rank) trains the weights Ddp trains, with AdamW and clipping (the norm summed over the
/// ranks' shards); its checkpoint holds each rank's rows and resumes on 3 ranks as Ddp's
/// resumes; `--fsdp-units`/`--hsdp-rows` without `--fsdp`, and `--fsdp` with `--zero`, are
/// refused by name; a config's `[fsdp]` section is the flags.
#[test]
fn fsdp_trains_the_weights_ddp_trains_and_resumes_on_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let base = [
        "train",
        "--model",
        "cnn",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--clip-grad-norm",
        "0.5",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let runs: [(&str, &[&str]); 5] = [
        ("fsdp", &["--fsdp"]),
        ("ddp", &[]),
        ("fsdp-bf16-reduce", &["--fsdp", "--fsdp-reduce-dtype", "bf16"]),
        ("ddp-bf16-hook", &["--comm-hook", "bf16"]),
        ("fsdp-bf16", &["--fsdp", "--fsdp-param-dtype", "bf16"]),
    ];
    for (name, extra) in runs {
        let out = path(name);
        let fin = path(&format!("{name}.pt"));
        let mut args = with(&["--steps", "10", "--out", &out, "--save-final", &fin]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let (o, summary) = train(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let sharded = summary.checkpoint.clone().unwrap().is_dir();
        let fsdp = name.starts_with("fsdp");
        assert_eq!(sharded, fsdp, "{name}: a directory of row shards only with --fsdp");
        if name == "fsdp" {
            let said = String::from_utf8_lossy(&o.stderr);
            assert!(said.contains("sharded over 2 ranks"), "{said}");
        }
    }
    let (gap, at) =
        max_gap(&weights(Path::new(&path("fsdp.pt"))), &weights(Path::new(&path("ddp.pt"))));
    // Reduce-scatter and all-reduce average the same two gradients: equal but for rounding.
    assert!(gap < 1e-5, "--fsdp moved `{at}` {gap} away from Ddp's weights");
    // FSDP2's MixedPrecisionPolicy: gradients reduce-scattered in bf16 are what Ddp's bf16
    // compression hook (PyTorch's bf16_compress_hook) all-reduces, bit for bit; parameters
    // all-gathered in bf16 train other weights, within the 10 steps' reach (10 x lr).
    let final_of = |name: &str| weights(Path::new(&path(&format!("{name}.pt"))));
    let (gap, at) = max_gap(&final_of("fsdp-bf16-reduce"), &final_of("ddp-bf16-hook"));
    assert_eq!(gap, 0.0, "bf16 reduce-scatters: `{at}` {gap} from Ddp's bf16 hook");
    let (gap, at) = max_gap(&final_of("fsdp-bf16"), &final_of("fsdp"));
    assert!(gap > 0.0 && gap < 0.1, "bf16 all-gathers: `{at}` {gap} from float32's");

    // Each checkpoint resumed on 1 and on 3 ranks for 4 more steps, in its own arrangement and
    // in the other (Ddp's checkpoint sharded, Fsdp's replicated), ends where Ddp's own resume
    // does: on 1 rank exactly (no sums to round); on 3 the three-way sums round differently in
    // a reduce-scatter and an all-reduce, which AdamW magnifies where the gradient is zero but
    // for rounding — `conv1.bias`, BatchNorm right after it (seen: 2.7e-3, a fraction of one
    // step, and `bn1.running_mean` following it) — every other weight within 1e-6 (seen: 3e-8).
    let resumes = [
        ("fsdp", "fsdp", true),
        ("ddp", "ddp", false),
        ("ddp", "ddp-as-fsdp", true),
        ("fsdp", "fsdp-as-ddp", false),
    ];
    for ranks in ["1", "3"] {
        for (from, name, sharded) in resumes {
            let out = path(&format!("{name}-on-{ranks}"));
            let copied = Command::new("cp").args(["-r", &path(from), &out]).status().unwrap();
            assert!(copied.success());
            let fin = path(&format!("{name}-on-{ranks}.pt"));
            let mut args = with(&["--steps", "14", "--out", &out, "--resume"]);
            args.extend(["--nproc-per-node", ranks, "--save-final", &fin].map(String::from));
            if sharded {
                args.push("--fsdp".into());
            }
            let (o, kv) = train(&args.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(kv.steps, 14, "{name}");
            let said = String::from_utf8_lossy(&o.stderr);
            assert!(said.contains("resumed from"), "{name}: {said}");
            if name == "fsdp" {
                assert!(said.contains(&format!("re-split from 2 ranks to {ranks}")), "{said}");
            }
            if name == "ddp-as-fsdp" {
                assert!(said.contains("a replicated model's checkpoint, sharded"), "{said}");
            }
        }
        let resumed = |name: &str| weights(Path::new(&path(&format!("{name}-on-{ranks}.pt"))));
        let ddp = resumed("ddp");
        let washed_out = |k: &str| ranks == "3" && ["conv1.bias", "bn1.running_mean"].contains(&k);
        let keep = |s: &[(String, tandem::ckpt::TensorData)]| -> Vec<_> {
            s.iter().filter(|(k, _)| !washed_out(k)).cloned().collect()
        };
        for name in ["fsdp", "ddp-as-fsdp", "fsdp-as-ddp"] {
            let other = resumed(name);
            let (gap, at) = max_gap(&keep(&other), &keep(&ddp));
            assert!(gap < 1e-6, "{name} on {ranks} ranks: `{at}` is {gap} from Ddp's resume");
            let (gap, at) = max_gap(&other, &ddp);
            assert!(gap < 0.01, "{name} on {ranks} ranks: `{at}` moved {gap}, more than a step");
        }
    }

    // The converted full state dict starts a Ddp run from the sharded run's weights.
    let full = path("fsdp-full.pt");
    let ckpt = dir.path().join("fsdp/checkpoints/step-00000010");
    run(&["ckpt", "convert", ckpt.to_str().unwrap(), &full]);
    let (out, fin) = (path("from-fsdp"), path("from-fsdp.pt"));
    let args = with(&["--steps", "0", "--out", &out, "--init-from", &full, "--save-final", &fin]);
    train(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let started = weights(Path::new(&fin));
    let (gap, at) = max_gap(&started, &weights(Path::new(&path("fsdp.pt"))));
    assert_eq!(gap, 0.0, "`{at}`: the converted checkpoint's weights are the run's");

    // Settings of a sharded model need it; what it shards already is refused by name.
    for (args, expect) in [
        (vec!["--fsdp-units", "root"], "--fsdp"),
        (vec!["--hsdp-rows", "2"], "--fsdp"),
        (vec!["--fsdp-activation-checkpointing", "true"], "--fsdp"),
        (vec!["--fsdp", "--zero"], "--zero"),
        (vec!["--fsdp", "--comm-hook", "fp16"], "--comm-hook"),
        (vec!["--fsdp", "--hsdp-rows", "3"], "--hsdp-rows"),
    ] {
        let mut all = vec!["train", "--steps", "1", "--no-checkpoints"];
        all.extend(&args);
        let o = output_with_deadline(tandem().args(&all), LIMIT);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(expect), "{args:?}: {err}");
    }
    // A config file's `[fsdp]` section turns it on with its keys; an unknown key is named.
    let config = dir.path().join("fsdp.toml");
    let section =
        "[fsdp]\nunits = \"root\"\nreshard_after_forward = false\nparam-dtype = \"bf16\"\n\
                   activation_checkpointing = true\n";
    std::fs::write(&config, format!("steps = 2\n{section}")).unwrap();
    let out = path("from-config");
    let (o, _) = train(&["train", "--config", config.to_str().unwrap(), "--out", &out]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("sharded over 2 ranks"));
    let toml = std::fs::read_to_string(dir.path().join("from-config/config.toml")).unwrap();
    assert!(toml.contains("fsdp = true") && toml.contains("fsdp_reshard_after_forward = false"));
    assert!(toml.contains("fsdp_param_dtype = \"bf16\""), "{toml}");
    assert!(toml.contains("fsdp_activation_checkpointing = true"), "{toml}");
    std::fs::write(&config, "[fsdp]\nshards = 3\nhsdp_rows = 1\n").unwrap();
    let o =
        output_with_deadline(tandem().args(["train", "--config", config.to_str().unwrap()]), LIMIT);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("unknown key `fsdp-shards`"), "{err}");
}
