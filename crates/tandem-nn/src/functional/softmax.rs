//! `softmax_last_dim(x)`: `x.softmax(dim=-1)` as one op on CPU f32, with its backward.
//!
//! candle-nn's fast `ops::softmax_last_dim` has no backward, and its differentiable
//! `ops::softmax` keeps the exponentials and their sums for backward. Here the forward makes the
//! output alone and the backward, `y·(g − Σ g·y)` per row, reads only that output. Other dtypes
//! and devices take candle-nn's differentiable form.
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::contiguous_f32;
use crate::kernels::with_f32_slice;

/// The softmax of `x` over its last dimension.
pub fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        x.contiguous()?.apply_op1(Softmax)
    } else {
        candle_nn::ops::softmax(x, D::Minus1)
    }
}

struct Softmax;

/// Rows per parallel chunk.
const ROWS_PER_CHUNK: usize = 64;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "tandem-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "softmax", "input")?;
        let d = l.dims().last().copied().unwrap_or(1);
        let mut y = vec![0f32; x.len()];
        if d > 0 {
            let chunk = d * ROWS_PER_CHUNK;
            y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(y, x)| {
                for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for (y, x) in y.iter_mut().zip(x) {
                        *y = (x - max).exp();
                        sum += *y;
                    }
                    y.iter_mut().for_each(|y| *y /= sum);
                }
            });
        }
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let d = y.dim(D::Minus1)?;
        let g = g.contiguous()?;
        let gx = with_f32_slice(y, |y| {
            with_f32_slice(&g, |g| {
                let mut gx = vec![0f32; y.len()];
                if d > 0 {
                    let chunk = d * ROWS_PER_CHUNK;
                    gx.par_chunks_mut(chunk)
                        .zip(y.par_chunks(chunk).zip(g.par_chunks(chunk)))
                        .for_each(|(gx, (y, g))| {
                            let rows = gx.chunks_exact_mut(d).zip(y.chunks_exact(d));
                            for ((gx, y), g) in rows.zip(g.chunks_exact(d)) {
                                let gy: f32 = g.iter().zip(y).map(|(g, y)| g * y).sum();
                                for ((o, g), y) in gx.iter_mut().zip(g).zip(y) {
                                    *o = y * (g - gy);
                                }
                            }
                        });
                }
                gx
            })
        })??;
        Ok(Some(Tensor::from_vec(gx, y.shape(), y.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var, D};

    use super::softmax_last_dim;

    /// Values and gradients equal candle-nn's differentiable softmax in f64.
    #[test]
    fn matches_candle_s_softmax_forward_and_backward() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 4.0, (2, 3, 5, 37), &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (2, 3, 5, 37), &dev).unwrap();
        let y = softmax_last_dim(&x).unwrap();
        let x64 = Var::from_tensor(&x.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let r = candle_nn::ops::softmax(&x64, D::Minus1).unwrap();
        let max_err = |a: &Tensor, b: &Tensor| {
            let d = (a.to_dtype(DType::F64).unwrap() - b).unwrap().abs().unwrap();
            d.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
        };
        assert!(max_err(&y, &r) < 1e-6);
        let ga = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gr = (r * probe.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap();
        let gr = gr.backward().unwrap();
        assert!(max_err(ga.get(&x).unwrap(), gr.get(&x64).unwrap()) < 1e-5);
    }
}
