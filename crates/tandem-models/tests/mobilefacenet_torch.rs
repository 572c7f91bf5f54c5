//! MobileFaceNet against arcface_torch's layout in PyTorch (fixtures/mobilefacenet/make_fixture.py):
//! two variants (the 64-group stem block of `mbf`, and a Residual first stage as `mbf_large`'s)
//! with weights, input and probe from an integer hash both sides compute: the same state-dict
//! keys in the same order, and the eval- and train-mode embeddings, every parameter's gradient
//! and the BatchNorm statistics after the forward are as close to torch's float64 run as torch's
//! own float32 run is (within 3x).
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tandem_models::MobileFaceNet;
use tandem_nn::OrderedVarMap;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mobilefacenet")
}

fn fixture() -> HashMap<String, Tensor> {
    let path = dir().join("mobilefacenet.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn keys(variant: &str) -> Vec<String> {
    let text = std::fs::read_to_string(dir().join("mobilefacenet_keys.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v[variant].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect()
}

/// The fixture script's `formula`: uniform in [-1, 1) from an integer hash of `(index, k)`,
/// times `scale`.
fn formula(shape: &[usize], k: f64, scale: f64) -> Tensor {
    const M32: u64 = 0xFFFF_FFFF;
    let n: usize = shape.iter().product();
    let seed = (k * 1000.0).round() as u64 * 1_000_003;
    let v: Vec<f32> = (0..n as u64)
        .map(|i| {
            let mut h = (i + seed) & M32;
            h = (h * 0x45D_9F3B) & M32;
            h ^= h >> 16;
            h = (h * 0x119D_E1F3) & M32;
            h ^= h >> 16;
            ((h as f64 / 4294967296.0 * 2.0 - 1.0) * scale) as f32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// [`judge_with`] a slack of 1e-6 of the largest magnitude plus 1e-5.
fn judge(ours: &Tensor, f: &HashMap<String, Tensor>, key: &str, what: &str) -> f32 {
    let exact = f[&key.replacen('.', ".f64.", 1)].to_dtype(DType::F32).unwrap();
    judge_with(ours, f, key, what, 1e-6 * max_abs(&exact) + 1e-5)
}

/// The fixture script's `fill`, for the `i`-th float tensor of the state dict.
fn filled(name: &str, shape: &[usize], i: usize) -> Tensor {
    let i = i as f64;
    if shape.len() >= 2 {
        let fan_in: usize = shape[1..].iter().product();
        formula(shape, i, 1.7 / (fan_in as f64).sqrt())
    } else if name.ends_with("running_var") {
        formula(shape, i, 1.0).abs().unwrap().affine(0.3, 1.0).unwrap()
    } else if name.ends_with("running_mean") || name.ends_with("bias") {
        formula(shape, i, 0.1)
    } else if name.ends_with("layers.2.weight") && !name.starts_with("features.") {
        formula(shape, i, 1.0).abs().unwrap().affine(0.2, 0.25).unwrap()
    } else {
        formula(shape, i, 1.0).affine(0.2, 1.0).unwrap()
    }
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

/// tandem's float32 result may be off the float64 run by at most three times torch's float32
/// error, plus `slack` (for values that are zero up to rounding). Returns the share of that
/// allowance used.
fn judge_with(
    ours: &Tensor,
    f: &HashMap<String, Tensor>,
    key: &str,
    what: &str,
    slack: f32,
) -> f32 {
    let ours = &ours.to_dtype(DType::F32).unwrap();
    let exact = f[&key.replacen('.', ".f64.", 1)].to_dtype(DType::F32).unwrap();
    let torch = f[key].to_dtype(DType::F32).unwrap();
    assert_eq!(ours.dims(), exact.dims(), "{what}");
    let scale = max_abs(&exact);
    let ours_err = max_abs(&(ours - &exact).unwrap());
    let torch_err = max_abs(&(torch - &exact).unwrap());
    let allowed = 3.0 * torch_err + slack;
    assert!(
        ours_err <= allowed,
        "{what}: {ours_err} from float64, torch float32 {torch_err} (scale {scale})"
    );
    ours_err / allowed
}

fn check_variant(variant: &str, blocks: [usize; 4], scale: usize) {
    let f = fixture();
    let vars = OrderedVarMap::new();
    let model =
        MobileFaceNet::new(blocks, scale, 16, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
    // torch's float tensors (num_batches_tracked is an integer counter there).
    let named: Vec<_> =
        vars.named().into_iter().filter(|(n, _)| !n.ends_with("num_batches_tracked")).collect();
    let ours: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(ours, keys(variant), "{variant}: creation order = torch's state_dict order");
    for (i, (name, var)) in named.iter().enumerate() {
        var.set(&filled(name, var.dims(), i)).unwrap();
    }
    let x = formula(&[4, 3, 112, 112], 0.5, 1.0);
    let probe = formula(&[4, 16], 1.5, 1.0);
    // Eval first, as the fixture: with the running statistics before the training forward.
    let eval = model.forward_t(&x, false).unwrap();
    let mut worst = judge(&eval, &f, &format!("{variant}.eval"), "eval-mode embedding");
    let emb = model.forward_t(&x, true).unwrap();
    worst = worst.max(judge(&emb, &f, &format!("{variant}.train"), "train-mode embedding"));
    let grads = (&emb * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let mut checked = 0;
    for (name, var) in &named {
        if name.ends_with("running_mean") || name.ends_with("running_var") {
            let key = format!("{variant}.after.{name}");
            worst = worst.max(judge(var.as_tensor(), &f, &key, &format!("{name} after")));
            continue;
        }
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        let what = format!("{variant}: gradient of {name}");
        let key = format!("{variant}.grad.{name}");
        if f.contains_key(&key) {
            worst = worst.max(judge(g, &f, &key, &what));
            checked += 1;
            continue;
        }
        let key = format!("{variant}.grad_head.{name}");
        let head = g.flatten_all().unwrap().narrow(0, 0, f[&key].dim(0).unwrap()).unwrap();
        worst = worst.max(judge(&head, &f, &key, &what));
        let direction = formula(g.dims(), 3.0, 1.0).to_dtype(DType::F64).unwrap();
        let products = (g.to_dtype(DType::F64).unwrap() * direction).unwrap();
        let dot = products.sum_all().unwrap().reshape(1).unwrap().to_dtype(DType::F32).unwrap();
        // A dot product's rounding scales with the sum of its terms' magnitudes
        let magnitude = products.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let key = format!("{variant}.grad_dot.{name}");
        // (1e-4 of it: one direction's projection is noisier than the elementwise maximum; a
        // wrong gradient is off by the order of the magnitude itself.)
        let slack = 1e-4 * magnitude as f32 + 1e-5;
        worst = worst.max(judge_with(&dot, &f, &key, &format!("{what} (dot)"), slack));
        checked += 1;
    }
    assert!(checked > 40, "{variant}: {checked} gradients checked");
    eprintln!("{variant}: largest share of the allowed error used: {worst:.2}");
}

#[test]
fn mbf_stem_block_in_64_groups_matches_torch() {
    check_variant("a", [1, 1, 1, 1], 2);
}

#[test]
fn residual_first_stage_as_mbf_large_matches_torch() {
    check_variant("b", [2, 1, 1, 1], 1);
}

#[test]
fn arcface_torch_s_sizes_and_bad_shapes() {
    for ((blocks, scale), params) in
        [(MobileFaceNet::MBF, 2_059_520usize), (MobileFaceNet::MBF_LARGE, 6_314_880)]
    {
        let vars = OrderedVarMap::new();
        let vb = vars.var_builder(DType::F32, &Device::Cpu);
        MobileFaceNet::new(blocks, scale, 512, vb).unwrap();
        let trainable: usize = vars
            .named()
            .iter()
            .filter(|(n, _)| !n.contains("running_") && !n.ends_with("num_batches_tracked"))
            .map(|(_, v)| v.elem_count())
            .sum();
        // torch: sum(p.numel() for p in get_model("mbf" / "mbf_large").parameters())
        assert_eq!(trainable, params, "{blocks:?} x{scale}");
    }
    let vars = OrderedVarMap::new();
    let vb = vars.var_builder(DType::F32, &Device::Cpu);
    let e = MobileFaceNet::new([1, 0, 1, 1], 2, 512, vb.clone()).err().unwrap().to_string();
    assert!(e.contains("blocks"), "{e}");
    let model = MobileFaceNet::new([1, 1, 1, 1], 1, 8, vb).unwrap();
    let e =
        model.forward_t(&Tensor::zeros((1, 3, 64, 64), DType::F32, &Device::Cpu).unwrap(), false);
    assert!(e.unwrap_err().to_string().contains("112"));
}
