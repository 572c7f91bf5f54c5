//! FastBatchNorm2d training forward and backward fused into one custom op on CPU f32 tensors.
//!
//! Why: written with candle ops, a training BatchNorm is ~8 tensor ops forward (sums, broadcast
//! subtract, square, divide, scale, shift) and as many backward, each allocating a full-size
//! tensor and most single-threaded. Here the statistics are two passes (the mean, then the
//! squared deviations from it), the output one pass, and the backward two passes with
//! PyTorch's formula `gx = γ·invstd·(gy − mean(gy) − x̂·mean(gy·x̂))`, `gγ = Σ gy·x̂`,
//! `gβ = Σ gy` (a following ReLU's mask or PReLU's slopes applied inside both), channels spread
//! over the rayon threads. Sums run in f64 over independent lanes, so that they vectorise
//! (`LaneSums`).
use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::backward::take_param_grad;
use crate::contiguous_f32;
use crate::kernels::relu::masked_by_positive;
use crate::kernels::{par_filled, with_f32_slice, LaneSums};
use crate::vectorized_kernel;

/// Plane `p` (of `hw` values) of `v`.
fn plane(v: &[f32], p: usize, hw: usize) -> &[f32] {
    &v[p * hw..(p + 1) * hw]
}

/// Per-channel batch statistics of `x: [N, C, H, W]`: (mean, biased variance, count).
pub fn batch_stats(x: &[f32], (n, c, hw): (usize, usize, usize)) -> (Vec<f32>, Vec<f32>, usize) {
    let stats: Vec<(f32, f32)> =
        (0..c).into_par_iter().map(|ch| channel_stats(x, (n, c, hw), ch)).collect();
    (stats.iter().map(|s| s.0).collect(), stats.iter().map(|s| s.1).collect(), n * hw)
}

// Each parallel task's loops are a `vectorized_kernel!` of their own, called from the rayon
// closure: a closure is compiled as a function of its own, without the features of the
// function it is written in (these loops ran at SSE width when they were closures).

vectorized_kernel! {
    /// Channel `ch`'s (mean, biased variance) for [`batch_stats`].
    fn channel_stats(x: &[f32], (n, c, hw): (usize, usize, usize), ch: usize) -> (f32, f32) {
        let m = (n * hw).max(1) as f64;
        let plane = |i: usize| &x[(i * c + ch) * hw..(i * c + ch + 1) * hw];
        let mut sums = LaneSums::new();
        (0..n).for_each(|i| sums.add([plane(i)], |[v]| [v, 0.0]));
        let mean = sums.total().0 / m;
        let mean32 = mean as f32;
        let mut squares = LaneSums::new();
        let d = |v: f32| v - mean32;
        (0..n).for_each(|i| squares.add([plane(i)], |[v]| [d(v) * d(v), 0.0]));
        let squares = squares.total().0;
        // The deviations were taken from the f32-rounded mean; correct for the rounding.
        let offset = mean32 as f64 - mean;
        (mean as f32, (squares / m - offset * offset).max(0.0) as f32)
    }
}

/// What follows the BatchNorm inside its kernels: nothing, a ReLU, or a PReLU with one slope
/// per channel (`z` where `z > 0`, else `slope·z`: `kernels::prelu`'s formula, so the fused
/// op has the two ops' bits).
#[derive(Clone, Copy, Debug)]
pub enum Activation<'a> {
    Identity,
    Relu,
    PRelu(&'a [f32]),
}

/// An [`Activation`] for one channel.
#[derive(Clone, Copy)]
enum Gate {
    Identity,
    Relu,
    Slope(f32),
}

impl Activation<'_> {
    fn gate(&self, ch: usize) -> Gate {
        match self {
            Activation::Identity => Gate::Identity,
            Activation::Relu => Gate::Relu,
            Activation::PRelu(slopes) => Gate::Slope(slopes[ch]),
        }
    }
}

/// The output's `x·scale + shift` per channel. The backward recomputes the ReLU's mask (and
/// the PReLU's input) with it (`x·scale + shift > 0` is `y > 0` bit for bit), reading `x` and
/// `gy` but not `y`.
#[inline(always)]
fn scale_shift(gamma: f32, beta: f32, mean: f32, invstd: f32) -> (f32, f32) {
    let scale = gamma * invstd;
    (scale, beta - mean * scale)
}

