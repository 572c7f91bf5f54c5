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
    /// `input_dim` features per sample; the CNN needs a square single-channel image
    /// (64 → 8x8 digits, 784 → 28x28 MNIST).
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
                let side = (input_dim as f64).sqrt().round() as usize;
                if side * side != input_dim {
                    anyhow::bail!("--model cnn needs square images; this dataset has {input_dim} features per sample");
                }
                Net::Cnn(Cnn::new(1, side, side, classes, seed, &dev)?)
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
