//! [`ModelKind`]: the built-in architectures by name, one list that the `tandem` command line,
//! the ONNX exporter and the benchmarks share (an unknown name is an error listing the known
//! ones, never a fallback).
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::VitConfig;

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
    #[serde(rename = "iresnet18", alias = "r18")]
    IResNet18,
    #[serde(rename = "iresnet34", alias = "r34")]
    IResNet34,
    #[serde(rename = "iresnet50", alias = "r50")]
    IResNet50,
    #[serde(rename = "iresnet100", alias = "r100")]
    IResNet100,
    #[serde(rename = "iresnet200", alias = "r200")]
    IResNet200,
    /// arcface_torch's MobileFaceNet `mbf` ([`crate::MobileFaceNet::MBF`]).
    #[serde(rename = "mbf")]
    Mbf,
    /// arcface_torch's `mbf_large` ([`crate::MobileFaceNet::MBF_LARGE`]).
    #[serde(rename = "mbf_large")]
    MbfLarge,
    /// arcface_torch's Vision Transformers ([`crate::Vit`], [`VitConfig`]).
    #[serde(rename = "vit_t")]
    VitT,
    #[serde(rename = "vit_s")]
    VitS,
    #[serde(rename = "vit_b")]
    VitB,
    #[serde(rename = "vit_l", alias = "vit_l_dp005_mask_005")]
    VitL,
    /// arcface_torch's WebFace42M variants: the same networks with other regularisation.
    #[serde(rename = "vit_t_dp005_mask0")]
    VitTDp005Mask0,
    #[serde(rename = "vit_s_dp005_mask_0")]
    VitSDp005Mask0,
    #[serde(rename = "vit_b_dp005_mask_005")]
    VitBDp005Mask005,
    #[serde(rename = "vit_h")]
    VitH,
}

impl ModelKind {
    pub const ALL: [ModelKind; 18] = [
        ModelKind::Mlp,
        ModelKind::Cnn,
        ModelKind::ResNet18,
        ModelKind::IResNet18,
        ModelKind::IResNet34,
        ModelKind::IResNet50,
        ModelKind::IResNet100,
        ModelKind::IResNet200,
        ModelKind::Mbf,
        ModelKind::MbfLarge,
        ModelKind::VitT,
        ModelKind::VitS,
        ModelKind::VitB,
        ModelKind::VitL,
        ModelKind::VitTDp005Mask0,
        ModelKind::VitSDp005Mask0,
        ModelKind::VitBDp005Mask005,
        ModelKind::VitH,
    ];

    /// Every architecture's name, in [`ModelKind::ALL`]'s order.
    pub const NAMES: [&'static str; 18] = [
        "mlp",
        "cnn",
        "resnet18",
        "iresnet18",
        "iresnet34",
        "iresnet50",
        "iresnet100",
        "iresnet200",
        "mbf",
        "mbf_large",
        "vit_t",
        "vit_s",
        "vit_b",
        "vit_l",
        "vit_t_dp005_mask0",
        "vit_s_dp005_mask_0",
        "vit_b_dp005_mask_005",
        "vit_h",
    ];

