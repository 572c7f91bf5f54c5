//! Exact distributed evaluation of a classifier, for a [`Recipe::evaluate`](crate::Recipe):
//! every sample once over the ranks (no sampler padding), the sums all-reduced.
use std::sync::Arc;

use candle_core::Device;
use tandem_comm::ProcessGroup;
use tandem_data::{Dataset, EvalMetrics, LoaderOptions};

use crate::error::Result;

/// Exact distributed evaluation of a classifier: every sample of `eval` once over the ranks of
/// `group`, `forward` giving the logits, the cross-entropy and correct counts all-reduced.
pub fn evaluate_logits<D: Dataset + 'static>(
    forward: impl Fn(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
    eval: &Arc<D>,
    group: &ProcessGroup,
    options: &LoaderOptions,
    device: &Device,
) -> Result<EvalMetrics> {
    let mut local = EvalMetrics::default();
    let batches = tandem_data::eval_batches(
        Arc::clone(eval),
        group.size(),
        group.rank(),
        options,
        device.clone(),
    )?;
    for batch in batches {
        let batch = batch?;
        let logits = forward(&batch.x)?;
        let n = batch.len();
        let loss = tandem_nn::functional::cross_entropy(&logits, &batch.y)?.to_scalar::<f32>()?
            as f64
            * n as f64;
        let pred = logits.argmax(1)?.to_vec1::<u32>()?;
        let correct = pred.iter().zip(&batch.labels).filter(|(p, t)| p == t).count() as i64;
        local.add_batch(loss, correct, n as i64);
    }
    Ok(tandem_data::eval::all_reduce_metrics(group, &local)?)
}
