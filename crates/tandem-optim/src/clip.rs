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
    let local = match device_sum_squares(params, grads)? {
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
