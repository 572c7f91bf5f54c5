//! tandem-data: DistributedSampler with torch-exact shard order (and a resumable position),
//! the `Dataset` trait, the prefetching `DataLoader` that collates into candle tensors,
//! uneven distributed evaluation, and the datasets (embedded UCI digits, MNIST IDX files,
//! synthetic, insightface's RecordIO face sets and verification pairs). Knows nothing of models, optimizers or checkpoint files; it uses tandem-comm
//! only to all-reduce evaluation metrics.
//!
//! ```
//! use std::sync::Arc;
//! use tandem_data::{datasets, DataLoader, Dataset, DistributedSampler, LoaderOptions};
//!
//! let (train, _eval) = datasets::digits()?; // 1500 / 297 examples, 64 features, 10 classes
//! // Rank 1 of 4, shuffled like torch's DistributedSampler(seed=0).
//! let sampler = DistributedSampler::new(train.len(), 4, 1, true, 0, false)?;
//! let options = LoaderOptions { batch_size: 32, num_workers: 2, ..LoaderOptions::default() };
//! let mut loader = DataLoader::new(Arc::new(train), sampler, options, candle_core::Device::Cpu)?;
//! loader.set_epoch(0);
//! for batch in loader.iter()? {
//!     let batch = batch?; // batch.x: (B, 64) f32, batch.y: (B,) u32
//!     assert_eq!(batch.x.dims()[1], 64);
//! }
//! assert_eq!(loader.state().epoch, 1); // a finished epoch moves the position to the next one
//! # Ok::<(), tandem_data::DataError>(())
//! ```
mod dataset;
pub mod datasets;
mod error;
pub mod eval;
pub mod face_align;
mod loader;
mod position;
pub mod randperm;
pub mod recordio;
mod sampler;
pub mod transforms;

pub use dataset::{Dataset, Example, InMemoryDataset};
pub use error::DataError;
pub use eval::{all_reduce_metrics, eval_batches, eval_indices, evaluate, EvalMetrics};
pub use loader::{collate, Batch, BatchIter, DataLoader, EpochIter, LoaderOptions};
pub use position::{reshard_message, sampler_state_from_value, sampler_value, LoaderPosition};
pub use randperm::torch_randperm;
pub use sampler::{num_samples, DistributedSampler, SamplerBuilder, SamplerState};
pub use transforms::{channel_stats, CropFlip, ImageTransforms, Transformed};
