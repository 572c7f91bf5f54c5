//! ONNX export: `tandem export` and `tandem train --export-onnx` write models that onnxruntime
//! runs with PyTorch's eval-mode outputs for the same weights (within 1e-4), checked by
//! tests/fixtures/onnx/onnx_check.py with pip `torch`, `onnx` and `onnxruntime`. Without them
//! those tests are reported as skipped with the reason, unless TANDEM_REQUIRE_ONNX=1 (CI), which
//! makes a missing onnxruntime a failure. The error tests need no Python.
//! Built with `harness = false` for that.
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};
use std::time::Duration;

use tandem_testutil::{harness, output_with_deadline, torch_python, without_world};

const LIMIT: Duration = Duration::from_secs(300);
/// The largest difference allowed between onnxruntime's and PyTorch's logits.
const TOLERANCE: f64 = 1e-4;

fn main() -> ExitCode {
    let why = harness::skip_unless_required(python().err(), "TANDEM_REQUIRE_ONNX");
    let mut tests = tandem_testutil::tests![
        pytorch_weights_exported_run_in_onnxruntime_like_pytorch,
        train_export_onnx_equals_the_export_of_its_final_weights,
    ];
    tests = tests.into_iter().map(|t| t.skip_if(why.clone())).collect();
    tests.extend(tandem_testutil::tests![wrong_model_or_bad_file_is_named]);
    harness::main(tests)
}

