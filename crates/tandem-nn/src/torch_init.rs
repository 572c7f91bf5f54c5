//! PyTorch's default initialisation for Linear and Conv2d: weights kaiming-uniform with
//! a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and biases U(-1/sqrt(fan_in), ..).
//! Seeded (StdRng) so every rank builds the same model; the stream is ours, not torch's.
use candle_core::{Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::Rng;

/// A standard normal sample (Box-Muller), the stream seeded model initialisers draw from.
pub fn standard_normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// A `Var` of `shape` drawn from U(-bound, bound) by `rng`.
pub fn uniform_var(
    rng: &mut StdRng,
    shape: &[usize],
    bound: f32,
    device: &Device,
) -> candle_core::Result<Var> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..=bound)).collect();
    Var::from_tensor(&Tensor::from_vec(data, shape, device)?)
}

/// (weight, bias) for a layer whose weight has `shape` = [out, in, ...] (fan_in = in * ...).
pub fn default_layer(
    rng: &mut StdRng,
    shape: &[usize],
    device: &Device,
) -> candle_core::Result<(Var, Var)> {
    let fan_in: usize = shape[1..].iter().product();
    let bound = 1.0 / (fan_in as f32).sqrt();
    let w = uniform_var(rng, shape, bound, device)?;
    let b = uniform_var(rng, &shape[..1], bound, device)?;
    Ok((w, b))
}

/// Copies every var onto `device` as fresh vars (same names).
pub fn copy_vars(
    named: &[(String, Var)],
    device: &Device,
) -> candle_core::Result<Vec<(String, Var)>> {
    named
        .iter()
        .map(|(n, v)| Ok((n.clone(), Var::from_tensor(&v.as_tensor().to_device(device)?.copy()?)?)))
        .collect()
}
