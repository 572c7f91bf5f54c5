//! Reference models for training jobs and benchmarks, with PyTorch's parameter names, layouts
//! and default initialisation (seeded), read through `ParamSet` so Ddp can hook them.
mod cnn;
pub(crate) mod init;
mod mlp;

pub use cnn::Cnn;
pub use mlp::{targets, Mlp};
