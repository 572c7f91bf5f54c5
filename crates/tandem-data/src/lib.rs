//! tandem-data: DistributedSampler with torch-exact shard order (and a resumable position),
//! the `Dataset` trait, the prefetching `DataLoader` that collates into candle tensors,
//! uneven distributed evaluation, and the datasets (embedded UCI digits, MNIST IDX files,
//! synthetic). Knows nothing of models, optimizers or checkpoint files; it uses tandem-comm
//! only to all-reduce evaluation metrics.
mod dataset;
pub mod datasets;
mod error;
pub mod eval;
mod loader;
pub mod randperm;
mod sampler;

pub use dataset::{Dataset, Example, InMemoryDataset};
pub use error::DataError;
pub use eval::{all_reduce_metrics, eval_batches, eval_indices, evaluate, EvalMetrics};
pub use loader::{collate, Batch, BatchIter, DataLoader, EpochIter, LoaderOptions};
pub use randperm::torch_randperm;
pub use sampler::{num_samples, DistributedSampler, SamplerState};