/// A Python with torch, onnx and onnxruntime, or why there is none.
fn python() -> Result<PathBuf, String> {
    let python = torch_python().ok_or("no Python with torch (see README)")?;
    let ok = Command::new(&python)
        .args(["-c", "import onnx, onnxruntime"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        Ok(python)
    } else {
        Err(format!(
            "{} cannot import onnx and onnxruntime (pip install onnx onnxruntime)",
            python.display()
        ))
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/onnx/onnx_check.py")
}

fn tandem(args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tandem"));
    without_world(&mut c);
    output_with_deadline(c.args(args), LIMIT)
}

fn ok(out: Output, what: &str) -> String {
    let text = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed ({:?})\n{text}", out.status);
    text
}

fn py(args: &[&str]) -> String {
    let python = python().unwrap_or_else(|e| panic!("{e}"));
    let mut c = Command::new(python);
    c.arg(script()).args(args);
    let out = output_with_deadline(&mut c, LIMIT);
    ok(out.clone(), &format!("onnx_check.py {args:?}"));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// onnx_check.py's report on WEIGHTS and ONNX; asserts the outputs agree within TOLERANCE.
fn check(model: &str, weights: &Path, onnx: &Path) -> serde_json::Value {
    let line = py(&["check", model, path(weights), path(onnx)]);
    let report: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad report {line:?}: {e}"));
    let diff = report["max_abs_diff"].as_f64().expect("max_abs_diff");
    assert!(diff <= TOLERANCE, "{model}: onnxruntime differs from PyTorch by {diff}: {report}");
    report
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn pytorch_weights_exported_run_in_onnxruntime_like_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, serde_json::Value, usize); 6] = [
        ("mlp", serde_json::json!(["batch", 20]), 6),
        ("cnn", serde_json::json!(["batch", 3, 12, 12]), 10),
        ("resnet18", serde_json::json!(["batch", 3, "height", "width"]), 62 + 20 * 2),
        // arcface_torch's IResNet-18: 31 BatchNorms x 4 (`features` included), 21 convolutions,
        // 9 PReLUs and fc's 2: every state-dict key but num_batches_tracked.
        ("iresnet18", serde_json::json!(["batch", 3, 112, 112]), 156),
        // arcface_torch's MobileFaceNet `mbf`: 49 convolutions, their BatchNorms (x4), 33
        // PReLUs, the GDC's Linear and BatchNorm1d (x4).
        ("mbf", serde_json::json!(["batch", 3, 112, 112]), 49 + 49 * 4 + 33 + 1 + 4),
        // arcface_torch's `vit_t`: pos_embed, the patch conv's 2, 12 blocks of 11, the final
        // norm's 2, the feature head's 2 Linears and 2 BatchNorm1d (x4); not the mask token.
        ("vit_t", serde_json::json!(["batch", 3, 112, 112]), 1 + 2 + 12 * 11 + 2 + 2 + 8),
    ];
    for (model, input_shape, initializers) in cases {
        let weights = dir.path().join(format!("{model}.pt"));
        let onnx = dir.path().join(format!("{model}.onnx"));
        // DDP-style `module.` keys, BatchNorm statistics far from their defaults.
        py(&["make", model, path(&weights)]);
        let text =
            ok(tandem(&["export", path(&weights), "--model", model, path(&onnx)]), "tandem export");
        assert!(text.contains(&format!("wrote {}", onnx.display())), "{text}");
        let report = check(model, &weights, &onnx);
        assert_eq!(report["input_shape"], input_shape, "{model}: {report}");
        assert_eq!(report["opset"], 17, "{model}");
        let face = model.starts_with("iresnet") || model == "mbf" || model == "vit_t";
        let output = if face { "embedding" } else { "logits" };
        assert_eq!(report["output"], output, "{model}: {report}");
        // Every weight and running statistic, named as in the state dict without `module.`.
        let names = report["initializers"].as_array().expect("initializers");
        assert_eq!(names.len(), initializers, "{model}: {names:?}");
        assert!(names.iter().all(|n| !n.as_str().unwrap().starts_with("module.")), "{names:?}");
        assert!(names.iter().all(|n| !n.as_str().unwrap().contains("num_batches")), "{names:?}");
    }
}

fn train_export_onnx_equals_the_export_of_its_final_weights() {
    let dir = tempfile::tempdir().unwrap();
    let runs: [(&str, &[&str]); 3] = [
        ("mlp", &["--data", "digits", "--hidden", "24"]),
        ("cnn", &["--data", "digits"]),
        ("resnet18", &["--data", "synthetic-cifar:32", "--width", "4", "--batch-size", "8"]),
    ];
    for (model, extra) in runs {
        let out = dir.path().join(format!("run-{model}"));
        let final_weights = dir.path().join(format!("{model}-final.pt"));
        let trained = dir.path().join(format!("{model}-train.onnx"));
        let exported = dir.path().join(format!("{model}-export.onnx"));
        let mut args = vec!["train", "--nproc-per-node", "2", "--model", model, "--steps", "3"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[
            "--out",
            path(&out),
            "--save-final",
            path(&final_weights),
            "--export-onnx",
            path(&trained),
        ]);
        let text = ok(tandem(&args), &format!("tandem train --model {model}"));
        assert!(text.contains(&format!("wrote {}: {model}", trained.display())), "{text}");

        // The same bytes from the weights file `--save-final` wrote.
        ok(tandem(&["export", path(&final_weights), "--model", model, path(&exported)]), "export");
        assert_eq!(
            std::fs::read(&trained).unwrap(),
            std::fs::read(&exported).unwrap(),
            "{model}: --export-onnx and `tandem export` of the final weights differ"
        );
        // And from the run's last training checkpoint (weights under `model`), which the run's
        // summary names.
        let metrics = out.join("metrics.jsonl");
        let ckpt = tandem::train::metrics::last_summary(&metrics)
            .ok()
            .flatten()
            .and_then(|s| s.checkpoint)
            .unwrap_or_else(|| panic!("no checkpoint in {}:\n{text}", metrics.display()));
        let from_ckpt = dir.path().join(format!("{model}-ckpt.onnx"));
        ok(tandem(&["export", path(&ckpt), "--model", model, path(&from_ckpt)]), "export");
        assert_eq!(std::fs::read(&trained).unwrap(), std::fs::read(&from_ckpt).unwrap(), "{model}");

        // Trained weights and running statistics: onnxruntime agrees with PyTorch.
        check(model, &ckpt, &trained);
    }
}

fn wrong_model_or_bad_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let weights = dir.path().join("cnn.pt");
    ok(
        tandem(&[
            "train",
            "--nproc-per-node",
            "1",
            "--model",
            "cnn",
            "--steps",
            "1",
            "--out",
            path(&run),
            "--save-final",
            path(&weights),
        ]),
        "train",
    );
    let onnx = dir.path().join("x.onnx");
    let fails = |args: &[&str], wants: &[&str]| {
        let out = tandem(args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{args:?} should fail");
        for w in wants {
            assert!(err.contains(w), "{args:?}: `{w}` not in:\n{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
        assert!(!onnx.exists(), "{args:?} left a file behind");
    };
    // A Cnn checkpoint named as an MLP: no fc1.weight.
    fails(
        &["export", path(&weights), "--model", "mlp", path(&onnx)],
        &["mlp", "`fc1.weight`", "cnn.pt"],
    );
    // As a ResNet: conv1 has a bias and 8 output channels but the wrong input channels/kernel.
    fails(&["export", path(&weights), "--model", "resnet18", path(&onnx)], &["resnet18", "conv1"]);
    // A file that is not there, and one that is not a checkpoint.
    let missing = dir.path().join("missing.pt");
    fails(&["export", path(&missing), "--model", "cnn", path(&onnx)], &["missing.pt"]);
    let junk = dir.path().join("junk.pt");
    std::fs::write(&junk, b"not a checkpoint").unwrap();
    fails(&["export", path(&junk), "--model", "cnn", path(&onnx)], &["junk.pt"]);
    // A directory that does not exist for the output: named, nothing written.
    let nowhere = dir.path().join("no/such/dir/x.onnx");
    let out = tandem(&["export", path(&weights), "--model", "cnn", path(&nowhere)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no/such/dir"));
}
