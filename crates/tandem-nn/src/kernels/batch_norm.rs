//! BatchNorm2d training forward and backward fused into one custom op on CPU f32 tensors.
//!
//! Why: written with candle ops, a training BatchNorm is ~8 tensor ops forward (sums, broadcast
//! subtract, square, divide, scale, shift) and as many backward, each allocating a full-size
//! tensor and most single-threaded. Here the statistics are one pass (f64 sums per channel),
//! the output one pass, and the backward two passes with PyTorch's formula
//! `gx = γ·invstd·(gy − mean(gy) − x̂·mean(gy·x̂))`, `gγ = Σ gy·x̂`, `gβ = Σ gy`,
//! channels spread over the rayon threads.
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::relu::masked_by_positive;
use crate::kernels::with_f32_slice;

/// Per-channel batch statistics of `x: [N, C, H, W]`: (mean, biased variance, count).
pub fn batch_stats(x: &[f32], (n, c, hw): (usize, usize, usize)) -> (Vec<f32>, Vec<f32>, usize) {
    let stats: Vec<(f32, f32)> = (0..c)
        .into_par_iter()
        .map(|ch| {
            let (mut s, mut sq) = (0f64, 0f64);
            for i in 0..n {
                for &v in &x[(i * c + ch) * hw..(i * c + ch + 1) * hw] {
                    let v = v as f64;
                    s += v;
                    sq += v * v;
                }
            }
            let m = (n * hw).max(1) as f64;
            let mean = s / m;
            ((mean) as f32, (sq / m - mean * mean).max(0.0) as f32)
        })
        .collect();
    (stats.iter().map(|s| s.0).collect(), stats.iter().map(|s| s.1).collect(), n * hw)
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

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
        candle_core::bail!("batch_norm: contiguous f32 operands only")
    };
    Ok(&v[a..b])
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
        let (x, gamma, beta) = (contiguous(xs, xl)?, contiguous(gs, gl)?, contiguous(bs, bl)?);
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(hw).zip(x.par_chunks(hw)).enumerate().for_each(|(plane, (y, x))| {
            let ch = plane % c;
            let scale = gamma[ch] * self.invstd[ch];
            let shift = beta[ch] - self.mean[ch] * scale;
            if self.relu {
                y.iter_mut().zip(x).for_each(|(y, x)| *y = (x * scale + shift).max(0.0));
            } else {
                y.iter_mut().zip(x).for_each(|(y, x)| *y = x * scale + shift);
            }
        });
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, c, h, w) = x.dims4()?;
        let hw = h * w;
        let m = (n * hw) as f64;
        let gy = if self.relu {
            // Through the ReLU first: the gradient where the output is positive.
            Tensor::from_vec(masked_by_positive(&gy.contiguous()?, y)?, y.shape(), y.device())?
        } else {
            gy.contiguous()?
        };
        // Per channel: Σ gy and Σ gy·x̂.
        let sums: Vec<(f64, f64)> = with_f32_slice(x, |x| {
            with_f32_slice(&gy, |gy| {
                (0..c)
                    .into_par_iter()
                    .map(|ch| {
                        let (mean, invstd) = (self.mean[ch], self.invstd[ch]);
                        let (mut sg, mut sgx) = (0f64, 0f64);
                        for i in 0..n {
                            let r = (i * c + ch) * hw..(i * c + ch + 1) * hw;
                            for (&xv, &g) in x[r.clone()].iter().zip(&gy[r]) {
                                sg += g as f64;
                                sgx += (g * (xv - mean) * invstd) as f64;
                            }
                        }
                        (sg, sgx)
                    })
                    .collect()
            })
        })??;
        let dev = x.device();
        let ggamma = gamma
            .track_op()
            .then(|| Tensor::from_vec(sums.iter().map(|s| s.1 as f32).collect::<Vec<_>>(), c, dev))
            .transpose()?;
        let gbeta = beta
            .track_op()
            .then(|| Tensor::from_vec(sums.iter().map(|s| s.0 as f32).collect::<Vec<_>>(), c, dev))
            .transpose()?;
        let gx = if x.track_op() {
            let gamma: Vec<f32> = gamma.to_vec1()?;
            let v = with_f32_slice(x, |x| {
                with_f32_slice(&gy, |gy| {
                    let mut gx = vec![0f32; x.len()];
                    gx.par_chunks_mut(hw).enumerate().for_each(|(plane, out)| {
                        let ch = plane % c;
                        let (mean, invstd) = (self.mean[ch], self.invstd[ch]);
                        let k = gamma[ch] * invstd;
                        let mean_g = (sums[ch].0 / m) as f32;
                        let mean_gx = (sums[ch].1 / m) as f32;
                        let r = plane * hw..(plane + 1) * hw;
                        for ((o, &xv), &g) in out.iter_mut().zip(&x[r.clone()]).zip(&gy[r]) {
                            let xhat = (xv - mean) * invstd;
                            *o = k * (g - mean_g - xhat * mean_gx);
                        }
                    });
                    gx
                })
            })??;
            Some(Tensor::from_vec(v, x.shape(), dev)?)
        } else {
            None
        };
        Ok((gx, ggamma, gbeta))
    }
}

/// Training-mode BatchNorm2d on a CPU f32 `x: [N, C, H, W]`: the output, and the batch's
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
    let (n, c, h, w) = x.dims4()?;
    let (mean, var, count) = with_f32_slice(&x, |s| batch_stats(s, (n, c, h * w)))?;
    let invstd = var.iter().map(|v| (1.0 / (*v as f64 + eps).sqrt()) as f32).collect();
    let op = BatchNormTrain { mean: mean.clone(), invstd, relu }; // the op keeps its own for backward
    let y = x.apply_op3(&gamma.contiguous()?, &beta.contiguous()?, op)?;
    Ok((y, mean, var, count))
}
