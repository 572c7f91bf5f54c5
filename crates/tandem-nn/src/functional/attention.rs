//! `attention(qkv, heads)`: multi-head self-attention on a packed `[N, T, 3·D]` projection (the
//! `qkv` Linear's output of a ViT block, PyTorch's `reshape(N, T, 3, H, D/H).permute(2, 0, 3, 1,
//! 4)` layout) to `[N, T, D]`: per sample and head, `softmax(Q·Kᵀ / sqrt(D/H))·V`, the heads side
//! by side.
//!
//! Written as one op on CPU f32 because candle's composition pays for its layout at every step:
//! the permute and three `contiguous` copies of Q, K and V, Kᵀ copied again, the probabilities
//! kept for backward, then in backward each slice's gradient padded with zeros to the full
//! `[3, N, H, T, D/H]` and summed. Here the products read Q, K and V in place from the
//! projection (strided views), the forward keeps its output and the probabilities (as PyTorch
//! keeps `attn`), and the backward writes dQ, dK and dV straight into the projection's
//! gradient. Samples run in parallel, heads in
//! order: each value comes from the same sums in the same order whatever the thread count.
//! Other dtypes and devices take candle's composition.
use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, DType, IndexOp, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::softmax_last_dim;
use crate::contiguous_f32;
use crate::kernels::matmul::{matmul, View};
use crate::kernels::simd::{lane_max, lane_sum, lane_sum2};
use crate::kernels::with_f32_slice;
use crate::vectorized_kernel;

/// Multi-head self-attention of `qkv: [N, T, 3·D]` with `heads` heads; returns `[N, T, D]`.
pub fn attention(qkv: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (n, t, three_d) = qkv.dims3()?;
    if heads == 0 || three_d % (3 * heads) != 0 {
        candle_core::bail!(
            "attention: the projection's last dimension {three_d} is not 3 x a multiple of the \
             {heads} heads"
        )
    }
    let d = three_d / 3;
    if qkv.device().is_cpu() && qkv.dtype() == DType::F32 {
        return qkv.contiguous()?.apply_op1(Attention::new(heads));
    }
    let hd = d / heads;
    let qkv = qkv.reshape((n, t, 3, heads, hd))?.permute((2, 0, 3, 1, 4))?;
    let (q, k, v) = (qkv.i(0)?.contiguous()?, qkv.i(1)?.contiguous()?, qkv.i(2)?.contiguous()?);
    let scores = (q.matmul(&k.t()?.contiguous()?)? * (hd as f64).powf(-0.5))?;
    let y = softmax_last_dim(&scores)?.matmul(&v)?;
    y.transpose(1, 2)?.reshape((n, t, d))
}

pub(crate) struct Attention {
    heads: usize,
    /// The forward's probabilities, `[N, H, T, T]`, kept for backward (as PyTorch keeps
    /// `attn`): taken by the backward, so they live as long as the graph needs them.
    probs: Mutex<Option<Vec<f32>>>,
}

/// One sample's shapes: tokens, width, head width, and the softmax scale.
#[derive(Clone, Copy)]
struct Dims {
    t: usize,
    d: usize,
    hd: usize,
    scale: f32,
}

impl Attention {
    /// The CPU f32 op on `heads` heads (a projection's width must split into them).
    pub(crate) fn new(heads: usize) -> Self {
        Attention { heads, probs: Mutex::new(None) }
    }

    fn dims(&self, layout: &Layout) -> candle_core::Result<(usize, Dims)> {
        let (n, t, three_d) = layout.shape().dims3()?;
        let d = three_d / 3;
        let hd = d / self.heads;
        Ok((n, Dims { t, d, hd, scale: (hd as f32).powf(-0.5) }))
    }
}

