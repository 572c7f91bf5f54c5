//! `cross_entropy(logits, targets)`: `F.cross_entropy` with class-index targets and mean
//! reduction, as one op on CPU f32 logits.
//!
//! candle-nn's `cross_entropy` is `log_softmax` then a gather and a mean: five ops, each a pass
//! over the logits with its own allocation and autograd node, and as many again backward. Here
//! the forward is one pass per row (max, log-sum-exp, the target's term) and the backward one
//! more (`(softmax − onehot) · g / N`), recomputing the softmax from the logits rather than
//! keeping it. Other dtypes and devices use candle-nn's.
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use crate::contiguous_f32;
use crate::kernels::with_f32_slice;

/// The mean over the batch of `−log softmax(logits)[target]`, for `logits: [N, C]` and
/// `targets: [N]` class indices (u32 or i64), like `torch.nn.functional.cross_entropy`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (n, c) = logits.dims2()?;
    if targets.dims() != [n] {
        candle_core::bail!(
            "cross_entropy: targets have shape {:?}, the logits [{n}, {c}] want [{n}]",
            targets.dims()
        )
    }
    if !(logits.device().is_cpu() && logits.dtype() == DType::F32) {
        return candle_nn::loss::cross_entropy(logits, targets);
    }
    let classes: Vec<u32> = targets.to_dtype(DType::U32)?.to_vec1()?;
    if let Some((row, &bad)) = classes.iter().enumerate().find(|(_, &t)| t as usize >= c) {
        candle_core::bail!("cross_entropy: target {bad} of row {row} is not a class of {c}")
    }
    logits.contiguous()?.apply_op1(CrossEntropy { targets: classes })
}

struct CrossEntropy {
    targets: Vec<u32>,
}

/// `(max, ln Σ exp(v − max))` of one row.
fn log_sum_exp(row: &[f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
    (max, sum.ln())
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "tandem-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, c) = l.shape().dims2()?;
        let logits = contiguous_f32(s, l, "cross_entropy", "logits")?;
        let total: f64 = logits
            .chunks_exact(c)
            .zip(&self.targets)
            .map(|(row, &t)| {
                let (max, lse) = log_sum_exp(row);
                (max + lse - row[t as usize]) as f64
            })
            .sum();
        let mean = if n == 0 { f32::NAN } else { (total / n as f64) as f32 };
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (n, c) = logits.dims2()?;
        let scale = g.to_dtype(DType::F32)?.to_scalar::<f32>()? / n as f32;
        let grad = with_f32_slice(logits, |logits| {
            let mut grad = vec![0f32; n * c];
            for ((row, out), &t) in
                logits.chunks_exact(c).zip(grad.chunks_exact_mut(c)).zip(&self.targets)
            {
                let (max, lse) = log_sum_exp(row);
                let shift = max + lse;
                out.iter_mut().zip(row).for_each(|(o, v)| *o = (v - shift).exp() * scale);
                out[t as usize] -= scale;
            }
            grad
        })?;
        Ok(Some(Tensor::from_vec(grad, (n, c), logits.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::cross_entropy;

    /// The loss and the logits' gradient equal candle-nn's `log_softmax` + NLL within float
    /// noise, including rows with large logits.
    #[test]
    fn loss_and_gradient_match_log_softmax_nll() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&(Tensor::randn(0f32, 3.0, (7, 5), &dev).unwrap())).unwrap();
        let big = Tensor::new(&[[90f32, -80.0, 85.0, 0.0, 1.0]], &dev).unwrap();
        let x = Var::from_tensor(&Tensor::cat(&[x.as_tensor(), &big], 0).unwrap()).unwrap();
        let y = Tensor::new(&[0u32, 4, 2, 2, 1, 3, 0, 2], &dev).unwrap();
        let ours = cross_entropy(x.as_tensor(), &y).unwrap();
        let theirs = candle_nn::loss::cross_entropy(x.as_tensor(), &y).unwrap();
        let (a, b) = (ours.to_scalar::<f32>().unwrap(), theirs.to_scalar::<f32>().unwrap());
        assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        let grad = |loss: Tensor| -> Vec<f32> {
            let g = (loss * 3.0).unwrap().backward().unwrap();
            g.get(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let (ga, gb) = (grad(ours), grad(theirs));
        for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
            assert!((a - b).abs() < 1e-6, "gradient {i}: {a} vs {b}");
        }
    }

    #[test]
    fn a_target_outside_the_classes_is_named() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 3), candle_core::DType::F32, &dev).unwrap();
        let y = Tensor::new(&[1u32, 3], &dev).unwrap();
        let err = cross_entropy(&x, &y).unwrap_err().to_string();
        assert!(err.contains("target 3 of row 1") && err.contains("3"), "{err}");
    }
}
