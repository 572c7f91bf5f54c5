//! Uneven distributed evaluation: every sample is evaluated by exactly one rank (no padding
//! duplicates, unlike `DistributedSampler`), and the per-rank sums are all-reduced so the
//! accuracy equals single-process accuracy exactly.
use std::sync::Arc;

use candle_core::Device;
use tandem_comm::{ProcessGroup, ReduceOp};

use crate::loader::{Batch, BatchIter, LoaderOptions};
use crate::{DataError, Dataset};

/// This rank's evaluation indices: `rank, rank + R, rank + 2R, ...` below `len`. The shards of
/// all ranks partition `0..len`; their lengths differ by at most one.
pub fn eval_indices(len: usize, num_replicas: usize, rank: usize) -> Result<Vec<usize>, DataError> {
    if num_replicas == 0 {
        return Err(DataError::NoReplicas);
    }
    if rank >= num_replicas {
        return Err(DataError::InvalidRank { rank, num_replicas });
    }
    Ok((rank..len).step_by(num_replicas).collect())
}

/// Batches of this rank's evaluation shard, in index order.
pub fn eval_batches<D: Dataset + ?Sized + 'static>(
    dataset: Arc<D>,
    num_replicas: usize,
    rank: usize,
    options: &LoaderOptions,
    device: Device,
) -> Result<BatchIter<D>, DataError> {
    let indices = eval_indices(dataset.len(), num_replicas, rank)?;
    let options = LoaderOptions { drop_last: false, ..options.clone() };
    BatchIter::new(dataset, &indices, &options, device)
}

/// Sums a rank accumulates while evaluating; the counts stay integers so the reduced accuracy
/// is exact.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalMetrics {
    /// Sum (not mean) of the per-sample losses.
    pub loss_sum: f64,
    pub correct: i64,
    pub count: i64,
}

impl EvalMetrics {
    /// Adds one batch: `loss_sum` over its samples, how many were right, how many there were.
    pub fn add_batch(&mut self, loss_sum: f64, correct: i64, count: i64) {
        self.loss_sum += loss_sum;
        self.correct += correct;
        self.count += count;
    }

    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct as f64 / self.count as f64
        }
    }

    pub fn mean_loss(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.loss_sum / self.count as f64
        }
    }

    /// Element-wise sum, what the all-reduce computes across ranks.
    pub fn merge(&mut self, other: &EvalMetrics) {
        self.add_batch(other.loss_sum, other.correct, other.count);
    }
}

/// Sums `local` over the ranks of `pg` (two all-reduces: the f64 loss sum, then the i64 counts).
/// Every rank gets the totals.
pub fn all_reduce_metrics(
    pg: &ProcessGroup,
    local: &EvalMetrics,
) -> Result<EvalMetrics, DataError> {
    let mut loss = [local.loss_sum];
    pg.all_reduce(&mut loss, ReduceOp::Sum)?;
    let mut counts = [local.correct, local.count];
    pg.all_reduce(&mut counts, ReduceOp::Sum)?;
    Ok(EvalMetrics { loss_sum: loss[0], correct: counts[0], count: counts[1] })
}

/// Distributed evaluation: runs `step` on every batch of this rank's share of `dataset` (each
/// sample on exactly one rank) and returns the all-reduced totals, the same on every rank.
/// `step` returns (sum of the batch's per-sample losses, number of correct predictions).
/// Ranks with an empty share still join the all-reduce, so no rank waits forever.
pub fn evaluate<D, F>(
    pg: &ProcessGroup,
    dataset: Arc<D>,
    options: &LoaderOptions,
    device: Device,
    mut step: F,
) -> Result<EvalMetrics, DataError>
where
    D: Dataset + ?Sized + 'static,
    F: FnMut(&Batch) -> Result<(f64, i64), DataError>,
{
    let mut local = EvalMetrics::default();
    // A local failure must not leave the other ranks blocked in the all-reduce: they fail on the
    // collective timeout; this rank reports its own error.
    for batch in eval_batches(dataset, pg.size(), pg.rank(), options, device)? {
        let batch = batch?;
        let (loss_sum, correct) = step(&batch)?;
        local.add_batch(loss_sum, correct, batch.len() as i64);
    }
    all_reduce_metrics(pg, &local)
}
