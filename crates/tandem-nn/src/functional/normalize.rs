//! `normalize(x)`: `F.normalize(x, p=2, dim=1)` for `[rows, features]`, as one op on CPU f32.
//!
//! candle's expression (`x / max(sqrt(sum(x²)), eps)`) keeps `x²` and the quotient for backward
//! and makes three more full-size tensors there (and a zeroed buffer per gradient it adds up):
//! for PartialFC's sampled centres, hundreds of MiB each at a million classes. Here the forward
//! makes the output alone and the backward one gradient, `(g − y·(g·y)) / n` per row, from the
//! input and output it already keeps. Other dtypes and devices use candle's expression.
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::contiguous_f32;
use crate::kernels::with_f32_slice;

/// PyTorch's default `eps` of `F.normalize`.
const EPS: f32 = 1e-12;

/// Rows of `x: [rows, features]` scaled to unit L2 norm: `x / max(‖x‖, 1e-12)`.
pub fn normalize(x: &Tensor) -> candle_core::Result<Tensor> {
    x.dims2()?;
    let cuda = cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if (x.device().is_cpu() && x.dtype() == DType::F32) || cuda {
        x.contiguous()?.apply_op1(Normalize)
    } else {
        let norm = x.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(EPS as f64)?;
        x.broadcast_div(&norm)
    }
}

struct Normalize;

fn row_norm(row: &[f32]) -> f32 {
    row.iter().map(|v| v * v).sum::<f32>().sqrt()
}

/// Rows per parallel chunk.
const ROWS_PER_CHUNK: usize = 64;

impl CustomOp1 for Normalize {
    fn name(&self) -> &'static str {
        "tandem-normalize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, f) = l.shape().dims2()?;
        let x = contiguous_f32(s, l, "normalize", "input")?;
        let mut y = vec![0f32; x.len()];
        if f > 0 {
            y.par_chunks_mut(f * ROWS_PER_CHUNK).zip(x.par_chunks(f * ROWS_PER_CHUNK)).for_each(
                |(y, x)| {
                    for (y, x) in y.chunks_exact_mut(f).zip(x.chunks_exact(f)) {
                        let n = row_norm(x).max(EPS);
                        y.iter_mut().zip(x).for_each(|(y, x)| *y = x / n);
                    }
                },
            );
        }
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((tandem_cuda::rows::normalize((s, l))?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let g = g.to_dtype(x.dtype())?;
            return Ok(Some(tandem_cuda::rows::normalize_backward(x, y, &g)?));
        }
        let (_, f) = x.dims2()?;
        if f == 0 {
            return Ok(Some(x.zeros_like()?));
        }
        let g = g.contiguous()?;
        let gx = with_f32_slice(x, |x| {
            with_f32_slice(y, |y| {
                with_f32_slice(&g, |g| {
                    let mut gx = vec![0f32; x.len()];
                    let chunk = f * ROWS_PER_CHUNK;
                    gx.par_chunks_mut(chunk)
                        .zip(x.par_chunks(chunk).zip(y.par_chunks(chunk).zip(g.par_chunks(chunk))))
                        .for_each(|(gx, (x, (y, g)))| {
                            let rows = gx.chunks_exact_mut(f).zip(x.chunks_exact(f));
                            for ((gx, x), (y, g)) in
                                rows.zip(y.chunks_exact(f).zip(g.chunks_exact(f)))
                            {
                                let norm = row_norm(x);
                                if norm > EPS {
                                    // d(x/‖x‖) = (g − y (g·y)) / ‖x‖
                                    let gy: f32 = g.iter().zip(y).map(|(g, y)| g * y).sum();
                                    for ((o, g), y) in gx.iter_mut().zip(g).zip(y) {
                                        *o = (g - y * gy) / norm;
                                    }
                                } else {
                                    // The clamp holds the norm at eps: no gradient through it.
                                    gx.iter_mut().zip(g).for_each(|(o, g)| *o = g / EPS);
                                }
                            }
                        });
                    gx
                })
            })
        })???;
        Ok(Some(Tensor::from_vec(gx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// Values and gradients equal candle's `x / max(‖x‖, eps)` within float noise, a zero row
    /// included (its output is zero and its gradient `g / eps`, as the clamp gives).
    #[test]
    fn values_and_gradient_match_the_expression() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (200, 33), &dev).unwrap();
        let x =
            Tensor::cat(&[&x, &Tensor::zeros((1, 33), candle_core::DType::F32, &dev).unwrap()], 0)
                .unwrap();
        let x = Var::from_tensor(&x).unwrap();
        let r = Tensor::randn(0f32, 1.0, (201, 33), &dev).unwrap();
        let ours = super::normalize(x.as_tensor()).unwrap();
        let norm = x
            .as_tensor()
            .sqr()
            .unwrap()
            .sum_keepdim(1)
            .unwrap()
            .sqrt()
            .unwrap()
            .maximum(1e-12)
            .unwrap();
        let theirs = x.as_tensor().broadcast_div(&norm).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in flat(&ours).iter().zip(flat(&theirs)) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let go = flat((ours * &r).unwrap().sum_all().unwrap().backward().unwrap().get(&x).unwrap());
        let gt =
            flat((theirs * &r).unwrap().sum_all().unwrap().backward().unwrap().get(&x).unwrap());
        for (i, (a, b)) in go.iter().zip(&gt).enumerate().take(200 * 33) {
            assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "gradient {i}: {a} vs {b}");
        }
        let zero_row_grad = &go[200 * 33..];
        let want: Vec<f32> = flat(&r)[200 * 33..].iter().map(|g| g / 1e-12).collect();
        assert_eq!(zero_row_grad, &want[..]);
    }
}