/// `γ·(x − mean)·invstd + β` of `x: [N, C, HW]`, plus `residual` when given, then through
/// `act` (a residual always with a ReLU).
pub(crate) fn normalize(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    (mean, invstd): (&[f32], &[f32]),
    (act, residual): (Activation, Option<&[f32]>),
    (c, hw): (usize, usize),
) -> Vec<f32> {
    // SAFETY: `normalize_plane` writes every slot of its chunk (a zip with inputs of the
    // chunk's length).
    unsafe {
        par_filled(x.len(), hw, |plane, y| {
            let ch = plane % c;
            let (scale, shift) = scale_shift(gamma[ch], beta[ch], mean[ch], invstd[ch]);
            let at = plane * hw..(plane + 1) * hw;
            let residual = residual.map(|r| &r[at.clone()]);
            normalize_plane(&x[at], residual, act.gate(ch), (scale, shift), y)
        })
    }
}

vectorized_kernel! {
    /// One plane of [`normalize`].
    fn normalize_plane(
        x: &[f32],
        residual: Option<&[f32]>,
        gate: Gate,
        (scale, shift): (f32, f32),
        y: &mut [MaybeUninit<f32>],
    ) {
        if let Some(r) = residual {
            // (x·scale + shift) + r: the unfused BatchNorm's output, then the sum.
            let out = |(x, r): (&f32, &f32)| (x * scale + shift + r).max(0.0);
            y.iter_mut().zip(x.iter().zip(r)).for_each(|(y, xr)| _ = y.write(out(xr)));
            return;
        }
        match gate {
            Gate::Relu => {
                let relu = |x: f32| (x * scale + shift).max(0.0);
                y.iter_mut().zip(x).for_each(|(y, &x)| _ = y.write(relu(x)));
            }
            Gate::Slope(a) => {
                let prelu = |z: f32| z * if z > 0.0 { 1.0 } else { a };
                y.iter_mut().zip(x).for_each(|(y, &x)| _ = y.write(prelu(x * scale + shift)));
            }
            Gate::Identity => {
                y.iter_mut().zip(x).for_each(|(y, x)| _ = y.write(x * scale + shift));
            }
        }
    }
}

/// The op: normalises with the given batch statistics, affine γ, β, then (when `relu`) clamps
/// at zero — a BatchNorm followed by ReLU in one pass each way.
struct BatchNormTrain {
    mean: Vec<f32>,
    invstd: Vec<f32>,
    relu: bool,
}

fn dims(l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let &[n, c, h, w] = l.dims() else {
        candle_core::bail!("batch_norm: expected [N, C, H, W], got {:?}", l.dims())
    };
    Ok((n, c, h * w))
}

impl CustomOp3 for BatchNormTrain {
    fn name(&self) -> &'static str {
        "tandem-batch-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, c, hw) = dims(xl)?;
        let x = contiguous_f32(xs, xl, "batch_norm", "input")?;
        let gamma = contiguous_f32(gs, gl, "batch_norm", "weight")?;
        let beta = contiguous_f32(bs, bl, "batch_norm", "bias")?;
        let stats = (&self.mean[..], &self.invstd[..]);
        let act = if self.relu { Activation::Relu } else { Activation::Identity };
        let y = normalize(x, gamma, beta, stats, (act, None), (c, hw));
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, c, h, w) = x.dims4()?;
        let hw = h * w;
        let (gamma_v, beta_v): (Vec<f32>, Vec<f32>) = (gamma.to_vec1()?, beta.to_vec1()?);
        let gy = gy.contiguous()?;
        let act = if self.relu { Activation::Relu } else { Activation::Identity };
        let (want_gx, dims) = (x.track_op(), (n, c, hw));
        let stats =
            Stats { mean: &self.mean, invstd: &self.invstd, gamma: &gamma_v, beta: &beta_v };
        let SliceGrads { sums, gx, .. } = with_f32_slice(x, |x| {
            with_f32_slice(&gy, |gy| backward_slices(x, gy, &stats, act, dims, want_gx))
        })??;
        let dev = x.device();
        let ggamma = gamma
            .track_op()
            .then(|| Tensor::from_vec(weight_grad(&sums, &self.invstd), c, dev))
            .transpose()?;
        let gbeta =
            beta.track_op().then(|| Tensor::from_vec(bias_grad(&sums), c, dev)).transpose()?;
        let (ggamma, gbeta) = (take_param_grad(gamma, ggamma)?, take_param_grad(beta, gbeta)?);
        let gx = gx.map(|v| Tensor::from_vec(v, x.shape(), dev)).transpose()?;
        Ok((gx, ggamma, gbeta))
    }
}

