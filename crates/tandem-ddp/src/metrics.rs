//! A running-average meter and metrics averaged across ranks (gradient clipping is
//! `tandem_optim::clip_grad_norm`).
use tandem_comm::{CommError, ProcessGroup, ReduceOp};

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
    pub fn all_reduce(&self, pg: &ProcessGroup) -> Result<AverageMeter, CommError> {
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
pub fn all_reduce_mean(pg: &ProcessGroup, values: &mut [f64]) -> Result<(), CommError> {
    pg.all_reduce(values, ReduceOp::Avg)?;
    Ok(())
}