/// Head `h`'s probabilities `softmax(Q·Kᵀ·scale)` of one sample's projection `qkv` into `p`.
fn probabilities(qkv: &[f32], h: usize, dm: Dims, p: &mut [f32]) {
    let Dims { t, d, hd, scale } = dm;
    let q = View { data: &qkv[h * hd..], rs: 3 * d, cs: 1 };
    let kt = View { data: &qkv[d + h * hd..], rs: 1, cs: 3 * d };
    matmul((t, t, hd), p, t, q, kt, false, 1);
    softmax_rows(p, t, scale);
}

vectorized_kernel! {
    /// Each `t`-wide row of scores in `p` replaced by `softmax(row · scale)`: the exponentials
    /// in one vector loop, the max and sum in lanes (see [`lane_sum`]).
    fn softmax_rows(p: &mut [f32], t: usize, scale: f32) {
        for row in p.chunks_exact_mut(t) {
            let max = lane_max(row) * scale;
            row.iter_mut().for_each(|v| *v = exp_nonpositive(*v * scale - max));
            let sum = lane_sum(row, |v| v);
            row.iter_mut().for_each(|v| *v /= sum);
        }
    }
}

vectorized_kernel! {
    /// The scores' gradient from the probabilities' in place: per row of `dp` (with `p` the
    /// probabilities), `dS = P ⊙ (dP − Σ dP⊙P) · scale`.
    fn softmax_backward_rows(dp: &mut [f32], p: &[f32], t: usize, scale: f32) {
        for (ds, p) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
            let dot = lane_sum2(ds, p, |a, b| a * b);
            for (v, p) in ds.iter_mut().zip(p) {
                *v = p * (*v - dot) * scale;
            }
        }
    }
}

