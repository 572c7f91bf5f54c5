//! Gradient-norm clipping, as `torch.nn.utils.clip_grad_norm_` (L2, `norm_type=2`): the total
//! norm is the L2 norm over every gradient present (call it after the DDP reduction, so every
//! rank sees the same averaged gradients and clips identically), and gradients are scaled by
//! `max_norm / (total_norm + 1e-6)` when that is below 1.
use candle_core::backprop::GradStore;
use candle_core::{DType, Var};

use crate::{OptimError, Part};

/// Clips the gradients of `params` in `grads` to a global L2 norm of at most `max_norm` and
/// returns the total norm before clipping. Parameters without a gradient are ignored. The norm
/// is accumulated in f64 whatever the gradient dtype.
pub fn clip_grad_norm(
    params: &[Var],
    grads: &mut GradStore,
    max_norm: f64,
) -> Result<f64, OptimError> {
    clip_grad_norm_over(params, grads, max_norm, Ok)
}

/// [`clip_grad_norm`] for gradients split over ranks (a sharded model's shards): `sum_over_ranks`
/// turns this rank's Σ g² into the sum over every rank's (an all-reduce), so every rank clips
/// by the same total norm, the norm of the whole gradient.
pub fn clip_grad_norm_over(
    params: &[Var],
    grads: &mut GradStore,
    max_norm: f64,
    sum_over_ranks: impl FnOnce(f64) -> Result<f64, Box<dyn std::error::Error + Send + Sync>>,
) -> Result<f64, OptimError> {
    if !(max_norm >= 0.0 && max_norm.is_finite()) {
        return Err(OptimError::InvalidMaxNorm(max_norm));
    }
    let on_device = device_sum_squares(params, grads)?;
    let local = match on_device.map_or_else(|| cpu_sum_squares(params, grads), |s| Ok(Some(s)))? {
        Some(sum_sq) => sum_sq,
        None => {
            let mut sum_sq = 0.0f64;
            for (index, p) in params.iter().enumerate() {
                let Some(g) = grads.get(p.as_tensor()) else { continue };
                let sq = g
                    .to_dtype(DType::F64)
                    .and_then(|g| g.sqr())
                    .and_then(|g| g.sum_all())
                    .and_then(|s| s.to_scalar::<f64>())
                    .map_err(|source| OptimError::Gradient { of: Part::Clipping, index, source })?;
                sum_sq += sq;
            }
            sum_sq
        }
    };
    let total = sum_over_ranks(local)
        .map_err(|source| OptimError::OverRanks { what: "clipping's gradient norm", source })?
        .sqrt();
    if !total.is_finite() {
        return Err(OptimError::NonFiniteNorm { norm: total });
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for (index, p) in params.iter().enumerate() {
            let Some(g) = grads.get(p.as_tensor()) else { continue };
            let scaled = g.affine(coef, 0.0).map_err(|source| OptimError::Gradient {
                of: Part::Clipping,
                index,
                source,
            })?;
            grads.insert(p.as_tensor(), scaled);
        }
    }
    Ok(total)
}

/// On a GPU (`cuda` builds, every gradient on one CUDA device in a float type): Σ g² over all
/// of them by tandem-cuda's kernels with one read-back, instead of one per parameter. `None`
/// where that does not apply (the CPU computes it per parameter, in f64, as before).
/// `Σ g²` in f64 over gradients that are all contiguous f32 on the CPU, read in place: the
/// tensor form converts each gradient to an f64 copy, squares it into another and sums that
/// (three passes and twice the gradients' bytes allocated, a third of the face recipe's
/// optimizer phase on the ViT). Each tensor is summed in chunks, each chunk in f64 lanes,
/// the chunks and tensors then in order: the same bits whatever the thread count. `None`
/// when any gradient is elsewhere or of another type.
fn cpu_sum_squares(params: &[Var], grads: &GradStore) -> Result<Option<f64>, OptimError> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let mut total = 0f64;
    for p in params {
        let Some(g) = grads.get(p.as_tensor()) else { continue };
        if !g.device().is_cpu() || g.dtype() != DType::F32 {
            return Ok(None);
        }
        let (storage, layout) = g.storage_and_layout();
        let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        else {
            return Ok(None);
        };
        let parts: Vec<f64> = v[a..b].par_chunks(CHUNK).map(squares_f64).collect();
        total += parts.iter().fold(0f64, |s, v| s + v);
    }
    Ok(Some(total))
}

