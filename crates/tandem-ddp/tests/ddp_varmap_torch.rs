//! Weights of a stock candle-nn model (VarMap) against real PyTorch (skipped without torch
//! unless TANDEM_REQUIRE_TORCH=1): a DDP-saved torch checkpoint (`module.` keys inside
//! `"model"`) loads strictly and the model then computes torch's outputs; what tandem saves
//! (.pt and .safetensors) holds exactly torch's state dict and opens with
//! `torch.load(weights_only=True)`; a model with an extra layer is refused strictly, naming it,
//! and loads what fits non-strictly with the report listing the rest.
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder, VarMap};
use tandem_nn::weights::{load_weights, save_weights};
use tandem_nn::NamedVars;
use tandem_testutil::{output_with_deadline, torch_python, workspace_root};

struct Net {
    fc1: Linear,
    fc2: Linear,
}

impl Net {
    fn new(vb: &VarBuilder, extra_layer: bool) -> Net {
        if extra_layer {
            candle_nn::linear(3, 3, vb.pp("fc3")).unwrap();
        }
        Net {
            fc1: candle_nn::linear(6, 8, vb.pp("fc1")).unwrap(),
            fc2: candle_nn::linear(8, 3, vb.pp("fc2")).unwrap(),
        }
    }
    fn forward(&self, x: &Tensor) -> Tensor {
        self.fc2.forward(&self.fc1.forward(x).unwrap().relu().unwrap()).unwrap()
    }
}

fn py(python: &Path, args: &[&str]) {
    let script = workspace_root().join("crates/tandem-ddp/tests/fixtures/varmap/interop.py");
    let out =
        output_with_deadline(Command::new(python).arg(script).args(args), Duration::from_secs(120));
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "interop.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn model(extra_layer: bool) -> (VarMap, Net) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let net = Net::new(&vb, extra_layer);
    (varmap, net)
}

#[test]
fn a_varmap_model_loads_torch_ddp_weights_and_saves_what_torch_loads() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    py(&python, &["make", d.to_str().unwrap()]);

    let (varmap, net) = model(false);
    let report = load_weights(&NamedVars::from_varmap(&varmap), &d.join("ddp.pt"), true).unwrap();
    assert_eq!(report.container, "model");
    assert!(report.missing.is_empty() && report.unexpected.is_empty(), "{report}");
    assert_eq!(report.matched.len(), 4);

    let io = tandem_ckpt::load(d.join("io.pt")).unwrap();
    let tensor = |k: &str| {
        let t = io.get(k).and_then(|v| v.as_tensor()).unwrap();
        Tensor::from_vec(t.to_f32_vec(), t.shape.clone(), &Device::Cpu).unwrap()
    };
    let ours = net.forward(&tensor("x")).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let torch = tensor("y").flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let diff = ours.iter().zip(&torch).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff < 1e-5, "outputs differ from torch's by {diff}");

    let (pt, st) = (d.join("ours.pt"), d.join("ours.safetensors"));
    save_weights(&NamedVars::from_varmap(&varmap), &pt).unwrap();
    save_weights(&NamedVars::from_varmap(&varmap), &st).unwrap();
    py(&python, &["check", d.to_str().unwrap(), pt.to_str().unwrap(), st.to_str().unwrap()]);

    // A model with a layer the checkpoint lacks: strict names it, non-strict reports it.
    let (bigger, net) = model(true);
    let vars = NamedVars::from_varmap(&bigger);
    let err = load_weights(&vars, &d.join("ddp.pt"), true).unwrap_err().to_string();
    assert!(err.contains("fc3.weight") && err.contains("fc3.bias"), "{err}");
    let report = load_weights(&vars, &d.join("ddp.pt"), false).unwrap();
    assert_eq!(report.missing, ["fc3.bias", "fc3.weight"]);
    let ours = net.forward(&tensor("x")).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let diff = ours.iter().zip(&torch).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff < 1e-5, "non-strict load did not apply the matching keys ({diff})");
}