/// `e^x` for `x <= 0` (a softmax's shifted scores), within 2 ulp of libm's `expf`, in straight
/// float arithmetic the compiler vectorises: libm's scalar call was a tenth of the attention's
/// time. Cody–Waite reduction `x = n ln 2 + r`, |r| <= ln 2 / 2, Cephes' degree-6 polynomial
/// for `e^r`, and `2^n` built in the exponent bits; below -87.3 (under f32's normal range,
/// where softmax terms vanish against the row's 1) it returns 0.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let clamped = x.max(-87.3);
    let n = (clamped * LOG2E + 0.5).floor();
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4_f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        e * scale
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "tandem-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let qkv = contiguous_f32(s, l, "attention", "projection")?;
        let (n, dm) = self.dims(l)?;
        let Dims { t, d, hd, .. } = dm;
        let mut y = vec![0f32; n * t * d];
        let heads = self.heads;
        let mut probs = vec![0f32; n * heads * t * t];
        if t > 0 && d > 0 {
            let per_sample = y.par_chunks_mut(t * d).zip(probs.par_chunks_mut(heads * t * t));
            per_sample.zip(qkv.par_chunks(t * 3 * d)).for_each(|((y, probs), qkv)| {
                for (h, p) in probs.chunks_exact_mut(t * t).enumerate() {
                    probabilities(qkv, h, dm, p);
                    let pv = View { data: p, rs: t, cs: 1 };
                    let v = View { data: &qkv[2 * d + h * hd..], rs: 3 * d, cs: 1 };
                    matmul((t, hd, t), &mut y[h * hd..], d, pv, v, false, 1);
                }
            });
        }
        *self.probs.lock().unwrap_or_else(|p| p.into_inner()) = Some(probs);
        Ok((CpuStorage::F32(y), Shape::from((n, t, d))))
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (_, dm) = self.dims(qkv.layout())?;
        let Dims { t, d, hd, scale } = dm;
        let g = g.contiguous()?;
        let kept = self.probs.lock().unwrap_or_else(|p| p.into_inner()).take();
        let heads = self.heads;
        let gqkv = with_f32_slice(qkv, |qkv| {
            with_f32_slice(&g, |g| {
                let mut gqkv = vec![0f32; qkv.len()];
                if t == 0 || d == 0 {
                    return gqkv;
                }
                let chunks = gqkv.par_chunks_mut(t * 3 * d).enumerate();
                chunks.zip(qkv.par_chunks(t * 3 * d).zip(g.par_chunks(t * d))).for_each(
                    |((s, gqkv), (qkv, g))| {
                        let (mut p, mut dp) = (vec![0f32; t * t], vec![0f32; t * t]);
                        for h in 0..heads {
                            // The forward's, or recomputed (a second backward of the graph).
                            match &kept {
                                Some(all) => {
                                    let at = (s * heads + h) * t * t;
                                    p.copy_from_slice(&all[at..at + t * t]);
                                }
                                None => probabilities(qkv, h, dm, &mut p),
                            }
                            let gy = View { data: &g[h * hd..], rs: d, cs: 1 };
                            // dV = Pᵀ·dY
                            let pt = View { data: &p, rs: 1, cs: t };
                            matmul(
                                (t, hd, t),
                                &mut gqkv[2 * d + h * hd..],
                                3 * d,
                                pt,
                                gy,
                                false,
                                1,
                            );
                            // dP = dY·Vᵀ; dS = P ⊙ (dP − Σ dP⊙P) · scale
                            let vt = View { data: &qkv[2 * d + h * hd..], rs: 1, cs: 3 * d };
                            matmul((t, t, hd), &mut dp, t, gy, vt, false, 1);
                            softmax_backward_rows(&mut dp, &p, t, scale);
                            // dQ = dS·K, dK = dSᵀ·Q
                            let ds = View { data: &dp, rs: t, cs: 1 };
                            let k = View { data: &qkv[d + h * hd..], rs: 3 * d, cs: 1 };
                            matmul((t, hd, t), &mut gqkv[h * hd..], 3 * d, ds, k, false, 1);
                            let dst = View { data: &dp, rs: 1, cs: t };
                            let q = View { data: &qkv[h * hd..], rs: 3 * d, cs: 1 };
                            matmul((t, hd, t), &mut gqkv[d + h * hd..], 3 * d, dst, q, false, 1);
                        }
                    },
                );
                gqkv
            })
        })??;
        Ok(Some(Tensor::from_vec(gqkv, qkv.shape(), qkv.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::attention;

    #[test]
    fn matches_the_composition_forward_and_backward() {
        let dev = Device::Cpu;
        let (n, t, d, heads) = (3, 37, 24, 4);
        let qkv =
            Var::from_tensor(&Tensor::randn(0f32, 1.5, (n, t, 3 * d), &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (n, t, d), &dev).unwrap();
        let y = attention(&qkv, heads).unwrap();
        let q64 = Var::from_tensor(&qkv.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        // f64 takes the composition (candle's ops, PyTorch's layout).
        let r = attention(&q64, heads).unwrap();
        let err = |a: &Tensor, b: &Tensor| {
            let diff = (a.to_dtype(DType::F64).unwrap() - b).unwrap().abs().unwrap();
            diff.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
        };
        assert!(err(&y, &r) < 1e-5, "{}", err(&y, &r));
        let ga = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let p64 = probe.to_dtype(DType::F64).unwrap();
        let gr = (r * p64).unwrap().sum_all().unwrap().backward().unwrap();
        let e = err(ga.get(&qkv).unwrap(), gr.get(&q64).unwrap());
        assert!(e < 1e-5, "{e}");
    }

    #[test]
    fn the_exponential_is_within_two_ulp_of_libm() {
        let mut worst = 0u32;
        let mut x = 0f32;
        while x > -87.0 {
            let (ours, libm) = (super::exp_nonpositive(x), x.exp());
            worst = worst.max(ours.to_bits().abs_diff(libm.to_bits()));
            x -= 0.000_37;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(super::exp_nonpositive(0.0), 1.0);
        assert_eq!(super::exp_nonpositive(-100.0), 0.0);
    }

    #[test]
    fn a_width_that_does_not_split_into_heads_is_named() {
        let qkv = Tensor::zeros((1, 4, 30), DType::F32, &Device::Cpu).unwrap();
        let e = attention(&qkv, 4).unwrap_err().to_string();
        assert!(e.contains("4 heads"), "{e}");
    }
}
