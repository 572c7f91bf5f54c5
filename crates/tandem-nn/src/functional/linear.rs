//! `fused_linear(x, w, b)`: `torch.nn.functional.linear`, i.e. `x @ wᵀ + b`, with a backward made
//! for training.
//!
//! Why not `x.matmul(&w.t()) + b`: candle's autograd sends the weight gradient back through the
//! transpose as a strided `[out, in]` view and adds it element by element into a freshly zeroed
//! buffer — a weight-sized strided pass per layer per step, which on the bench MLP cost more
//! than the backward matmuls themselves. It also computes the input gradient of the first
//! layer, whose input is data and needs none, adds the bias in a pass of its own, and its gemm
//! splits work across threads poorly at these shapes. Here, for f32 on the CPU, the product is
//! one custom op over [`crate::kernels`]' blocked gemm: the output starts as the bias and the
//! product is accumulated onto it; the backward returns a contiguous weight gradient `gᵀ @ x`,
//! the bias gradient (column sums of `g`), and an input gradient `g @ w` only when the input
//! is part of the autograd graph. Other dtypes take candle's matmul; other devices the plain
//! expression.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use crate::backward::take_param_grad;
use crate::contiguous_f32;
use crate::kernels::matmul::{by_dot_products, matmul, View};
use crate::kernels::transposed;
use crate::kernels::with_f32_slice;

/// `x @ wᵀ (+ b)` for `x: [.., in]`, `w: [out, in]`, `b: [out]`, like PyTorch's
/// `F.linear`; leading dimensions of `x` are kept.
pub fn fused_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    linear_then(x, w, b, false)
}

/// `relu6(x @ wᵀ + b)` (a ViT MLP's first layer and its activation): on CPU f32 one op, whose
/// forward clamps the product in place and whose backward masks the output's gradient (where
/// `0 < y < 6`, as ReLU6's own backward passes it where `0 < x < 6`: the same elements) before
/// the product's gradients — no separate activation tensor, its gradient, nor candle's zeroed
/// accumulator for it. The same values as [`fused_linear`] then [`relu6`](super::relu6).
pub fn fused_linear_relu6(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    linear_then(x, w, b, true)
}

/// [`fused_linear`], followed by ReLU6 when `relu6`.
fn linear_then(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    relu6: bool,
) -> candle_core::Result<Tensor> {
    let (out_features, in_features) = w.dims2()?;
    let x_dims = x.dims().to_vec();
    let Some((&last, lead)) = x_dims.split_last() else {
        candle_core::bail!("linear: input is a scalar; expected [.., {in_features}]")
    };
    if last != in_features {
        candle_core::bail!("linear: input has {last} features in its last dimension, the weight [{out_features}, {in_features}] expects {in_features}")
    }
    if let Some(b) = b {
        if b.dims() != [out_features] {
            candle_core::bail!("linear: bias has shape {:?}, the weight [{out_features}, {in_features}] expects [{out_features}]", b.dims())
        }
    }
    let rows: usize = lead.iter().product();
    let x2 = if x.rank() == 2 { x.clone() } else { x.reshape((rows, in_features))? };
    let on_cpu = x.device().is_cpu() && w.device().is_cpu();
    let all_f32 = [Some(x), Some(w), b].iter().flatten().all(|t| t.dtype() == DType::F32);
    let y = if on_cpu && all_f32 {
        let (x2, w) = (x2.contiguous()?, w.contiguous()?);
        let op = LinearF32 { relu6 };
        match b {
            Some(b) => x2.apply_op3(&w, &b.contiguous()?, op)?,
            None => x2.apply_op2(&w, op)?,
        }
    } else {
        let y = if on_cpu { x2.apply_op2(w, LinearNoBias)? } else { x2.matmul(&w.t()?)? };
        let y = match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        if relu6 {
            super::relu6(&y)?
        } else {
            y
        }
    };
    if x.rank() == 2 {
        Ok(y)
    } else {
        let mut out_dims = lead.to_vec();
        out_dims.push(out_features);
        y.reshape(out_dims)
    }
}

/// `x @ wᵀ (+ b)` for contiguous 2-d f32 operands on the CPU, on the blocked gemm; clamped to
/// `[0, 6]` when `relu6`.
struct LinearF32 {
    relu6: bool,
}

fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// `[rows, n]` = `bias` broadcast over the rows (or zeros) `+ x[rows, k] · w[n, k]ᵀ`.
fn linear_forward(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (rows, n, k): (usize, usize, usize),
) -> Vec<f32> {
    let mut y = match bias {
        Some(b) => b.repeat(rows),
        None => vec![0f32; rows * n],
    };
    let xv = View { data: x, rs: k, cs: 1 };
    let wt = View { data: w, rs: 1, cs: k };
    // `w` read as `wᵀ` has its columns contiguous along the inner dimension, which gemm packs
    // at a fraction of its speed once per block of rows; one blocked transpose first costs
    // less (ViT-T's fc2, [1032, 1024] · [1024, 256]: 3.05 → 2.35 ms a thread, the transpose
    // 0.16 ms) while the weight stays near the cache.
    let w_t = (rows >= TRANSPOSE_FROM_ROWS
        && n * k <= TRANSPOSE_MAX_VALUES
        && !by_dot_products(rows, k, xv, wt))
    .then(|| transposed(w, n, k));
    let wt = w_t.as_deref().map_or(wt, |data| View { data, rs: n, cs: 1 });
    matmul((rows, n, k), &mut y, n, xv, wt, bias.is_some(), threads());
    y
}

/// Rows from which the forward transposes the weight first (a product of fewer rows against a
/// large weight is closer to a matrix-vector one, where the transpose is most of the work).
const TRANSPOSE_FROM_ROWS: usize = 8;

/// The largest weight (values) the forward transposes first: past the cache the transpose
/// runs at memory speed and costs more than gemm's slow packing saves (2 threads, 2-core AMD
/// EPYC: [256, 4096] · [4096, 1024] 16.0 → 12.5 ms, but [128, 4096] · [4096, 2048] 21.7 →
/// 29.2 ms and IResNet's feature layer, [128, 25088] · [25088, 512], 27.7 → 39.0 ms).
const TRANSPOSE_MAX_VALUES: usize = 1 << 22;

fn forward_shapes(xl: &Layout, wl: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let (rows, k) = xl.shape().dims2()?;
    let (n, k_w) = wl.shape().dims2()?;
    if k != k_w {
        candle_core::bail!(
            "linear: input [{rows}, {k}] and weight [{n}, {k_w}] disagree on in_features"
        )
    }
    Ok((rows, n, k))
}

/// Both ops' forward: the operands checked and read as f32 slices, then [`linear_forward`]
/// (and the clamp when `relu6`).
fn cpu_forward(
    (x, xl): (&CpuStorage, &Layout),
    (w, wl): (&CpuStorage, &Layout),
    bias: Option<(&CpuStorage, &Layout)>,
    relu6: bool,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let dims = forward_shapes(xl, wl)?;
    let (x, w) =
        (contiguous_f32(x, xl, "linear", "input")?, contiguous_f32(w, wl, "linear", "weight")?);
    let b = bias.map(|(b, bl)| contiguous_f32(b, bl, "linear", "bias")).transpose()?;
    let mut y = linear_forward(x, w, b, dims);
    if relu6 {
        super::relu6::clamp_in_place(&mut y);
    }
    Ok((CpuStorage::F32(y), Shape::from((dims.0, dims.1))))
}

/// The gradient reaching the product: `g` itself, or with ReLU6 `g` where `0 < y < 6`.
fn product_grad(relu6: bool, y: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    if !relu6 {
        return Ok(g.clone());
    }
    let g = g.contiguous()?;
    let masked = with_f32_slice(y, |y| with_f32_slice(&g, |g| super::relu6::passed(y, g)))??;
    Tensor::from_vec(masked, y.shape(), y.device())
}

impl CustomOp2 for LinearF32 {
    fn name(&self) -> &'static str {
        "tandem-linear-f32"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_forward((x, xl), (w, wl), None, self.relu6)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (gx, gw, _) =
            linear_backward(x, w, None, &product_grad(self.relu6, y, g)?, x.track_op())?;
        Ok((gx, gw))
    }
}

impl CustomOp3 for LinearF32 {
    fn name(&self) -> &'static str {
        "tandem-linear-f32-bias"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_forward((x, xl), (w, wl), Some((b, bl)), self.relu6)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        linear_backward(x, w, Some(b), &product_grad(self.relu6, y, g)?, x.track_op())
    }
}

/// The gradients of the CPU f32 op (contiguous 2-d `x` and `w`) that made `y`, given the
/// output's `g`, with the input's always computed; the weight's and bias's as
/// [`take_param_grad`] leaves them (`None` when taken). `relu6`: `y` was clamped
/// ([`fused_linear_relu6`]).
pub(crate) fn grads(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    (y, g): (&Tensor, &Tensor),
    relu6: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let (gx, gw, gb) = linear_backward(x, w, b, &product_grad(relu6, y, g)?, true)?;
    let gx = gx.ok_or_else(|| candle_core::Error::Msg("linear: no input gradient".into()))?;
    Ok((gx, gw, gb))
}