/// The channels' forward constants: the batch mean, 1/sqrt(var + eps), the affine γ and β.
pub struct Stats<'a> {
    pub mean: &'a [f32],
    pub invstd: &'a [f32],
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
}

/// What [`backward_slices`] computes.
pub struct SliceGrads {
    /// Per channel Σ g and Σ g·(x − mean): `gβ` and `gγ / invstd`.
    pub sums: Vec<(f64, f64)>,
    /// The input gradient, when asked for.
    pub gx: Option<Vec<f32>>,
    /// The PReLU's slope gradients (empty for another activation): per channel Σ z·gy over
    /// the BatchNorm outputs `z ≤ 0`, as `kernels::prelu` sums them.
    pub slopes: Vec<f32>,
}

/// The backward of the op on contiguous `[N, C, H, W]` slices: the per-channel sums, the
/// input gradient when `want_gx`, and the PReLU's slope gradients; `g` is `gy` through `act`
/// (zero where a ReLU's output is not positive, times the slope where a PReLU's input is not).
/// Public for the kernel probes.
pub fn backward_slices(
    x: &[f32],
    gy: &[f32],
    stats: &Stats,
    act: Activation,
    (n, c, hw): (usize, usize, usize),
    want_gx: bool,
) -> SliceGrads {
    let m = (n * hw) as f64;
    let per_channel: Vec<((f64, f64), f64)> = (0..c)
        .into_par_iter()
        .map(|ch| channel_grad_sums((x, gy), stats, act.gate(ch), (n, c, hw), ch))
        .collect();
    let sums: Vec<(f64, f64)> = per_channel.iter().map(|s| s.0).collect();
    let slopes = match act {
        Activation::PRelu(_) => per_channel.iter().map(|s| s.1 as f32).collect(),
        _ => Vec::new(),
    };
    let gx = want_gx.then(|| {
        // SAFETY: `input_grad_plane` writes every slot of its chunk (a zip with inputs of the
        // chunk's length).
        unsafe {
            par_filled(x.len(), hw, |p, out| {
                let ch = p % c;
                let planes = (plane(gy, p, hw), plane(x, p, hw));
                input_grad_plane(planes, stats, act.gate(ch), (ch, sums[ch], m), out)
            })
        }
    });
    SliceGrads { sums, gx, slopes }
}

vectorized_kernel! {
    /// Channel `ch`'s Σ g and Σ g·(x − mean) for [`backward_slices`], and (through a PReLU)
    /// its slope's gradient.
    fn channel_grad_sums(
        (x, gy): (&[f32], &[f32]),
        stats: &Stats,
        gate: Gate,
        (n, c, hw): (usize, usize, usize),
        ch: usize,
    ) -> ((f64, f64), f64) {
        let mean = stats.mean[ch];
        let (scale, shift) =
            scale_shift(stats.gamma[ch], stats.beta[ch], stats.mean[ch], stats.invstd[ch]);
        let (mut sums, mut slope) = (LaneSums::new(), LaneSums::new());
        for i in 0..n {
            let p = i * c + ch;
            let v = [plane(gy, p, hw), plane(x, p, hw)];
            // A loop per activation, so that its test is not made per element.
            match gate {
                Gate::Relu => sums.add(v, |[g, x]| {
                    let g = if x * scale + shift > 0.0 { g } else { 0.0 };
                    [g, g * (x - mean)]
                }),
                Gate::Slope(a) => {
                    // The PReLU's input z and its two gradients, as `kernels::prelu` makes
                    // them: the slope's Σ z·gy over z ≤ 0 (one plane after another, as it
                    // walks them), and g = gy·(z > 0 ? 1 : a) for the BatchNorm.
                    slope.add(v, |[g, x]| {
                        let z = x * scale + shift;
                        [if z <= 0.0 { z * g } else { 0.0 }, 0.0]
                    });
                    sums.add(v, |[g, x]| {
                        let g = g * if x * scale + shift > 0.0 { 1.0 } else { a };
                        [g, g * (x - mean)]
                    });
                }
                Gate::Identity => sums.add(v, |[g, x]| [g, g * (x - mean)]),
            }
        }
        (sums.total(), slope.total().0)
    }
}