tandem_nn::vectorized_kernel! {
    /// `Σ x²` in f64, in eight partial sums (element `i` into partial `i % 8`) added in order.
    fn squares_f64(v: &[f32]) -> f64 {
        let mut acc = [0f64; 8];
        let chunks = v.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            let c: &[f32; 8] = c.try_into().unwrap();
            acc = std::array::from_fn(|l| acc[l] + c[l] as f64 * c[l] as f64);
        }
        for (l, x) in rest.iter().enumerate() {
            acc[l] += *x as f64 * *x as f64;
        }
        acc.iter().fold(0f64, |s, v| s + v)
    }
}

#[cfg(feature = "cuda")]
fn device_sum_squares(params: &[Var], grads: &GradStore) -> Result<Option<f64>, OptimError> {
    let present: Vec<&candle_core::Tensor> =
        params.iter().filter_map(|p| grads.get(p.as_tensor())).collect();
    let Some(first) = present.first() else { return Ok(None) };
    let float =
        |t: &candle_core::Tensor| matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let same = |t: &&candle_core::Tensor| t.device().same_device(first.device()) && float(t);
    if !first.device().is_cuda() || !present.iter().all(same) {
        return Ok(None);
    }
    let candle = |source| OptimError::Gradient { of: Part::Clipping, index: 0, source };
    let sum = tandem_cuda::reduce::sum_squares(&present).map_err(candle)?;
    let v = sum.to_vec1::<f64>().map_err(candle)?;
    Ok(v.first().copied())
}

#[cfg(not(feature = "cuda"))]
fn device_sum_squares(_: &[Var], _: &GradStore) -> Result<Option<f64>, OptimError> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// The in-place CPU sum equals the exact sum of squares (remainders of the lanes and
    /// chunks included), does not depend on the thread count, and declines other dtypes.
    #[test]
    fn cpu_sum_of_squares_is_exact_enough_and_thread_independent() {
        let dev = Device::Cpu;
        let sizes = [1usize, 7, 8, 9, 70_001, 200_000];
        let params: Vec<Var> =
            sizes.iter().map(|&n| Var::zeros(n, candle_core::DType::F32, &dev).unwrap()).collect();
        let mut loss = Tensor::zeros((), candle_core::DType::F32, &dev).unwrap();
        let mut exact = 0f64;
        for (i, (p, &n)) in params.iter().zip(&sizes).enumerate() {
            let g: Vec<f32> = (0..n).map(|j| ((j * 31 + i) % 97) as f32 / 13.0 - 3.0).collect();
            exact += g.iter().map(|v| *v as f64 * *v as f64).sum::<f64>();
            let g = Tensor::from_vec(g, n, &dev).unwrap();
            loss = (loss + (p.as_tensor() * g).unwrap().sum_all().unwrap()).unwrap();
        }
        let grads = loss.backward().unwrap();
        let ours = super::cpu_sum_squares(&params, &grads).unwrap().unwrap();
        assert!((ours - exact).abs() <= 1e-12 * exact, "{ours} vs {exact}");
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let three = pool.install(|| super::cpu_sum_squares(&params, &grads)).unwrap().unwrap();
        assert_eq!(ours.to_bits(), three.to_bits());
        let f64_param = Var::zeros(4, candle_core::DType::F64, &dev).unwrap();
        let g = (f64_param.as_tensor() * 2.0).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(super::cpu_sum_squares(&[f64_param], &g).unwrap(), None);
    }
}
