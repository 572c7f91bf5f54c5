//! How `tandem bench ops` times one op on tandem's side: the inputs both sides fill alike,
//! medians, the `sum(y · r)` harness and its own cost, and each kind's call — the one a
//! network's step makes.
use std::sync::atomic::Ordering;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Conv2dConfig, Module, ModuleT, VarBuilder, VarMap};
use tandem::models::patch_embed;
use tandem::nn::functional::{attention, fused_linear, fused_linear_relu6, layer_norm};
use tandem::nn::kernels::conv2d::{conv2d, ConvParams};
use tandem::nn::kernels::winograd::{applies, MIN_CHANNELS};
use tandem::optim::{AdamWConfig, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};

use super::{OpSpec, Times};

pub(super) struct Timed {
    pub times: Times,
    /// Convolutions tandem runs by Winograd's algorithm only: forward + backward through
    /// im2col + gemm.
    pub im2col_fwdbwd_ms: Option<f64>,
    /// The forward output's sum (an optimizer's: its parameters' after one step).
    pub checksum: Checksum,
}

/// A result's sum and the sum of its magnitudes (the scale the two sides' sums are compared at).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Checksum {
    pub sum: f64,
    pub abs_sum: f64,
}

impl Checksum {
    fn of(t: &Tensor) -> candle_core::Result<Self> {
        let t = t.to_dtype(DType::F64)?;
        let sum = t.sum_all()?.to_scalar::<f64>()?;
        Ok(Checksum { sum, abs_sum: t.abs()?.sum_all()?.to_scalar::<f64>()? })
    }

    fn add(self, o: Checksum) -> Checksum {
        Checksum { sum: self.sum + o.sum, abs_sum: self.abs_sum + o.abs_sum }
    }

    /// Whether two sides computed the same values: sums within `rel` of the magnitudes (f32
    /// rounding in another order moves a sum by far less; another shape, padding or formula
    /// by far more).
    pub fn agrees(self, o: Checksum, rel: f64) -> bool {
        (self.sum - o.sum).abs() <= rel * self.abs_sum.max(o.abs_sum) + 1e-6
    }
}

/// Median ms of `f` over `repeats` runs after one warm-up (its result is dropped), each run
/// waiting for `dev` to finish its work.
fn median_ms<T>(
    dev: &Device,
    repeats: usize,
    mut f: impl FnMut() -> candle_core::Result<T>,
) -> anyhow::Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The inputs both sides fill alike: element `i` of a tensor salted `salt` is
/// `((i · 7919 + salt) mod 2003) / 2003 − 0.5`, times `scale` (exact integer steps, then one
/// correctly rounded f32 division, subtraction and product on either side).
fn filled(
    shape: &[usize],
    salt: usize,
    scale: f32,
    (dev, dtype): (&Device, DType),
) -> candle_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> =
        (0..n).map(|i| (((i * 7919 + salt) % 2003) as f32 / 2003.0 - 0.5) * scale).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_device(dev)?.to_dtype(dtype)
}

fn var(t: Tensor) -> candle_core::Result<Tensor> {
    Ok(Var::from_tensor(&t)?.as_tensor().clone())
}

/// Forward and forward + backward of `sum(f() · r)` (`r` filled alike on both sides).
fn fwd_and_step(
    dev: &Device,
    repeats: usize,
    f: impl Fn() -> candle_core::Result<Tensor>,
) -> anyhow::Result<(Times, Checksum)> {
    let y = f()?;
    let checksum = Checksum::of(&y)?;
    let r = filled(y.dims(), 5, 2.0, (dev, y.dtype()))?;
    let fwd_ms = median_ms(dev, repeats, &f)?;
    let fwdbwd_ms = median_ms(dev, repeats, || tandem::nn::backward(&(f()? * &r)?.sum_all()?))?;
    let fwdbwd_ms = less_harness(fwdbwd_ms, harness_ms(dev, repeats, &r)?, fwd_ms);
    Ok((Times { fwd_ms, fwdbwd_ms, ..Times::default() }, checksum))
}

/// What `sum(y · r)` and its backward cost by themselves, for a `y` of `r`'s shape (a leaf
/// standing in for the op's output): subtracted from every forward + backward time, on both
/// sides, so a row times the op and not the harness around it (candle's backward pays more
/// for the harness than PyTorch's: a zeroed accumulator and an add per tensor).
fn harness_ms(dev: &Device, repeats: usize, r: &Tensor) -> anyhow::Result<f64> {
    let leaf = var(r.clone())?;
    median_ms(dev, repeats, || tandem::nn::backward(&(&leaf * r)?.sum_all()?))
}

