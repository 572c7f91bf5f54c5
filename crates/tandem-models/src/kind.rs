//! [`ModelKind`]: the built-in architectures by name, one list that the `tandem` command line,
//! the ONNX exporter and the benchmarks share (an unknown name is an error listing the known
//! ones, never a fallback).
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A multi-layer perceptron ([`crate::Mlp`]).
    Mlp,
    /// A small convolutional net: conv-bn-relu-pool twice, then a linear layer ([`crate::Cnn`]).
    Cnn,
    /// ResNet-18 for CIFAR (torchvision names; 3x3 stem, no max-pool), a candle-nn model
    /// ([`crate::ResNet`]).
    #[serde(rename = "resnet18")]
    ResNet18,
    /// arcface_torch's face-recognition backbones ([`crate::IResNet`]), trained with a
    /// PartialFC head on 112x112 face images.
    #[serde(rename = "iresnet18")]
    IResNet18,
    #[serde(rename = "iresnet34")]
    IResNet34,
    #[serde(rename = "iresnet50")]
    IResNet50,
    #[serde(rename = "iresnet100")]
    IResNet100,
}

impl ModelKind {
    pub const ALL: [ModelKind; 7] = [
        ModelKind::Mlp,
        ModelKind::Cnn,
        ModelKind::ResNet18,
        ModelKind::IResNet18,
        ModelKind::IResNet34,
        ModelKind::IResNet50,
        ModelKind::IResNet100,
    ];

    /// Every architecture's name, in [`ModelKind::ALL`]'s order.
    pub const NAMES: [&'static str; 7] =
        ["mlp", "cnn", "resnet18", "iresnet18", "iresnet34", "iresnet50", "iresnet100"];

    /// The name the command line and file names use.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::ResNet18 => "resnet18",
            ModelKind::IResNet18 => "iresnet18",
            ModelKind::IResNet34 => "iresnet34",
            ModelKind::IResNet50 => "iresnet50",
            ModelKind::IResNet100 => "iresnet100",
        }
    }

    /// The depth of an IResNet (18, 34, 50 or 100); `None` for the classifiers.
    pub fn iresnet_depth(self) -> Option<usize> {
        match self {
            ModelKind::IResNet18 => Some(18),
            ModelKind::IResNet34 => Some(34),
            ModelKind::IResNet50 => Some(50),
            ModelKind::IResNet100 => Some(100),
            ModelKind::Mlp | ModelKind::Cnn | ModelKind::ResNet18 => None,
        }
    }

    /// Whether this is a face-recognition backbone (embeddings, trained with PartialFC) rather
    /// than a classifier.
    pub fn is_face(self) -> bool {
        self.iresnet_depth().is_some()
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a built-in model.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown model `{0}` (known: mlp, cnn, resnet18, iresnet18, iresnet34, iresnet50, iresnet100)"
)]
pub struct UnknownModel(pub String);

impl FromStr for ModelKind {
    type Err = UnknownModel;
    fn from_str(s: &str) -> Result<Self, UnknownModel> {
        ModelKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| UnknownModel(s.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for (k, name) in ModelKind::ALL.into_iter().zip(ModelKind::NAMES) {
            assert_eq!(k.name(), name);
            assert_eq!(k.name().parse::<ModelKind>().unwrap(), k);
        }
        let e = "resnet50".parse::<ModelKind>().unwrap_err().to_string();
        assert!(e.contains("resnet50") && e.contains("mlp, cnn, resnet18"), "{e}");
    }
}
