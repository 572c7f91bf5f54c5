//! tandem-models: reference models for training jobs and benchmarks, with PyTorch's parameter
//! names, layouts and default initialisation (seeded), and [`ModelKind`], the one list of
//! built-in architectures. `Mlp` and `Cnn` read their parameters through a
//! [`tandem_nn::ParamSet`] so Ddp can hook them; `ResNet` is a stock-style candle-nn model on a
//! `VarMap`, as are arcface_torch's face-recognition backbones `IResNet`, `MobileFaceNet` and `Vit`
//! ([`FaceBackbone`] runs any of them).
mod cnn;
mod face;
mod iresnet;
mod kind;
mod mlp;
mod mobilefacenet;
mod resnet;
mod unit_runner;
mod vit;

pub use cnn::Cnn;
pub use face::{FaceBackbone, SeededInit};
pub use iresnet::{IResNet, FACE_SIDE};
pub use kind::{ModelKind, UnknownModel};
pub use mlp::{targets, Mlp};
pub use mobilefacenet::MobileFaceNet;
pub use resnet::ResNet;
pub use unit_runner::UnitRunner;
pub use vit::{patch_embed, Vit, VitConfig, VIT_PATCHES};