/// The gradients of `x @ wᵀ + b` given the output's `g`: only operands in the autograd graph
/// get one, and the input only when `want_gx` (the first layer's data input needs none). Inside
/// [`crate::backward`] the weight's and bias's go to the store directly.
fn linear_backward(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    g: &Tensor,
    want_gx: bool,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (rows, k) = x.dims2()?;
    let (n, _) = w.dims2()?;
    let dev = x.device();
    let (gx, gw, gb) = with_f32_slice(g, |g| {
        let gv = View { data: g, rs: n, cs: 1 };
        let gx = if want_gx {
            // gx[rows, k] = g · w
            let gx =
                with_f32_slice(w, |w| product((rows, k, n), gv, View { data: w, rs: k, cs: 1 }))?;
            Some(Tensor::from_vec(gx, (rows, k), dev)?)
        } else {
            None
        };
        let gw = if w.track_op() {
            // gw[n, k] = gᵀ · x
            let gt = View { data: g, rs: 1, cs: n };
            let gw =
                with_f32_slice(x, |x| product((n, k, rows), gt, View { data: x, rs: k, cs: 1 }))?;
            Some(Tensor::from_vec(gw, (n, k), dev)?)
        } else {
            None
        };
        let gb = match b {
            Some(b) if b.track_op() => Some(Tensor::from_vec(column_sums(g, n), n, dev)?),
            _ => None,
        };
        Ok::<_, candle_core::Error>((gx, gw, gb))
    })??;
    let gb = match b {
        Some(b) => take_param_grad(b, gb)?,
        None => gb,
    };
    Ok((gx, take_param_grad(w, gw)?, gb))
}

/// A new row-major `[m, n]` matrix `a · b` on the blocked gemm.
fn product((m, n, k): (usize, usize, usize), a: View<'_>, b: View<'_>) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    matmul((m, n, k), &mut out, n, a, b, false, threads());
    out
}

