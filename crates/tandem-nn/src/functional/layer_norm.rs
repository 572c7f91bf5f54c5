//! `layer_norm(x, weight, bias, eps)`: `F.layer_norm` over the last dimension, as one op on CPU
//! f32 with its backward.
//!
//! candle-nn's fast `ops::layer_norm` has no backward, and its differentiable form (mean, centre,
//! square, mean, divide, scale, shift) keeps five full-size intermediates for backward. Here the
//! forward makes the output alone; the backward recomputes each row's mean and 1/σ from the input
//! and returns the three gradients in one pass (the weight and bias gradients summed per chunk of
//! rows, then over the chunks in order: the same bits whatever the thread count). Other dtypes
//! and devices take the expression.
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::backward::take_param_grad;
use crate::contiguous_f32;
use crate::kernels::simd::{lane_sum, lane_sum2};
use crate::kernels::with_f32_slice;
use crate::vectorized_kernel;

/// `(x − mean) / sqrt(var + eps) · weight + bias` over the last dimension of `x` (the biased
/// variance, as PyTorch's `nn.LayerNorm`).
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] {
        candle_core::bail!(
            "layer_norm: weight {:?} and bias {:?} do not match the input's last dimension {d}",
            weight.dims(),
            bias.dims()
        )
    }
    let all_f32 = [x, weight, bias].iter().all(|t| t.dtype() == DType::F32);
    if x.device().is_cpu() && all_f32 {
        return x.contiguous()?.apply_op3(
            &weight.contiguous()?,
            &bias.contiguous()?,
            LayerNorm { eps },
        );
    }
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed
        .broadcast_mul(&weight.to_dtype(DType::F32)?)?
        .broadcast_add(&bias.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

struct LayerNorm {
    eps: f64,
}

/// Rows per parallel chunk.
const ROWS_PER_CHUNK: usize = 32;

/// A row's mean and 1/σ (sums in lanes: see [`lane_sum`]).
#[inline(always)]
fn moments(row: &[f32], eps: f64) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = lane_sum(row, |v| v) / n;
    let var = lane_sum(row, |v| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (var as f64 + eps).sqrt() as f32)
}

vectorized_kernel! {
    /// The rows of `x` (each `w.len()` wide) normalised, scaled and shifted into `y`.
    fn forward_rows(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], eps: f64) {
        let d = w.len();
        for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let (mean, rstd) = moments(x, eps);
            for (((y, x), w), b) in y.iter_mut().zip(x).zip(w).zip(b) {
                *y = (x - mean) * rstd * w + b;
            }
        }
    }
}

vectorized_kernel! {
    /// One chunk of rows' input gradient into `gx`, their weight and bias gradients added
    /// into `gw` and `gb`; `xhat` and `gh` are row-wide scratch.
    fn backward_rows(
        (x, w, g): (&[f32], &[f32], &[f32]),
        (gx, gw, gb): (&mut [f32], &mut [f32], &mut [f32]),
        (xhat, gh): (&mut [f32], &mut [f32]),
        eps: f64,
    ) {
        let d = w.len();
        for ((gx, x), g) in gx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(g.chunks_exact(d)) {
            let (mean, rstd) = moments(x, eps);
            for (((xh, gh), x), (g, w)) in xhat.iter_mut().zip(gh.iter_mut()).zip(x).zip(g.iter().zip(w)) {
                *xh = (x - mean) * rstd;
                *gh = g * w;
            }
            let mean_gh = lane_sum(gh, |v| v) / d as f32;
            let mean_gh_xhat = lane_sum2(gh, xhat, |a, b| a * b) / d as f32;
            for (((gw, gb), g), xh) in gw.iter_mut().zip(gb.iter_mut()).zip(g).zip(xhat.iter()) {
                *gw += g * xh;
                *gb += g;
            }
            for ((gx, gh), xh) in gx.iter_mut().zip(gh.iter()).zip(xhat.iter()) {
                *gx = (gh - mean_gh - xh * mean_gh_xhat) * rstd;
            }
        }
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "tandem-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "layer_norm", "input")?;
        let w = contiguous_f32(s2, l2, "layer_norm", "weight")?;
        let b = contiguous_f32(s3, l3, "layer_norm", "bias")?;
        let d = w.len();
        let mut y = vec![0f32; x.len()];
        if d > 0 {
            let chunk = d * ROWS_PER_CHUNK;
            y.par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk))
                .for_each(|(y, x)| forward_rows(x, w, b, y, self.eps));
        }
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// The weight's and bias's gradients go to [`crate::backward`]'s store (and to a Ddp
    /// reducing during backward) as the fused layers' do.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gx, gw, gb) = grads(x, w, b, g, self.eps)?;
        Ok((Some(gx), gw, gb))
    }
}

