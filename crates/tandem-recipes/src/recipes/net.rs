//! The models `tandem train` can build, behind one type so the loop is written once.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use tandem_comm::Collectives;
use tandem_dist_nn::convert_sync_batchnorm;
use tandem_models::{Cnn, Mlp, ModelKind, ResNet};
use tandem_nn::{Autocast, NamedVars, OrderedVarMap, ParamModule, ParamSet};
use tandem_train::{bail_option, Result};

pub enum Net {
    Mlp(Mlp),
    Cnn(Cnn, Autocast),
    /// A stock-style candle-nn model on a VarMap: Ddp wraps its variables, not the model.
    ResNet18(Box<VarMapNet>),
}

pub struct VarMapNet {
    model: ResNet,
    vars: NamedVars,
    training: AtomicBool,
    autocast: Autocast,
}

/// What `Net::build` needs beyond the data's shape.
pub struct NetSpec {
    pub kind: ModelKind,
    pub hidden: usize,
    pub width: usize,
    pub seed: u64,
    /// What the layers compute in (mixed precision; the conv nets round their input and logits).
    pub compute_dtype: DType,
}

/// The `[channels, height, width]` of square images with one or three channels, from the
/// features per sample (64 -> 1x8x8 digits, 784 -> 1x28x28 MNIST, 3072 -> 3x32x32 CIFAR-10).
pub fn image_shape(input_dim: usize) -> Option<(usize, usize, usize)> {
    let square_side = |n: usize| {
        let side = (n as f64).sqrt().round() as usize;
        (side > 0 && side * side == n).then_some(side)
    };
    match (square_side(input_dim), square_side(input_dim / 3)) {
        (Some(side), _) => Some((1, side, side)),
        (None, Some(side)) if input_dim.is_multiple_of(3) => Some((3, side, side)),
        _ => None,
    }
}

impl Net {
    /// `input_dim` features per sample; the CNN needs square images, one channel or three
    /// (64 → 1x8x8 digits, 784 → 1x28x28 MNIST, 3072 → 3x32x32 CIFAR-10).
    ///
    /// On a CUDA device the model starts from the same values as on the CPU (built there, then
    /// copied), so a run's initial weights do not depend on the device.
    pub fn build(spec: &NetSpec, input_dim: usize, classes: usize, device: &Device) -> Result<Net> {
        let net = Self::build_on(spec, input_dim, classes, &Device::Cpu)?;
        if device.is_cpu() {
            return Ok(net);
        }
        let moved = Self::build_on(spec, input_dim, classes, device)?;
        moved.load_named_tensors(net.named_tensors())?;
        Ok(moved)
    }

    fn build_on(spec: &NetSpec, input_dim: usize, classes: usize, dev: &Device) -> Result<Net> {
        let NetSpec { kind, hidden, width, seed, compute_dtype } = *spec;
        Ok(match kind {
            ModelKind::ResNet18 => {
                if input_dim != 3 * 32 * 32 {
                    bail_option!(
                        "model",
                        Some("resnet18".into()),
                        "needs 3x32x32 images (CIFAR-10); this dataset has {input_dim} features \
                         per sample"
                    );
                }
                let vars = OrderedVarMap::new();
                let model =
                    ResNet::resnet18_cifar(width, classes, vars.var_builder(DType::F32, dev))?;
                ResNet::reset_parameters(&vars.named(), seed)?;
                Net::ResNet18(Box::new(VarMapNet {
                    model,
                    vars: vars.named_vars(),
                    training: AtomicBool::new(true),
                    autocast: Autocast::to(compute_dtype),
                }))
            }
            ModelKind::Mlp => Net::Mlp(
                Mlp::new(&[input_dim, hidden, classes], seed, dev)?
                    .with_compute_dtype(compute_dtype),
            ),
            ModelKind::Cnn => {
                let Some((channels, side, _)) = image_shape(input_dim) else {
                    bail_option!(
                        "model",
                        Some("cnn".into()),
                        "needs square images with 1 or 3 channels; this dataset has {input_dim} \
                         features per sample"
                    )
                };
                Net::Cnn(
                    Cnn::new(channels, side, side, classes, seed, dev)?,
                    Autocast::to(compute_dtype),
                )
            }
            face => bail_option!(
                "model",
                Some(face.to_string()),
                "a face backbone: it trains with a PartialFC head on face data (`rec:DIR`)"
            ),
        })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => m.forward(x),
            Net::Cnn(m, a) => a.apply(x, true, |x| m.forward(x)),
            Net::ResNet18(m) => {
                let train = m.training.load(Ordering::SeqCst);
                m.autocast.apply(x, true, |x| m.model.forward_t(x, train))
            }
        }
    }

    /// Mean cross-entropy over the batch.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(m) => m.loss(x, y),
            Net::Cnn(..) | Net::ResNet18(_) => {
                tandem_nn::functional::cross_entropy(&self.forward(x)?, y)
            }
        }
    }

    /// Switches BatchNorm between batch statistics (training) and running statistics (eval).
    pub fn set_training(&self, training: bool) {
        match self {
            Net::Cnn(m, _) => m.set_training(training),
            Net::ResNet18(m) => m.training.store(training, Ordering::SeqCst),
            Net::Mlp(_) => {}
        }
    }

    /// Makes every BatchNorm a SyncBatchNorm over `comm`; an error for models without the
    /// switch (only the ResNet has it).
    pub fn convert_sync_batchnorm(&self, comm: Arc<dyn Collectives>) -> Result<usize> {
        match self {
            Net::ResNet18(m) => Ok(convert_sync_batchnorm(&m.model, comm)),
            _ => bail_option!(
                "sync_batchnorm",
                None,
                "needs the resnet18 model (its BatchNorm layers can synchronise)"
            ),
        }
    }
}

impl ParamModule for Net {
    fn param_set(&self) -> &ParamSet {
        match self {
            Net::Mlp(m) => m.param_set(),
            Net::Cnn(m, _) => m.param_set(),
            Net::ResNet18(m) => m.vars.param_set(),
        }
    }

    fn named_buffers(&self) -> Vec<(String, candle_core::Var)> {
        match self {
            Net::Mlp(m) => m.named_buffers(),
            Net::Cnn(m, _) => m.named_buffers(),
            Net::ResNet18(m) => m.vars.named_buffers(),
        }
    }

    fn replicate(&self, device: &Device) -> tandem_nn::Result<Self> {
        Ok(match self {
            Net::Mlp(m) => Net::Mlp(m.replicate(device)?),
            Net::Cnn(m, a) => Net::Cnn(m.replicate(device)?, *a),
            Net::ResNet18(_) => {
                return Err(tandem_nn::NnError::InvalidOption {
                    what: "replicate",
                    why: "the ResNet is a VarMap model: build one per device instead".into(),
                })
            }
        })
    }
}
