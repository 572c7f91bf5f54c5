//! Reference models for training jobs and benchmarks, with PyTorch's parameter names, layouts
//! and default initialisation (seeded). `Mlp` and `Cnn` read their parameters through
//! `ParamSet` so Ddp can hook them; `ResNet` is a stock-style candle-nn model on a VarMap.
mod cnn;
pub(crate) mod init;
mod mlp;
mod resnet;

pub use cnn::Cnn;
pub use mlp::{targets, Mlp};
pub use resnet::ResNet;
