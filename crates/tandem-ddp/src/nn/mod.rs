//! Layers for stock-style candle models (built from a `VarBuilder`, used through candle-nn's
//! `Module`/`ModuleT`) that need something candle-nn does not have: a BatchNorm that can
//! synchronise its batch statistics across ranks (PyTorch's `SyncBatchNorm`), and the
//! differentiable all-reduce it is built on.
mod all_reduce;
mod batch_norm;

pub use all_reduce::all_reduce_sum;
pub use batch_norm::{batch_norm2d, convert_sync_batchnorm, BatchNorm2d, HasBatchNorm};