    /// arcface_torch's other names for its networks (`get_model("r50")`), accepted wherever a
    /// model is named: each `r*` is the IResNet of that depth (at arcface_torch's width 64, the
    /// default `--width`); `vit_l_dp005_mask_005` is `vit_l`.
    pub const ARCFACE_ALIASES: [(&'static str, ModelKind); 6] = [
        ("r18", ModelKind::IResNet18),
        ("r34", ModelKind::IResNet34),
        ("r50", ModelKind::IResNet50),
        ("r100", ModelKind::IResNet100),
        ("r200", ModelKind::IResNet200),
        ("vit_l_dp005_mask_005", ModelKind::VitL),
    ];

    /// Every name that parses: [`ModelKind::NAMES`], then the arcface_torch aliases.
    pub const PARSED_NAMES: [&'static str; 24] = [
        "mlp",
        "cnn",
        "resnet18",
        "iresnet18",
        "iresnet34",
        "iresnet50",
        "iresnet100",
        "iresnet200",
        "mbf",
        "mbf_large",
        "vit_t",
        "vit_s",
        "vit_b",
        "vit_l",
        "vit_t_dp005_mask0",
        "vit_s_dp005_mask_0",
        "vit_b_dp005_mask_005",
        "vit_h",
        "r18",
        "r34",
        "r50",
        "r100",
        "r200",
        "vit_l_dp005_mask_005",
    ];

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
            ModelKind::IResNet200 => "iresnet200",
            ModelKind::Mbf => "mbf",
            ModelKind::MbfLarge => "mbf_large",
            ModelKind::VitT => "vit_t",
            ModelKind::VitS => "vit_s",
            ModelKind::VitB => "vit_b",
            ModelKind::VitL => "vit_l",
            ModelKind::VitTDp005Mask0 => "vit_t_dp005_mask0",
            ModelKind::VitSDp005Mask0 => "vit_s_dp005_mask_0",
            ModelKind::VitBDp005Mask005 => "vit_b_dp005_mask_005",
            ModelKind::VitH => "vit_h",
        }
    }

    /// The depth of an IResNet (18, 34, 50, 100 or 200); `None` for the other models.
    pub fn iresnet_depth(self) -> Option<usize> {
        match self {
            ModelKind::IResNet18 => Some(18),
            ModelKind::IResNet34 => Some(34),
            ModelKind::IResNet50 => Some(50),
            ModelKind::IResNet100 => Some(100),
            ModelKind::IResNet200 => Some(200),
            _ => None,
        }
    }

    /// MobileFaceNet's `(blocks, scale)` for `mbf` and `mbf_large`; `None` for the others.
    pub fn mobilefacenet(self) -> Option<([usize; 4], usize)> {
        match self {
            ModelKind::Mbf => Some(crate::MobileFaceNet::MBF),
            ModelKind::MbfLarge => Some(crate::MobileFaceNet::MBF_LARGE),
            _ => None,
        }
    }

    /// arcface_torch's ViT (`get_model(name)`'s arguments) for the `vit_*` names; `None` for the
    /// others. Each block trains as one autograd node ([`VitConfig::fused`]): the face
    /// backbones train through tandem's backward, which the checkpointed sizes need anyway.
    pub fn vit(self) -> Option<VitConfig> {
        let cfg = match self {
            ModelKind::VitT => Some(VitConfig::VIT_T),
            ModelKind::VitS => Some(VitConfig::VIT_S),
            ModelKind::VitB => Some(VitConfig::VIT_B),
            ModelKind::VitL => Some(VitConfig::VIT_L),
            ModelKind::VitTDp005Mask0 => Some(VitConfig::new(256, 12, 0.05, 0.0)),
            ModelKind::VitSDp005Mask0 => Some(VitConfig::new(512, 12, 0.05, 0.0)),
            ModelKind::VitBDp005Mask005 => Some(VitConfig::new(512, 24, 0.05, 0.05).checkpointed()),
            ModelKind::VitH => Some(VitConfig::new(1024, 48, 0.1, 0.0).checkpointed()),
            _ => None,
        };
        cfg.map(VitConfig::fused)
    }

    /// Whether this is a face-recognition backbone (embeddings, trained with PartialFC) rather
    /// than a classifier.
    pub fn is_face(self) -> bool {
        self.iresnet_depth().is_some() || self.mobilefacenet().is_some() || self.vit().is_some()
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
    "unknown model `{0}` (known: mlp, cnn, resnet18, iresnet18, iresnet34, iresnet50, \
     iresnet100, iresnet200, mbf, mbf_large, vit_t, vit_s, vit_b, vit_l, vit_t_dp005_mask0, \
     vit_s_dp005_mask_0, vit_b_dp005_mask_005, vit_h, and arcface_torch's r18, r34, r50, r100, \
     r200, vit_l_dp005_mask_005)"
)]
pub struct UnknownModel(pub String);

impl FromStr for ModelKind {
    type Err = UnknownModel;
    fn from_str(s: &str) -> Result<Self, UnknownModel> {
        ModelKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .or_else(|| Self::ARCFACE_ALIASES.iter().find(|(a, _)| *a == s).map(|(_, k)| *k))
            .ok_or_else(|| UnknownModel(s.into()))
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
        for (alias, k) in ModelKind::ARCFACE_ALIASES {
            assert_eq!(alias.parse::<ModelKind>().unwrap(), k);
            let json = serde_json::to_string(alias).unwrap();
            assert_eq!(serde_json::from_str::<ModelKind>(&json).unwrap(), k, "serde alias {alias}");
        }
        let parsed: Vec<&str> = ModelKind::NAMES
            .into_iter()
            .chain(ModelKind::ARCFACE_ALIASES.map(|(a, _)| a))
            .collect();
        assert_eq!(parsed, ModelKind::PARSED_NAMES);
        assert!(ModelKind::Mbf.is_face() && ModelKind::IResNet200.is_face());
        assert!(ModelKind::VitT.is_face() && !ModelKind::ResNet18.is_face());
        assert_eq!(ModelKind::VitL.vit().unwrap().embed_dim, 768);
        assert_eq!(ModelKind::IResNet200.iresnet_depth(), Some(200));
    }
}
