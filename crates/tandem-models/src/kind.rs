//! [`ModelKind`]: the built-in architectures by name, one list that the `tandem` command line,
//! the ONNX exporter and the benchmarks share (an unknown name is an error listing the known
//! ones, never a fallback).
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A multi-layer perceptron ([`crate::Mlp`]).
    Mlp,
    /// A small convolutional net: conv-bn-relu-pool twice, then a linear layer ([`crate::Cnn`]).
    Cnn,
    /// ResNet-18 for CIFAR (torchvision names; 3x3 stem, no max-pool), a candle-nn model
    /// ([`crate::ResNet`]).
    #[cfg_attr(feature = "clap", value(name = "resnet18"))]
    #[serde(rename = "resnet18")]
    ResNet18,
}

impl ModelKind {
    pub const ALL: [ModelKind; 3] = [ModelKind::Mlp, ModelKind::Cnn, ModelKind::ResNet18];

    /// The name the command line and file names use.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::ResNet18 => "resnet18",
        }
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a built-in model.
#[derive(Debug, thiserror::Error)]
#[error("unknown model `{0}` (known: mlp, cnn, resnet18)")]
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
        for k in ModelKind::ALL {
            assert_eq!(k.name().parse::<ModelKind>().unwrap(), k);
        }
        let e = "resnet50".parse::<ModelKind>().unwrap_err().to_string();
        assert!(e.contains("resnet50") && e.contains("mlp, cnn, resnet18"), "{e}");
    }
}