/// `Σ_r g[r, j]` for each column `j`, rows added in order.
fn column_sums(g: &[f32], n: usize) -> Vec<f32> {
    let mut sums = vec![0f32; n];
    for row in g.chunks_exact(n) {
        sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
    sums
}

/// `x @ wᵀ` for 2-d `x` and `w` on the CPU in dtypes other than f32 (candle's matmul).
struct LinearNoBias;

impl CustomOp2 for LinearNoBias {
    fn name(&self) -> &'static str {
        "tandem-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n, k) = forward_shapes(xl, wl)?;
        // wᵀ is a view of w with swapped strides; candle's gemm reads it in place.
        let out = x.matmul(w, (1, rows, n, k), xl, &wl.transpose(0, 1)?)?;
        Ok((out, Shape::from((rows, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached so the backward builds no graph of its own.
        let gx = if x.track_op() { Some(g.matmul(&w.detach())?) } else { None };
        let gw = if w.track_op() { Some(g.t()?.matmul(&x.detach())?) } else { None };
        Ok((gx, gw))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::{fused_linear, fused_linear_relu6};

    /// The fused ReLU6 gives `relu6(fused_linear(..))`'s output and all three gradients bit
    /// for bit, inside tandem's backward too, on values that cross both kinks.
    #[test]
    fn linear_relu6_is_the_two_ops_bit_for_bit() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (2, 5, 24), &dev).unwrap())).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (40, 24), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(2f32, 2.0, 40, &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (2, 5, 40), &dev).unwrap();
        let fused = fused_linear_relu6(&x, &w, Some(&b)).unwrap();
        let plain = crate::functional::relu6(&fused_linear(&x, &w, Some(&b)).unwrap()).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(&fused), bits(&plain));
        let out: Vec<f32> = fused.flatten_all().unwrap().to_vec1().unwrap();
        assert!(out.contains(&0.0) && out.contains(&6.0), "the probe crosses both kinks");
        for backward in
            [|l: &Tensor| crate::backward(l).unwrap(), |l: &Tensor| l.backward().unwrap()]
        {
            let g1 = backward(&(&fused * &probe).unwrap().sum_all().unwrap());
            let g2 = backward(&(&plain * &probe).unwrap().sum_all().unwrap());
            for v in [&x, &w, &b] {
                assert_eq!(bits(g1.get(v).unwrap()), bits(g2.get(v).unwrap()));
            }
        }
    }

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
    }

    /// Two layers (data → hidden → out) through `linear` and through candle's
    /// `matmul(w.t()) + b`: the same outputs and weight, bias and hidden-input gradients up to
    /// f32 rounding; the data input gets no gradient at all.
    #[test]
    fn values_and_gradients_match_candles_expression() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (9, 13), &dev).unwrap();
        let w1 = Var::randn(0f32, 0.3, (11, 13), &dev).unwrap();
        let b1 = Var::randn(0f32, 0.3, 11, &dev).unwrap();
        let w2 = Var::randn(0f32, 0.3, (4, 11), &dev).unwrap();
        let target = Tensor::randn(0f32, 1.0, (9, 4), &dev).unwrap();
        let ours = |x: &Tensor| {
            let h = fused_linear(x, &w1, Some(&b1)).unwrap().relu().unwrap();
            fused_linear(&h, &w2, None).unwrap()
        };
        let theirs = |x: &Tensor| {
            let h = x.matmul(&w1.t().unwrap()).unwrap().broadcast_add(&b1).unwrap().relu().unwrap();
            h.matmul(&w2.t().unwrap()).unwrap()
        };
        let (ya, yb) = (ours(&x), theirs(&x));
        // Not bit for bit: the forward hands gemm the transposed weight (see
        // `linear_forward`), whose products it sums in another order than candle's view.
        let d = max_rel_diff(&ya, &yb);
        assert!(d < 1e-6, "forward differs by {d}");
        let loss = |y: &Tensor| (y - &target).unwrap().sqr().unwrap().sum_all().unwrap();
        let (ga, gb) = (loss(&ya).backward().unwrap(), loss(&yb).backward().unwrap());
        for (name, v) in [("w1", w1.as_tensor()), ("b1", b1.as_tensor()), ("w2", w2.as_tensor())] {
            let (a, b) = (ga.get(v).unwrap(), gb.get(v).unwrap());
            assert_eq!(a.dims(), b.dims(), "{name}");
            assert!(a.is_contiguous(), "{name}: gradient should be contiguous");
            let d = max_rel_diff(a, b);
            assert!(d < 1e-5, "{name}: gradients differ by {d}");
        }
        assert!(ga.get(&x).is_none(), "data input got a gradient");
        assert!(gb.get(&x).is_some(), "candle's expression computes one (the waste avoided)");
    }

    /// At a size the blocked gemm splits over threads (and the bias starts the sum): values and
    /// all three gradients equal candle's `matmul(wᵀ) + b` within float noise, on 1 and 3
    /// threads alike.
    #[test]
    fn blocked_product_with_bias_matches_candle_on_any_thread_count() {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (96, 300), &dev).unwrap();
        let w = Var::randn(0f32, 0.1, (200, 300), &dev).unwrap();
        let b = Var::randn(0f32, 0.1, 200, &dev).unwrap();
        let r = Tensor::randn(0f32, 1.0, (96, 200), &dev).unwrap();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let y = fused_linear(&x, &w, Some(&b)).unwrap();
                let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let grads = [&x, &w, &b].map(|v| g.get(v).unwrap().clone());
                (y, grads)
            })
        };
        let (y1, g1) = run(1);
        let (y3, g3) = run(3);
        let reference = x.as_tensor().matmul(&w.t().unwrap()).unwrap().broadcast_add(&b).unwrap();
        assert!(max_rel_diff(&y1, &reference) < 1e-5);
        let gr = (&reference * &r).unwrap().sum_all().unwrap().backward().unwrap();
        for (i, v) in [&x, &w, &b].into_iter().enumerate() {
            assert!(max_rel_diff(&g1[i], gr.get(v).unwrap()) < 1e-4, "gradient {i}");
            let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&g1[i]), bits(&g3[i]), "gradient {i} depends on the thread count");
        }
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&y1), bits(&y3), "the output depends on the thread count");
    }

    #[test]
    fn leading_dimensions_are_kept_and_input_gradients_flow() {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (2, 3, 5), &dev).unwrap();
        let w = Var::randn(0f32, 1.0, (7, 5), &dev).unwrap();
        let y = fused_linear(&x, &w, None).unwrap();
        assert_eq!(y.dims(), &[2, 3, 7]);
        let reference = x.as_tensor().broadcast_matmul(&w.t().unwrap()).unwrap();
        assert!(max_rel_diff(&y, &reference) < 1e-6);
        let g = y.sum_all().unwrap().backward().unwrap();
        // d(sum(x @ wᵀ))/dx = ones @ w: every row equals w's column sums.
        let col_sums: Vec<f32> = w.as_tensor().sum(0).unwrap().to_vec1().unwrap();
        let gx: Vec<Vec<f32>> = g.get(&x).unwrap().reshape((6, 5)).unwrap().to_vec2().unwrap();
        for row in gx {
            for (a, b) in row.iter().zip(&col_sums) {
                assert!((a - b).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn mismatched_features_name_both_sizes() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 6), candle_core::DType::F32, &dev).unwrap();
        let w = Tensor::zeros((3, 5), candle_core::DType::F32, &dev).unwrap();
        let err = fused_linear(&x, &w, None).unwrap_err().to_string();
        assert!(err.contains("6 features") && err.contains("[3, 5]"), "{err}");
    }
}