vectorized_kernel! {
    /// One plane (channel `ch`, its sums, `m` values a channel) of [`backward_slices`]' input
    /// gradient.
    fn input_grad_plane(
        (gy, x): (&[f32], &[f32]),
        stats: &Stats,
        gate: Gate,
        (ch, sums, m): (usize, (f64, f64), f64),
        out: &mut [MaybeUninit<f32>],
    ) {
        let (mean, invstd) = (stats.mean[ch], stats.invstd[ch]);
        let k = stats.gamma[ch] * invstd;
        let mean_g = (sums.0 / m) as f32;
        // mean(g·x̂) = invstd · Σ g·(x − mean) / m.
        let mean_gx = (sums.1 / m) as f32 * invstd;
        // gx = k·(g − mean_g − x̂·mean(g·x̂)), in this order: the terms cancel over the
        // channel, and folding them into k·g + a·x + b loses that (the gradient of a bias
        // before a BatchNorm is ~0).
        let slope = invstd * mean_gx;
        let values = gy.iter().zip(x);
        let gx = |g: f32, x: f32| k * (g - mean_g - (x - mean) * slope);
        let (scale, shift) = scale_shift(stats.gamma[ch], stats.beta[ch], mean, invstd);
        match gate {
            Gate::Relu => {
                for (o, (&g, &x)) in out.iter_mut().zip(values) {
                    o.write(gx(if x * scale + shift > 0.0 { g } else { 0.0 }, x));
                }
            }
            Gate::Slope(a) => {
                for (o, (&g, &x)) in out.iter_mut().zip(values) {
                    o.write(gx(g * if x * scale + shift > 0.0 { 1.0 } else { a }, x));
                }
            }
            Gate::Identity => {
                for (o, (&g, &x)) in out.iter_mut().zip(values) {
                    o.write(gx(g, x));
                }
            }
        }
    }
}

/// `gγ = Σ g·x̂ = invstd · Σ g·(x − mean)` from [`backward_slices`]' sums.
fn weight_grad(sums: &[(f64, f64)], invstd: &[f32]) -> Vec<f32> {
    sums.iter().zip(invstd).map(|(s, &i)| (s.1 * i as f64) as f32).collect()
}

/// `gβ = Σ g` from [`backward_slices`]' sums.
fn bias_grad(sums: &[(f64, f64)]) -> Vec<f32> {
    sums.iter().map(|s| s.0 as f32).collect()
}

/// The gradient of a fused op's parameter operand — `cat(γ, β)`, or `cat(γ, β, a)` with a
/// PReLU's slopes (candle's custom ops take three operands) — from [`backward_slices`]'
/// results, when it is in the graph. It goes back through candle's `cat` to the parts: the
/// operand is no variable, and candle's backward wants a gradient for every node between the
/// loss and a variable, so the parts cannot be handed to the store apart (nor to the early
/// all-reduce: their gradients are reduced after backward).
pub(crate) fn params_grad(
    params: &Tensor,
    grads: &SliceGrads,
    invstd: &[f32],
) -> candle_core::Result<Option<Tensor>> {
    if !params.track_op() {
        return Ok(None);
    }
    let mut v = weight_grad(&grads.sums, invstd);
    v.extend(bias_grad(&grads.sums));
    v.extend_from_slice(&grads.slopes);
    let len = v.len();
    Ok(Some(Tensor::from_vec(v, len, params.device())?))
}

/// The op: a training BatchNorm then a PReLU, one pass each way; `cat(γ, β, a)` one `[3C]`
/// operand. The BatchNorm's output never becomes a tensor of candle's graph, so backward
/// makes no zeroed accumulator for its gradient, and the PReLU is not a pass of its own. The
/// same bits as the two ops apart (up to the sign of a zero gradient).
struct BatchNormPRelu {
    mean: Vec<f32>,
    invstd: Vec<f32>,
}

/// What follows the BatchNorm in a fused op whose parameter operand is `cat(γ, β)`, or
/// `cat(γ, β, a)` with a PReLU's slopes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Then {
    Nothing,
    Relu,
    PRelu,
}