/// The op's gradients for CPU f32 `x` (contiguous), `w`, `b` and the output's `g`: the input's,
/// and the weight's and bias's as [`take_param_grad`] leaves them (`None` when taken).
pub(crate) fn grads(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    g: &Tensor,
    eps: f64,
) -> candle_core::Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let d = w.elem_count();
    let g = g.contiguous()?;
    let (gx, gw, gb) = with_f32_slice(x, |x| {
        with_f32_slice(w, |w| with_f32_slice(&g, |g| layer_norm_backward(x, w, g, d, eps)))
    })???;
    let gx = Tensor::from_vec(gx, x.shape(), x.device())?;
    let gw = Tensor::from_vec(gw, d, x.device())?;
    let gb = Tensor::from_vec(gb, d, x.device())?;
    Ok((gx, take_param_grad(w, Some(gw))?, take_param_grad(b, Some(gb))?))
}

/// `(∂x, ∂weight, ∂bias)`: per row, with x̂ the normalised input and ĝ = g·weight,
/// ∂x = (ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)) / σ; ∂weight = Σ g·x̂ and ∂bias = Σ g over the rows.
fn layer_norm_backward(
    x: &[f32],
    w: &[f32],
    g: &[f32],
    d: usize,
    eps: f64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut gx = vec![0f32; x.len()];
    if d == 0 {
        return (gx, Vec::new(), Vec::new());
    }
    let chunk = d * ROWS_PER_CHUNK;
    let partials: Vec<(Vec<f32>, Vec<f32>)> = gx
        .par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk).zip(g.par_chunks(chunk)))
        .map(|(gx, (x, g))| {
            let (mut gw, mut gb) = (vec![0f32; d], vec![0f32; d]);
            let (mut xhat, mut gh) = (vec![0f32; d], vec![0f32; d]);
            backward_rows((x, w, g), (gx, &mut gw, &mut gb), (&mut xhat, &mut gh), eps);
            (gw, gb)
        })
        .collect();
    let (mut gw, mut gb) = (vec![0f32; d], vec![0f32; d]);
    for (pw, pb) in &partials {
        gw.iter_mut().zip(pw).for_each(|(a, b)| *a += b);
        gb.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
    (gx, gw, gb)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::layer_norm;

    /// Values and all three gradients equal the differentiable expression (the path other
    /// devices take) within float noise, on rows far from zero mean.
    #[test]
    fn matches_the_expression_forward_and_backward() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(
            &(Tensor::randn(0f32, 2.0, (3, 70, 48), &dev).unwrap() + 3.0).unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, 48, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.3, 48, &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 70, 48), &dev).unwrap();
        let ours = layer_norm(&x, &w, &b, 1e-5).unwrap();
        // The expression, in f64 (the op runs only on f32).
        let f64 = |t: &Var| t.as_tensor().to_dtype(DType::F64).unwrap();
        let reference = layer_norm(&f64(&x), &f64(&w), &f64(&b), 1e-5).unwrap();
        let diff = (ours.to_dtype(DType::F64).unwrap() - &reference).unwrap();
        let max = diff.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        assert!(max.to_scalar::<f64>().unwrap() < 1e-5);
        let ga = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let (x64, w64, b64) = (
            Var::from_tensor(&f64(&x)).unwrap(),
            Var::from_tensor(&f64(&w)).unwrap(),
            Var::from_tensor(&f64(&b)).unwrap(),
        );
        let r = layer_norm(&x64, &w64, &b64, 1e-5).unwrap();
        let gb = (r * probe.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (ours, theirs) in [(&x, &x64), (&w, &w64), (&b, &b64)] {
            let a = ga.get(ours).unwrap().to_dtype(DType::F64).unwrap();
            let e = gb.get(theirs).unwrap();
            let scale =
                e.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
            let err = (a - e).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            assert!(err.to_scalar::<f64>().unwrap() <= 1e-5 * scale.max(1.0), "{err}");
        }
    }

    #[test]
    fn a_mismatched_weight_is_named() {
        let x = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(7, DType::F32, &Device::Cpu).unwrap();
        let e = layer_norm(&x, &w, &w, 1e-5).unwrap_err().to_string();
        assert!(e.contains("last dimension 8"), "{e}");
    }
}
