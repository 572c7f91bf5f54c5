//! What the fixture tests of arcface_torch's backbones share (fixtures/*/make_fixture.py): the
//! formula both sides compute weights and inputs from, and the judge that holds tandem's float32
//! results to torch's own float32 error against a float64 run.
#![allow(dead_code)] // each test binary uses its own part

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The safetensors file `file` of fixture folder `name`.
pub fn fixture(name: &str, file: &str) -> HashMap<String, Tensor> {
    let path = fixture_dir(name).join(file);
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// torch's float state-dict keys of `variant`, in order, from the fixture's JSON.
pub fn keys(name: &str, file: &str, variant: &str) -> Vec<String> {
    let text = std::fs::read_to_string(fixture_dir(name).join(file)).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v[variant].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect()
}

/// The fixture scripts' `formula`: uniform in [-1, 1) from an integer hash of `(index, k)`,
/// times `scale`.
pub fn formula(shape: &[usize], k: f64, scale: f64) -> Tensor {
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

/// The scripts' `fill` for the `i`-th float tensor of the state dict, for every name that
/// `special` leaves (`None`): weights by fan-in, running variances near 1, means and biases
/// small, 1-d weights near 1.
pub fn filled(
    name: &str,
    shape: &[usize],
    i: usize,
    special: impl Fn(&str, &[usize], f64) -> Option<Tensor>,
) -> Tensor {
    let i = i as f64;
    if let Some(t) = special(name, shape, i) {
        return t;
    }
    if shape.len() >= 2 {
        let fan_in: usize = shape[1..].iter().product();
        formula(shape, i, 1.7 / (fan_in as f64).sqrt())
    } else if name.ends_with("running_var") {
        formula(shape, i, 1.0).abs().unwrap().affine(0.3, 1.0).unwrap()
    } else if name.ends_with("running_mean") || name.ends_with("bias") {
        formula(shape, i, 0.1)
    } else {
        formula(shape, i, 1.0).affine(0.2, 1.0).unwrap()
    }
}

pub fn max_abs(t: &Tensor) -> f32 {
    t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

/// [`judge_with`] a slack of 1e-6 of the largest magnitude plus 1e-5.
pub fn judge(ours: &Tensor, f: &HashMap<String, Tensor>, key: &str, what: &str) -> f32 {
    let exact = f[&key.replacen('.', ".f64.", 1)].to_dtype(DType::F32).unwrap();
    judge_with(ours, f, key, what, 1e-6 * max_abs(&exact) + 1e-5)
}

/// tandem's float32 result may be off the float64 run by at most three times torch's float32
/// error, plus `slack` (for values that are zero up to rounding). Returns the share of that
/// allowance used.
pub fn judge_with(
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

/// Judges, after one training forward and backward of `variant`, the BatchNorm running
/// statistics and every parameter's gradient the fixture holds (whole, or its head and its dot
/// product with the formula direction); a parameter the fixture has no gradient for must have
/// none here either. Returns the largest share used and how many gradients were checked.
pub fn judge_gradients(
    named: &[(String, Var)],
    grads: &candle_core::backprop::GradStore,
    f: &HashMap<String, Tensor>,
    variant: &str,
) -> (f32, usize) {
    let (mut worst, mut checked) = (0f32, 0);
    for (name, var) in named {
        if name.ends_with("running_mean") || name.ends_with("running_var") {
            let key = format!("{variant}.after.{name}");
            worst = worst.max(judge(var.as_tensor(), f, &key, &format!("{name} after")));
            continue;
        }
        let what = format!("{variant}: gradient of {name}");
        let key = format!("{variant}.grad.{name}");
        let head_key = format!("{variant}.grad_head.{name}");
        let Some(g) = grads.get(var.as_tensor()) else {
            assert!(!f.contains_key(&key) && !f.contains_key(&head_key), "no gradient for {name}");
            continue;
        };
        if f.contains_key(&key) {
            worst = worst.max(judge(g, f, &key, &what));
            checked += 1;
            continue;
        }
        let head = g.flatten_all().unwrap().narrow(0, 0, f[&head_key].dim(0).unwrap()).unwrap();
        worst = worst.max(judge(&head, f, &head_key, &what));
        let direction = formula(g.dims(), 3.0, 1.0).to_dtype(DType::F64).unwrap();
        let products = (g.to_dtype(DType::F64).unwrap() * direction).unwrap();
        let dot = products.sum_all().unwrap().reshape(1).unwrap().to_dtype(DType::F32).unwrap();
        // A dot product's rounding scales with the sum of its terms' magnitudes (1e-4 of it:
        // one direction's projection is noisier than the elementwise maximum; a wrong gradient
        // is off by the order of the magnitude itself).
        let magnitude = products.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        let key = format!("{variant}.grad_dot.{name}");
        let slack = 1e-4 * magnitude as f32 + 1e-5;
        worst = worst.max(judge_with(&dot, f, &key, &format!("{what} (dot)"), slack));
        checked += 1;
    }
    (worst, checked)
}