/// `total − harness`, never below the forward alone (medians of a noisy machine).
fn less_harness(total: f64, harness: f64, fwd: f64) -> f64 {
    (total - harness).max(fwd)
}

pub(super) fn time_op(
    op: &OpSpec,
    batch: usize,
    repeats: usize,
    (dev, dtype): (&Device, DType),
) -> anyhow::Result<Timed> {
    let on = (dev, dtype);
    let input = |shape: &[usize]| -> candle_core::Result<Tensor> {
        let x = filled(shape, 1, 2.0, on)?;
        if op.input_grad {
            var(x)
        } else {
            Ok(x)
        }
    };
    let plain = |(times, checksum)| Timed { times, im2col_fwdbwd_ms: None, checksum };
    let rows = if op.rows == 0 { batch } else { op.rows };
    match op.kind {
        "conv2d" if op.groups > 1 => {
            let x = input(&[batch, op.c_in, op.side, op.side])?;
            let w =
                var(filled(&[op.c_out, op.c_in / op.groups, op.kernel, op.kernel], 2, 0.2, on)?)?;
            let cfg = Conv2dConfig {
                padding: op.padding,
                stride: op.stride,
                groups: op.groups,
                ..Default::default()
            };
            let layer = tandem::nn::FastConv2d::new(w, None, cfg);
            Ok(plain(fwd_and_step(dev, repeats, || layer.forward(&x))?))
        }
        "conv2d" => {
            let x = input(&[batch, op.c_in, op.side, op.side])?;
            let w =
                Var::from_tensor(&filled(&[op.c_out, op.c_in, op.kernel, op.kernel], 2, 0.2, on)?)?;
            let p = ConvParams { stride: op.stride, padding: op.padding, dilation: 1 };
            let y = conv2d(&x, w.as_tensor(), p)?;
            let checksum = Checksum::of(&y)?;
            let r = filled(y.dims(), 5, 2.0, (dev, dtype))?;
            let fwd = || conv2d(&x, w.as_tensor(), p);
            let step = || tandem::nn::backward(&(conv2d(&x, w.as_tensor(), p)? * &r)?.sum_all()?);
            let fwd_ms = median_ms(dev, repeats, fwd)?;
            let fwdbwd_ms = median_ms(dev, repeats, step)?;
            // Each backward alone: the other operand out of the graph.
            let (x_fixed, w_fixed) = (x.detach(), w.as_tensor().detach());
            let data_ms = op
                .input_grad
                .then(|| {
                    median_ms(dev, repeats, || {
                        tandem::nn::backward(&(conv2d(&x, &w_fixed, p)? * &r)?.sum_all()?)
                    })
                })
                .transpose()?;
            let filter_ms = Some(median_ms(dev, repeats, || {
                tandem::nn::backward(&(conv2d(&x_fixed, w.as_tensor(), p)? * &r)?.sum_all()?)
            })?);
            let harness = harness_ms(dev, repeats, &r)?;
            let less = |t: f64| less_harness(t, harness, fwd_ms);
            let (data_ms, filter_ms) = (data_ms.map(less), filter_ms.map(less));
            let times = Times { fwd_ms, fwdbwd_ms: less(fwdbwd_ms), data_ms, filter_ms };
            let winograd = dev.is_cpu()
                && applies(
                    (op.kernel, op.kernel),
                    (op.stride, p.padding, 1),
                    [batch, op.c_in, op.side, op.side],
                    op.c_out,
                );
            let im2col_fwdbwd_ms = if winograd {
                let default = MIN_CHANNELS.swap(usize::MAX, Ordering::Relaxed);
                let ms = median_ms(dev, repeats, step);
                MIN_CHANNELS.store(default, Ordering::Relaxed);
                Some(less_harness(ms?, harness, fwd_ms))
            } else {
                None
            };
            Ok(Timed { times, im2col_fwdbwd_ms, checksum })
        }
        "batch_norm" => {
            let vm = VarMap::new();
            let bn = tandem::nn::fast_batch_norm2d(
                op.c_in,
                VarBuilder::from_varmap(&vm, DType::F32, dev),
            )?;
            let x = input(&[batch, op.c_in, op.side, op.side])?;
            Ok(plain(fwd_and_step(dev, repeats, || bn.forward_t(&x, true))?))
        }
        "prelu" => {
            let a = var(Tensor::full(0.25f32, op.c_in, dev)?)?;
            let x = input(&[batch, op.c_in, op.side, op.side])?;
            let f = || tandem::nn::kernels::prelu::prelu(&x, &a);
            Ok(plain(fwd_and_step(dev, repeats, f)?))
        }
        "patch_embed" => {
            // The ViT's stem as the model runs it (one product over the patches); PyTorch's
            // side is arcface_torch's `PatchEmbed` convolution.
            let x = input(&[batch, 3, op.side, op.side])?;
            let w = var(filled(&[op.c_out, 3, op.kernel, op.kernel], 2, 0.2, on)?)?;
            let b = var(filled(&[op.c_out], 3, 0.2, on)?)?;
            Ok(plain(fwd_and_step(dev, repeats, || patch_embed(&x, &w, &b))?))
        }
        "linear" => {
            let x = input(&[rows, op.c_in])?;
            let w = var(filled(&[op.c_out, op.c_in], 2, 0.2, on)?)?;
            let b = op.bias.then(|| var(filled(&[op.c_out], 3, 0.2, on)?)).transpose()?;
            Ok(plain(fwd_and_step(dev, repeats, || fused_linear(&x, &w, b.as_ref()))?))
        }
        "layer_norm" => {
            let x = input(&[rows, op.c_in])?;
            let w = var(filled(&[op.c_in], 2, 0.2, on)?.affine(1.0, 1.0)?)?;
            let b = var(filled(&[op.c_in], 3, 0.2, on)?)?;
            Ok(plain(fwd_and_step(dev, repeats, || layer_norm(&x, &w, &b, 1e-5))?))
        }
        "linear_relu6" => {
            let x = input(&[rows, op.c_in])?;
            let w = var(filled(&[op.c_out, op.c_in], 2, 0.2, on)?)?;
            let b = var(filled(&[op.c_out], 3, 0.2, on)?)?;
            Ok(plain(fwd_and_step(dev, repeats, || fused_linear_relu6(&x, &w, Some(&b)))?))
        }
        "attention" => {
            let qkv = input(&[batch, op.tokens, 3 * op.c_in])?;
            Ok(plain(fwd_and_step(dev, repeats, || attention(&qkv, op.heads))?))
        }
        "sgd" | "adamw" => {
            let params: Vec<Var> = op
                .numels
                .iter()
                .enumerate()
                .map(|(i, &n)| Var::from_tensor(&filled(&[n], 10 + i, 0.2, on)?))
                .collect::<candle_core::Result<_>>()?;
            // The store's gradients are the filled tensors: d/dp of sum(p · g) is g.
            let mut loss = Tensor::zeros((), DType::F32, dev)?;
            for (i, p) in params.iter().enumerate() {
                let g = filled(&[op.numels[i]], 1000 + i, 0.02, on)?;
                loss = (loss + (p.as_tensor() * g)?.sum_all()?)?;
            }
            let grads = loss.backward()?;
            let mut opt: Box<dyn TorchOptimizer> = if op.kind == "sgd" {
                // The face recipe's SGD (arcface_torch's lr, momentum and weight decay).
                let c =
                    SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 5e-4, ..Default::default() };
                Box::new(TorchSgd::new(params.clone(), c)?)
            } else {
                // arcface_torch's ViT config: AdamW, lr 1e-3, weight decay 0.1.
                let c = AdamWConfig { lr: 1e-3, weight_decay: 0.1, ..Default::default() };
                Box::new(TorchAdamW::new(params.clone(), c)?)
            };
            opt.step(&grads)?;
            let mut checksum = Checksum::default();
            for p in &params {
                checksum = checksum.add(Checksum::of(p.as_tensor())?);
            }
            let step_ms = median_ms(dev, repeats, || {
                opt.step(&grads).map_err(|e| candle_core::Error::Msg(e.to_string()))
            })?;
            let times = Times { fwd_ms: step_ms, fwdbwd_ms: step_ms, ..Times::default() };
            Ok(plain((times, checksum)))
        }
        other => anyhow::bail!("op {}: unknown kind {other}", op.name),
    }
}
