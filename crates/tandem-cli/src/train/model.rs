//! The models `tandem train` can build, behind one type so the loop is written once.
use candle_core::{Device, Tensor};
use tandem_ddp::models::{Cnn, Mlp};
use tandem_ddp::module::ParamModule;
use tandem_ddp::params::ParamSet;

use super::config::ModelKind;

pub enum Net {
    Mlp(Mlp),
    Cnn(Cnn),
}

impl Net {
    /// `input_dim` features per sample; the CNN needs square images, one channel or three
    /// (64 → 1x8x8 digits, 784 → 1x28x28 MNIST, 3072 → 3x32x32 CIFAR-10).
    pub fn build(
        kind: ModelKind,
        input_dim: usize,
        hidden: usize,
        classes: usize,
        seed: u64,
    ) -> anyhow::Result<Net> {
        let dev = Device::Cpu;
        Ok(match kind {
            ModelKind::Mlp => Net::Mlp(Mlp::new(&[input_dim, hidden, classes], seed, &dev)?),
            ModelKind::Cnn => {
                let square_side = |n: usize| {
                    let side = (n as f64).sqrt().round() as usize;
                    (side * side == n).then_some(side)
                };
                let (channels, side) = match (square_side(input_dim), square_side(input_dim / 3)) {
                    (Some(side), _) => (1, side),
                    (None, Some(side)) if input_dim.is_multiple_of(3) => (3, side),
                    _ => anyhow::bail!(
                        "--model cnn needs square images with 1 or 3 channels; this dataset has \
                         {input_dim} features per sample"
                    ),
                };
                Net::Cnn(Cnn::new(channels, side, side, classes, seed, &dev)?)
            }
        })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => m.forward(x),
            Net::Cnn(m) => m.forward(x),
        }
    }

    /// Mean cross-entropy over the batch.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => m.loss(x, y),
            Net::Cnn(m) => m.loss(x, y),
        }
    }

    /// Switches BatchNorm between batch statistics (training) and running statistics (eval).
    pub fn set_training(&self, training: bool) {
        if let Net::Cnn(m) = self {
            m.set_training(training);
        }
    }
}

impl ParamModule for Net {
    fn params(&self) -> &ParamSet {
        match self {
            Net::Mlp(m) => m.params(),
            Net::Cnn(m) => m.params(),
        }
    }

    fn named_buffers(&self) -> Vec<(String, candle_core::Var)> {
        match self {
            Net::Mlp(m) => m.named_buffers(),
            Net::Cnn(m) => m.named_buffers(),
        }
    }

    fn replicate(&self, device: &Device) -> tandem_ddp::error::Result<Self> {
        Ok(match self {
            Net::Mlp(m) => Net::Mlp(m.replicate(device)?),
            Net::Cnn(m) => Net::Cnn(m.replicate(device)?),
        })
    }
}