impl Then {
    /// The parameter operand's values for `c` channels as γ, β and the activation (a PReLU's
    /// slopes its third part); `op` names the op in the error for another length.
    #[allow(clippy::type_complexity)]
    pub(crate) fn split<'a>(
        self,
        params: &'a [f32],
        c: usize,
        op: &str,
    ) -> candle_core::Result<(&'a [f32], &'a [f32], Activation<'a>)> {
        let parts = if self == Then::PRelu { 3 } else { 2 };
        if params.len() != parts * c {
            candle_core::bail!(
                "{op}: {} BatchNorm parameter values for {c} channels ({self:?} after it)",
                params.len()
            )
        }
        let (gamma, rest) = params.split_at(c);
        let (beta, slopes) = rest.split_at(c);
        let act = match self {
            Then::Nothing => Activation::Identity,
            Then::Relu => Activation::Relu,
            Then::PRelu => Activation::PRelu(slopes),
        };
        Ok((gamma, beta, act))
    }
}

impl CustomOp2 for BatchNormPRelu {
    fn name(&self) -> &'static str {
        "tandem-batch-norm-prelu"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, c, hw) = dims(xl)?;
        let x = contiguous_f32(xs, xl, "batch_norm_prelu", "input")?;
        let params = contiguous_f32(ps, pl, "batch_norm_prelu", "weight, bias and slopes")?;
        let (gamma, beta, act) = Then::PRelu.split(params, c, "batch_norm_prelu")?;
        let stats = (&self.mean[..], &self.invstd[..]);
        let y = normalize(x, gamma, beta, stats, (act, None), (c, hw));
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, c, h, w) = x.dims4()?;
        let p: Vec<f32> = params.to_vec1()?;
        let (gamma, beta, act) = Then::PRelu.split(&p, c, "batch_norm_prelu")?;
        let stats = Stats { mean: &self.mean, invstd: &self.invstd, gamma, beta };
        let (dims, want_gx) = ((n, c, h * w), x.track_op());
        let gy = gy.contiguous()?;
        let grads = with_f32_slice(x, |x| {
            with_f32_slice(&gy, |gy| backward_slices(x, gy, &stats, act, dims, want_gx))
        })??;
        let gparams = params_grad(params, &grads, &self.invstd)?;
        let gx = grads.gx.map(|v| Tensor::from_vec(v, x.shape(), x.device())).transpose()?;
        Ok((gx, gparams))
    }
}

/// `prelu(batch_norm_train(x), a)` as one op (see `BatchNormPRelu`): the output, and the
/// batch's mean, biased variance and element count.
pub fn batch_norm_train_prelu(
    x: &Tensor,
    (gamma, beta): (&Tensor, &Tensor),
    slopes: &Tensor,
    eps: f64,
) -> candle_core::Result<(Tensor, Vec<f32>, Vec<f32>, usize)> {
    let x = x.contiguous()?;
    let (mean, var, count, invstd) = train_stats(&x, eps)?;
    let op = BatchNormPRelu { mean: mean.clone(), invstd };
    let params = Tensor::cat(&[gamma, beta, slopes], 0)?;
    let y = x.apply_op2(&params, op)?;
    Ok((y, mean, var, count))
}

/// A residual block's tail, `relu(BatchNorm(x) + residual)`, as one op: the BatchNorm's
/// output never becomes a tensor of candle's graph, so backward makes no zeroed accumulator
/// for its gradient (a memset and an add over the activation), and the sum is not a pass of
/// its own. γ and β come as one `[2C]` operand (`cat(γ, β)`), candle's custom ops taking three.
/// The same bits as the three ops apart, forward and backward.
struct BatchNormAddRelu {
    mean: Vec<f32>,
    invstd: Vec<f32>,
}

