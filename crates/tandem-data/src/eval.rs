//! Uneven distributed evaluation: every sample is evaluated by exactly one rank (no padding
//! duplicates, unlike `DistributedSampler`), and the per-rank sums are all-reduced so the
//! accuracy equals single-process accuracy exactly.
use std::sync::Arc;

use candle_core::Device;

use crate::loader::{BatchIter, LoaderOptions};
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
pub fn eval_batches<D: Dataset + 'static>(
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
