//! IResNet against arcface_torch's layout in PyTorch (fixtures/iresnet/make_fixture.py, width 4,
//! embedding 16, 112x112): the same state-dict keys in the same order, a torch state dict loads
//! strictly, and the train-mode embedding, every trainable parameter's gradient, the BatchNorm
//! statistics after the step and the eval-mode embedding match; `features.weight` is frozen.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tandem_models::IResNet;
use tandem_nn::{NamedVars, OrderedVarMap, ParamModule};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/iresnet")
}

fn fixture() -> HashMap<String, Tensor> {
    let path = dir().join("iresnet.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn keys(which: &str) -> Vec<String> {
    let text = std::fs::read_to_string(dir().join("iresnet_keys.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v[which].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// |a - b| <= tol * (1 + max |b|), per tensor.
fn close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
    let scale = b.to_dtype(DType::F32).unwrap().abs().unwrap().flatten_all().unwrap();
    let scale = scale.max(0).unwrap().to_scalar::<f32>().unwrap();
    let d = max_diff(a, b);
    assert!(d <= tol * (1.0 + scale), "{what}: max abs diff {d} (scale {scale})");
}

fn build() -> (OrderedVarMap, IResNet, NamedVars) {
    let vars = OrderedVarMap::new();
    let model = IResNet::new(18, 4, 16, 0.0, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let named = vars.named_vars().freeze(IResNet::FROZEN).unwrap();
    (vars, model, named)
}

fn torch_state(f: &HashMap<String, Tensor>) -> tandem_ckpt::Value {
    let tensors: Vec<(String, Tensor)> = f
        .iter()
        .filter_map(|(k, t)| k.strip_prefix("init.").map(|n| (n.to_string(), t.clone())))
        .collect();
    let ckpt = tandem_nn::convert::state_dict_to_ckpt(&tensors).unwrap();
    tandem_ckpt::Value::dict_from(ckpt.into_iter().map(|(k, t)| (k, tandem_ckpt::Value::Tensor(t))))
}

#[test]
fn state_dict_keys_are_arcface_torch_s_in_its_order() {
    let (vars, _model, named) = build();
    let ours: Vec<String> = vars.named().into_iter().map(|(n, _)| n).collect();
    assert_eq!(ours, keys("state_dict"), "creation order = torch's state_dict order");
    let trainable: Vec<String> = named.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(trainable, keys("trainable"), "features.weight is frozen, as in arcface_torch");
}

#[test]
fn forward_backward_and_statistics_match_torch() {
    let f = fixture();
    let (_vars, model, named) = build();
    let report = named.load_state_dict(&torch_state(&f)).unwrap();
    assert!(report.missing.is_empty() && report.unexpected.is_empty(), "{report}");

    let emb = model.forward_t(&f["x"], true).unwrap();
    close(&emb, &f["emb_train"], 1e-4, "train-mode embedding");
    let loss = (&emb * &f["probe"]).unwrap().sum_all().unwrap();
    close(&loss.reshape(1).unwrap(), &f["loss"], 1e-4, "loss");
    let grads = loss.backward().unwrap();
    let mut worst = (0f32, String::new());
    for (name, var) in named.named_parameters() {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        // Both float32 runs sum ~25k products per element of the stem's weight gradient over
        // the 112x112 map, in different orders (and tandem's 3x3 convolutions by Winograd's
        // algorithm): each is measured against the float64 run, and tandem may be off by at
        // most three times torch's own float32 error (plus 1e-6 of the largest magnitude, and
        // 1e-5 absolute for gradients that are zero up to rounding, as fc.bias's before the
        // `features` BatchNorm).
        let exact = &f[&format!("grad64.{name}")];
        let scale = exact.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let scale = scale.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
        let ours = max_diff(g, exact);
        let torch = max_diff(&f[&format!("grad.{name}")], exact);
        assert!(
            ours <= 3.0 * torch + 1e-6 * scale + 1e-5,
            "grad {name}: {ours} from float64, torch float32 {torch} (scale {scale})"
        );
        let ratio = ours / torch.max(1e-6 * scale + 1e-5);
        if ratio > worst.0 {
            worst = (ratio, name);
        }
    }
    eprintln!("largest ratio of tandem's to torch float32's error: {:.2} ({})", worst.0, worst.1);
    let frozen = named.named_buffers().into_iter().find(|(n, _)| n == "features.weight").unwrap();
    assert!(grads.get(frozen.1.as_tensor()).is_none(), "features.weight takes no gradient");
    for (name, var) in named.named_buffers() {
        if let Some(expect) = f.get(&format!("after.{name}")) {
            close(var.as_tensor(), expect, 1e-4, &format!("{name} after the step"));
        }
    }
    let eval = model.forward_t(&f["x"], false).unwrap();
    close(&eval, &f["emb_eval"], 1e-4, "eval-mode embedding");
}

#[test]
fn bad_shapes_and_depths_are_named() {
    let vars = OrderedVarMap::new();
    let vb = vars.var_builder(DType::F32, &Device::Cpu);
    let e = IResNet::new(26, 4, 16, 0.0, vb.clone()).err().unwrap().to_string();
    assert!(e.contains("26") && e.contains("18, 34, 50, 100 and 200"), "{e}");
    let model = IResNet::new(18, 4, 16, 0.0, vb).unwrap();
    let x = Tensor::zeros((1, 3, 64, 64), DType::F32, &Device::Cpu).unwrap();
    let e = model.forward_t(&x, false).unwrap_err().to_string();
    assert!(e.contains("[1, 3, 64, 64]"), "{e}");
}
