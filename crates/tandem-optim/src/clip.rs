//! Gradient-norm clipping, as `torch.nn.utils.clip_grad_norm_` (L2, `norm_type=2`): the total
//! norm is the L2 norm over every gradient present (call it after the DDP reduction, so every
//! rank sees the same averaged gradients and clips identically), and gradients are scaled by
//! `max_norm / (total_norm + 1e-6)` when that is below 1.
use candle_core::backprop::GradStore;
use candle_core::{DType, Var};

#[derive(Debug, thiserror::Error)]
pub enum ClipError {
    #[error("invalid max_norm {0}: must be a finite number >= 0")]
    InvalidMaxNorm(f64),
    /// torch's `error_if_nonfinite=True`: clipping by a NaN/inf norm would zero or poison every
    /// gradient, so the gradients are left untouched and the caller decides (skip the step).
    #[error("the total gradient norm is {norm} (non-finite); gradients were left unchanged")]
    NonFiniteNorm { norm: f64 },
    #[error("gradient of parameter {index}: {source}")]
    Candle {
        index: usize,
        #[source]
        source: candle_core::Error,
    },
}

/// Clips the gradients of `params` in `grads` to a global L2 norm of at most `max_norm` and
/// returns the total norm before clipping. Parameters without a gradient are ignored. The norm
/// is accumulated in f64 whatever the gradient dtype.
pub fn clip_grad_norm(
    params: &[Var],
    grads: &mut GradStore,
    max_norm: f64,
) -> Result<f64, ClipError> {
    if !(max_norm >= 0.0 && max_norm.is_finite()) {
        return Err(ClipError::InvalidMaxNorm(max_norm));
    }
    let mut sum_sq = 0.0f64;
    for (index, p) in params.iter().enumerate() {
        let Some(g) = grads.get(p.as_tensor()) else { continue };
        let sq = g
            .to_dtype(DType::F64)
            .and_then(|g| g.sqr())
            .and_then(|g| g.sum_all())
            .and_then(|s| s.to_scalar::<f64>())
            .map_err(|source| ClipError::Candle { index, source })?;
        sum_sq += sq;
    }
    let total = sum_sq.sqrt();
    if !total.is_finite() {
        return Err(ClipError::NonFiniteNorm { norm: total });
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for (index, p) in params.iter().enumerate() {
            let Some(g) = grads.get(p.as_tensor()) else { continue };
            let scaled =
                g.affine(coef, 0.0).map_err(|source| ClipError::Candle { index, source })?;
            grads.insert(p.as_tensor(), scaled);
        }
    }
    Ok(total)
}
