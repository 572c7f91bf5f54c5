//! `fused_linear(x, w, b)`: `torch.nn.functional.linear`, i.e. `x @ wᵀ + b`, with a backward made
//! for training.
//!
//! Why not `x.matmul(&w.t())`: candle's autograd sends the weight gradient back through the
//! transpose as a strided `[out, in]` view and adds it element by element into a freshly zeroed
//! buffer — a weight-sized strided pass per layer per step, which on the bench MLP cost more
//! than the backward matmuls themselves. It also computes the input gradient of the first
//! layer, whose input is data and needs none. Here the product is one custom op whose backward
//! returns a contiguous weight gradient `gᵀ @ x` (one gemm with a transposed operand) and an
//! input gradient `g @ w` only when the input is part of the autograd graph. Values are the
//! same products as candle's matmul. Devices other than the CPU use the plain expression.
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

/// `x @ wᵀ (+ b)` for `x: [.., in]`, `w: [out, in]`, `b: [out]`, like PyTorch's
/// `F.linear`; leading dimensions of `x` are kept.
pub fn fused_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (out_features, in_features) = w.dims2()?;
    let x_dims = x.dims().to_vec();
    let Some((&last, lead)) = x_dims.split_last() else {
        candle_core::bail!("linear: input is a scalar; expected [.., {in_features}]")
    };
    if last != in_features {
        candle_core::bail!("linear: input has {last} features in its last dimension, the weight [{out_features}, {in_features}] expects {in_features}")
    }
    let rows: usize = lead.iter().product();
    let x2 = if x.rank() == 2 { x.clone() } else { x.reshape((rows, in_features))? };
    let y = if x.device().is_cpu() && w.device().is_cpu() {
        x2.apply_op2(w, LinearNoBias)?
    } else {
        x2.matmul(&w.t()?)?
    };
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    if x.rank() == 2 {
        Ok(y)
    } else {
        let mut out_dims = lead.to_vec();
        out_dims.push(out_features);
        y.reshape(out_dims)
    }
}

/// `x @ wᵀ` for 2-d `x` and `w` on the CPU (see the module docs).
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
        let (rows, k) = xl.shape().dims2()?;
        let (n, k_w) = wl.shape().dims2()?;
        if k != k_w {
            candle_core::bail!(
                "linear: input [{rows}, {k}] and weight [{n}, {k_w}] disagree on in_features"
            )
        }
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
        // Only operands in the autograd graph get a gradient: the first layer's data input
        // needs none. Detached so the backward builds no graph of its own.
        let gx = if x.track_op() { Some(g.matmul(&w.detach())?) } else { None };
        let gw = if w.track_op() { Some(g.t()?.matmul(&x.detach())?) } else { None };
        Ok((gx, gw))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::fused_linear;

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
    }

    /// Two layers (data → hidden → out) through `linear` and through candle's
    /// `matmul(w.t()) + b`: same outputs, same weight, bias and hidden-input gradients; the data
    /// input gets no gradient at all.
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
        assert_eq!(ya.to_vec2::<f32>().unwrap(), yb.to_vec2::<f32>().unwrap(), "forward differs");
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
