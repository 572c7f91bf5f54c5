//! Exact distributed evaluation of a classifier, for a [`Recipe::evaluate`](crate::Recipe):
//! every sample once over the ranks (no sampler padding), the sums all-reduced.
use std::sync::Arc;

use candle_core::Device;
use tandem_comm::ProcessGroup;
use tandem_data::{Dataset, EvalMetrics, LoaderOptions};

use crate::Result;

/// Exact distributed evaluation of a classifier: every sample of `eval` once over the ranks of
/// `group`, `forward` giving the logits, the cross-entropy and correct counts all-reduced.
pub fn evaluate_logits<D: Dataset + 'static>(
    forward: impl Fn(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
    eval: &Arc<D>,
    group: &ProcessGroup,
    options: &LoaderOptions,
    device: &Device,
) -> Result<EvalMetrics> {
    let metrics = tandem_data::evaluate(group, Arc::clone(eval), options, device.clone(), |b| {
        let logits = forward(&b.x)?;
        let loss = tandem_nn::functional::cross_entropy(&logits, &b.y)?.to_scalar::<f32>()?;
        let pred = logits.argmax(1)?.to_vec1::<u32>()?;
        let correct = pred.iter().zip(&b.labels).filter(|(p, t)| p == t).count() as i64;
        Ok((loss as f64 * b.len() as f64, correct))
    })?;
    Ok(metrics)
}
