//! Gradient-norm clipping, a running-average meter and metrics averaged across ranks.
//!
//! `clip_grad_norm` follows `torch.nn.utils.clip_grad_norm_` (L2, `norm_type=2`): the total
//! norm is the L2 norm over every gradient present (call it after the DDP reduction, so every
//! rank sees the same averaged gradients and clips identically), and gradients are scaled by
//! `max_norm / (total_norm + 1e-6)` when that is below 1.
use candle_core::backprop::GradStore;
use candle_core::{DType, Var};
use tandem_comm::{CommError, ProcessGroup, ReduceOp};

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
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
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Clips the gradients of `params` in `grads` to a global L2 norm of at most `max_norm` and
/// returns the total norm before clipping. Parameters without a gradient are ignored. The norm
/// is accumulated in f64 whatever the gradient dtype.
pub fn clip_grad_norm(
    params: &[Var],
    grads: &mut GradStore,
    max_norm: f64,
) -> Result<f64, MetricsError> {
    if !(max_norm >= 0.0 && max_norm.is_finite()) {
        return Err(MetricsError::InvalidMaxNorm(max_norm));
    }
    let mut sum_sq = 0.0f64;
    for (index, p) in params.iter().enumerate() {
        let Some(g) = grads.get(p.as_tensor()) else { continue };
        let sq = g
            .to_dtype(DType::F64)
            .and_then(|g| g.sqr())
            .and_then(|g| g.sum_all())
            .and_then(|s| s.to_scalar::<f64>())
            .map_err(|source| MetricsError::Candle { index, source })?;
        sum_sq += sq;
    }
    let total = sum_sq.sqrt();
    if !total.is_finite() {
        return Err(MetricsError::NonFiniteNorm { norm: total });
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for (index, p) in params.iter().enumerate() {
            let Some(g) = grads.get(p.as_tensor()) else { continue };
            let scaled =
                g.affine(coef, 0.0).map_err(|source| MetricsError::Candle { index, source })?;
            grads.insert(p.as_tensor(), scaled);
        }
    }
    Ok(total)
}

/// Running average of a scalar (the `AverageMeter` of the PyTorch ImageNet example):
/// `val` is the last value, `sum`/`count` accumulate `val * n` and `n`, `avg = sum / count`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AverageMeter {
    pub val: f64,
    pub avg: f64,
    pub sum: f64,
    pub count: f64,
}

impl AverageMeter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Records `val` as the mean of `n` samples.
    pub fn update(&mut self, val: f64, n: usize) {
        self.val = val;
        self.sum += val * n as f64;
        self.count += n as f64;
        self.avg = if self.count > 0.0 { self.sum / self.count } else { 0.0 };
    }

    /// This meter over all ranks: sums and counts are added across `pg` (so ranks with more
    /// samples weigh more, giving the true global average) and `val` is averaged. Every rank
    /// must call it (a collective).
    pub fn all_reduce(&self, pg: &ProcessGroup) -> Result<AverageMeter, MetricsError> {
        let mut totals = [self.sum, self.count];
        pg.all_reduce(&mut totals, ReduceOp::Sum)?;
        let mut val = [self.val];
        pg.all_reduce(&mut val, ReduceOp::Avg)?;
        let [sum, count] = totals;
        Ok(AverageMeter {
            val: val[0],
            sum,
            count,
            avg: if count > 0.0 { sum / count } else { 0.0 },
        })
    }
}

/// Replaces each value with its mean over all ranks of `pg` (a collective: every rank calls it
/// with the same number of values).
pub fn all_reduce_mean(pg: &ProcessGroup, values: &mut [f64]) -> Result<(), MetricsError> {
    pg.all_reduce(values, ReduceOp::Avg)?;
    Ok(())
}
