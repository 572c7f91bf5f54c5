//! PartialFC for candle (insightface's arcface_torch, `partial_fc_v2.py` and `losses.py`): the
//! classification head of face recognition, whose class centres are **split across the ranks**
//! (model parallel: millions of identities never fit one device) while the backbone is data
//! parallel under `Ddp`.
//!
//! Each step every rank all-gathers the embeddings (with gradient) and labels of the global
//! batch, scores them against its own centres (cosines of L2-normalised embeddings and centres),
//! applies the margin ([`CombinedMarginLoss`]: ArcFace, CosFace) and computes the softmax
//! cross-entropy over all ranks' classes without gathering the logits ([`dist_cross_entropy`]:
//! the global max, the global sum of exponentials and the target probability by all-reduce).
//! At `sample_rate < 1` only the positive centres and a random subset of negatives take part.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use candle_core::{Device, Tensor};
//! # use tandem_comm::Collectives;
//! # use tandem_partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};
//! # fn f(comm: Arc<dyn Collectives>, embeddings: Tensor, labels: Vec<i64>) -> Result<(), Box<dyn std::error::Error>> {
//! let margin = CombinedMarginLoss::arcface(64.0, 0.5);
//! let mut head = PartialFc::new(PartialFcConfig::new(93_431, 512, margin), comm, &Device::Cpu)?;
//! let loss = head.forward(&embeddings, &labels)?; // backbone embeddings [B, 512], labels in 0..C
//! let grads = loss.backward()?;                   // reaches the backbone and this rank's centres
//! # Ok(()) }
//! ```
//!
//! The centres ([`PartialFc::weight`]) are rank-local: they are not part of the `Ddp` model, so
//! nothing all-reduces them (`Ddp::backward_with_local` returns their gradients untouched beside
//! the model's averaged ones), and their optimizer state is per rank. One optimizer takes
//! backbone and head as two parameter groups (`tandem_optim::TorchSgd::with_groups`), as
//! arcface_torch does.
//!
//! At `sample_rate < 1` the centres that did not take part in a step get a zero gradient (the
//! sampled rows are selected with `index_select`, whose backward scatters into a dense gradient),
//! exactly as arcface_torch's `weight[index]`. The optimizer still updates those rows: with SGD
//! their momentum decays and keeps moving them (`v = 0.9 v + wd * w`, `w -= lr * v`) and weight
//! decay shrinks them; with Adam(W) their moments decay and the bias correction advances. The
//! state of every row is kept, sampled or not, so a row sampled later resumes from it.
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod margin;
mod partial_fc;
mod sample;
mod split;

pub use cross_entropy::dist_cross_entropy;
pub use error::PartialFcError;
pub use margin::CombinedMarginLoss;
pub use partial_fc::{PartialFc, PartialFcConfig, SHARD_FORMAT};
pub use sample::{DrawAhead, SampleRequest, Sampler, UniformNegatives};
pub use split::ClassSplit;
pub use tandem_dist_nn::GatherGrad;
