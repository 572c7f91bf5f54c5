//! [`FaceBackbone`]: the face-recognition backbone a [`ModelKind`] names (IResNet,
//! MobileFaceNet or ViT), built, initialised and run through one type, so the face recipe, evaluation
//! and export need not know which.
use candle_core::{Tensor, Var};
use candle_nn::{ModuleT, VarBuilder};
use tandem_nn::{FastBatchNorm2d, HasBatchNorm};

use crate::{IResNet, MobileFaceNet, ModelKind, UnitRunner, Vit};

pub enum FaceBackbone {
    IResNet(IResNet),
    MobileFaceNet(MobileFaceNet),
    /// Boxed: a ViT's blocks make it the largest by far.
    Vit(Box<Vit>),
}

impl FaceBackbone {
    /// The backbone `kind` names with an `embedding`-wide output; `width` is an IResNet's stage
    /// width (MobileFaceNet's widths are fixed by its scale), `dropout` an IResNet's before `fc`.
    pub fn new(
        kind: ModelKind,
        width: usize,
        embedding: usize,
        dropout: f32,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        if let Some(depth) = kind.iresnet_depth() {
            return Ok(FaceBackbone::IResNet(IResNet::new(depth, width, embedding, dropout, vb)?));
        }
        if let Some((blocks, scale)) = kind.mobilefacenet() {
            return Ok(FaceBackbone::MobileFaceNet(MobileFaceNet::new(
                blocks, scale, embedding, vb,
            )?));
        }
        if let Some(cfg) = kind.vit() {
            return Ok(FaceBackbone::Vit(Box::new(Vit::new(cfg, embedding, vb)?)));
        }
        candle_core::bail!("`{kind}` is not a face backbone")
    }

    /// arcface_torch's initialisation of `kind` from `seed` (see each model's
    /// `reset_parameters`).
    pub fn reset_parameters(
        kind: ModelKind,
        named: &[(String, Var)],
        seed: u64,
    ) -> candle_core::Result<()> {
        if kind.mobilefacenet().is_some() {
            MobileFaceNet::reset_parameters(named, seed)
        } else if kind.vit().is_some() {
            Vit::reset_parameters(named, seed)
        } else {
            IResNet::reset_parameters(named, seed)
        }
    }

    /// Parameters of `kind` that never train (IResNet's `features.weight`).
    pub fn frozen(kind: ModelKind) -> &'static [&'static str] {
        if kind.iresnet_depth().is_some() {
            IResNet::FROZEN
        } else {
            &[]
        }
    }

    /// Seeds what a training forward draws (a ViT's patch masks and stochastic depth; the
    /// convolutional backbones draw nothing, IResNet's dropout aside). Give each rank its own.
    pub fn seed(&self, seed: u64) {
        if let FaceBackbone::Vit(m) = self {
            m.seed(seed);
        }
    }

    /// Runs the backbone's blocks through `runner` (FSDP2's `fully_shard` per block: a ViT's
    /// blocks and head, an IResNet's residual blocks); false for a MobileFaceNet, which has no
    /// such units (shard it as one root).
    pub fn run_blocks_with(&mut self, runner: UnitRunner) -> bool {
        match self {
            FaceBackbone::IResNet(m) => m.run_blocks_with(runner),
            FaceBackbone::Vit(m) => m.run_blocks_with(runner),
            FaceBackbone::MobileFaceNet(_) => return false,
        }
        true
    }

    /// The unit of parameter `param` of a `kind` backbone running its blocks through a
    /// [`UnitRunner`] (`None`: the root's).
    pub fn unit_of(kind: ModelKind, param: &str) -> Option<String> {
        if kind.vit().is_some() {
            Vit::unit_of(param)
        } else if kind.iresnet_depth().is_some() {
            IResNet::unit_of(param)
        } else {
            None
        }
    }

    /// Embeddings `[N, E]` for `x: [N, 3, 112, 112]`.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        match self {
            FaceBackbone::IResNet(m) => m.forward_t(x, train),
            FaceBackbone::MobileFaceNet(m) => m.forward_t(x, train),
            FaceBackbone::Vit(m) => m.forward_t(x, train),
        }
    }

    /// The embedding width.
    pub fn embedding(&self) -> usize {
        match self {
            FaceBackbone::IResNet(m) => m.embedding(),
            FaceBackbone::MobileFaceNet(m) => m.embedding(),
            FaceBackbone::Vit(m) => m.embedding(),
        }
    }
}

impl ModuleT for FaceBackbone {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        FaceBackbone::forward_t(self, x, train)
    }
}

impl HasBatchNorm for FaceBackbone {
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d> {
        match self {
            FaceBackbone::IResNet(m) => m.batch_norms(),
            FaceBackbone::MobileFaceNet(m) => m.batch_norms(),
            FaceBackbone::Vit(m) => m.batch_norms(),
        }
    }
}