impl CustomOp3 for BatchNormAddRelu {
    fn name(&self) -> &'static str {
        "tandem-batch-norm-add-relu"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, c, hw) = dims(xl)?;
        let x = contiguous_f32(xs, xl, "batch_norm_add_relu", "input")?;
        let params = contiguous_f32(ps, pl, "batch_norm_add_relu", "weight and bias")?;
        let r = contiguous_f32(rs, rl, "batch_norm_add_relu", "residual")?;
        if params.len() != 2 * c || r.len() != x.len() {
            candle_core::bail!(
                "batch_norm_add_relu: input {:?} with {} weight and bias values and residual {:?}",
                xl.dims(),
                params.len(),
                rl.dims()
            )
        }
        let (gamma, beta) = params.split_at(c);
        let stats = (&self.mean[..], &self.invstd[..]);
        let y = normalize(x, gamma, beta, stats, (Activation::Relu, Some(r)), (c, hw));
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        r: &Tensor,
        y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, c, h, w) = x.dims4()?;
        let p: Vec<f32> = params.to_vec1()?;
        let (gamma, beta) = p.split_at(c);
        // The gradient past the ReLU: the residual's, and the BatchNorm output's.
        let g = masked_by_positive(&gy.contiguous()?, y)?;
        let stats = Stats { mean: &self.mean, invstd: &self.invstd, gamma, beta };
        let dims = (n, c, h * w);
        let want_gx = x.track_op();
        let grads = with_f32_slice(x, |xs| {
            backward_slices(xs, &g, &stats, Activation::Identity, dims, want_gx)
        })?;
        let dev = x.device();
        let gparams = params_grad(params, &grads, &self.invstd)?;
        let gx = grads.gx.map(|v| Tensor::from_vec(v, x.shape(), dev)).transpose()?;
        let gr = r.track_op().then(|| Tensor::from_vec(g, r.shape(), dev)).transpose()?;
        Ok((gx, gparams, gr))
    }
}

/// Training-mode FastBatchNorm2d on a CPU f32 `x: [N, C, H, W]`: the output, and the batch's
/// per-channel mean and biased variance (for the running statistics) with the element count.
pub fn batch_norm_train(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
) -> candle_core::Result<(Tensor, Vec<f32>, Vec<f32>, usize)> {
    batch_norm_train_act(x, gamma, beta, eps, false)
}

/// [`batch_norm_train`], followed by a ReLU in the same kernel when `relu`.
pub fn batch_norm_train_act(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    relu: bool,
) -> candle_core::Result<(Tensor, Vec<f32>, Vec<f32>, usize)> {
    let x = x.contiguous()?;
    let (mean, var, count, invstd) = train_stats(&x, eps)?;
    let op = BatchNormTrain { mean: mean.clone(), invstd, relu }; // the op keeps its own for backward
    let y = x.apply_op3(&gamma.contiguous()?, &beta.contiguous()?, op)?;
    Ok((y, mean, var, count))
}

/// `relu(batch_norm_train(x) + residual)` as one op (see `BatchNormAddRelu`): the output, and
/// the batch's mean, biased variance and element count.
pub fn batch_norm_train_add_relu(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    residual: &Tensor,
    eps: f64,
) -> candle_core::Result<(Tensor, Vec<f32>, Vec<f32>, usize)> {
    check_residual(x, residual)?;
    let x = x.contiguous()?;
    let (mean, var, count, invstd) = train_stats(&x, eps)?;
    let op = BatchNormAddRelu { mean: mean.clone(), invstd };
    let params = Tensor::cat(&[gamma, beta], 0)?;
    let y = x.apply_op3(&params, &residual.contiguous()?, op)?;
    Ok((y, mean, var, count))
}

/// A residual block's tail adds a residual of the input's shape.
pub(crate) fn check_residual(x: &Tensor, residual: &Tensor) -> candle_core::Result<()> {
    if residual.shape() != x.shape() {
        candle_core::bail!(
            "batch_norm_add_relu: residual {:?} for input {:?}",
            residual.dims(),
            x.dims()
        )
    }
    Ok(())
}

/// The batch's per-channel mean, biased variance, element count and `1/sqrt(var + eps)`.
#[allow(clippy::type_complexity)]
fn train_stats(x: &Tensor, eps: f64) -> candle_core::Result<(Vec<f32>, Vec<f32>, usize, Vec<f32>)> {
    let (n, c, h, w) = x.dims4()?;
    let (mean, var, count) = with_f32_slice(x, |s| batch_stats(s, (n, c, h * w)))?;
    let invstd = inverse_std(&var, eps);
    Ok((mean, var, count, invstd))
}

/// `1/sqrt(var + eps)` per channel.
pub(crate) fn inverse_std(var: &[f32], eps: f64) -> Vec<f32> {
    var.iter().map(|v| (1.0 / (*v as f64 + eps).sqrt()) as f32).collect()
}
