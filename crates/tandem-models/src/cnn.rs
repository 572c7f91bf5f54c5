//! `Cnn`: a small convolutional classifier for 8x8 (sklearn digits) or 28x28 (MNIST) inputs,
//! laid out like this PyTorch module (same names, shapes and order, so state dicts move both ways):
//! ```text
//! conv1 = nn.Conv2d(C, 8, 3, padding=1); bn1 = nn.BatchNorm2d(8)
//! conv2 = nn.Conv2d(8, 16, 3, padding=1); fc = nn.Linear(16 * (H/4) * (W/4), classes)
//! forward: maxpool2(relu(bn1(conv1(x)))) -> maxpool2(relu(conv2(.))) -> flatten -> fc
//! ```
//! `bn1` has running statistics (buffers), which Ddp broadcasts from rank 0 each forward.
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device, Tensor, Var, D};
use rand::SeedableRng;

use tandem_nn::functional::{cross_entropy, fused_linear};
use tandem_nn::kernels::batch_norm::batch_norm_train_act;
use tandem_nn::kernels::conv2d::{conv2d_bias, ConvParams};
use tandem_nn::kernels::pool::max_pool2d;
use tandem_nn::kernels::relu::relu;
use tandem_nn::torch_init::{copy_vars, default_layer};
use tandem_nn::ParamModule;
use tandem_nn::ParamSet;
use tandem_nn::{NnError, Result};

const C1: usize = 8;
const C2: usize = 16;
const BN_EPS: f64 = 1e-5;
const BN_MOMENTUM: f64 = 0.1;

pub struct Cnn {
    in_chw: (usize, usize, usize),
    classes: usize,
    params: ParamSet,
    /// bn1.running_mean, bn1.running_var (f32) and bn1.num_batches_tracked (i64 scalar).
    buffers: Vec<(String, Var)>,
    training: AtomicBool,
}

// Parameter indices, in named_parameters() order.
const CONV1_W: usize = 0;
const CONV1_B: usize = 1;
const BN1_W: usize = 2;
const BN1_B: usize = 3;
const CONV2_W: usize = 4;
const CONV2_B: usize = 5;
const FC_W: usize = 6;
const FC_B: usize = 7;

impl Cnn {
    /// Input `[N, channels, height, width]`; height and width divisible by 4.
    pub fn new(
        channels: usize,
        height: usize,
        width: usize,
        classes: usize,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        if channels == 0
            || classes == 0
            || !height.is_multiple_of(4)
            || !width.is_multiple_of(4)
            || height == 0
            || width == 0
        {
            return Err(NnError::InvalidOption {
                what: "Cnn shape",
                why: format!("channels {channels}, {height}x{width}, classes {classes}: need >0 and H, W divisible by 4"),
            });
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (c1w, c1b) = default_layer(&mut rng, &[C1, channels, 3, 3], device)?;
        let (c2w, c2b) = default_layer(&mut rng, &[C2, C1, 3, 3], device)?;
        let flat = C2 * (height / 4) * (width / 4);
        let (fcw, fcb) = default_layer(&mut rng, &[classes, flat], device)?;
        let named = vec![
            ("conv1.weight".to_string(), c1w),
            ("conv1.bias".to_string(), c1b),
            ("bn1.weight".to_string(), Var::ones(C1, DType::F32, device)?),
            ("bn1.bias".to_string(), Var::zeros(C1, DType::F32, device)?),
            ("conv2.weight".to_string(), c2w),
            ("conv2.bias".to_string(), c2b),
            ("fc.weight".to_string(), fcw),
            ("fc.bias".to_string(), fcb),
        ];
        let buffers = vec![
            ("bn1.running_mean".to_string(), Var::zeros(C1, DType::F32, device)?),
            ("bn1.running_var".to_string(), Var::ones(C1, DType::F32, device)?),
            ("bn1.num_batches_tracked".to_string(), Var::from_tensor(&Tensor::new(0i64, device)?)?),
        ];
        Ok(Cnn {
            in_chw: (channels, height, width),
            classes,
            params: ParamSet::new(named),
            buffers,
            training: AtomicBool::new(true),
        })
    }

    /// Like `module.train()` / `module.eval()`: BatchNorm uses batch statistics (and updates the
    /// running ones) in training mode, the running ones in eval mode.
    pub fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::SeqCst);
    }

    /// relu(bn1(x)): one fused kernel in training mode.
    fn batch_norm_relu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (rm, rv, nbt) = (&self.buffers[0].1, &self.buffers[1].1, &self.buffers[2].1);
        let shape = (1, C1, 1, 1);
        let gamma = self.params.get(BN1_W)?;
        let beta = self.params.get(BN1_B)?;
        if !self.training.load(Ordering::SeqCst) {
            let mean = rm.as_tensor().reshape(shape)?;
            let std = (rv.as_tensor().reshape(shape)? + BN_EPS)?.sqrt()?;
            let xhat = x.broadcast_sub(&mean)?.broadcast_div(&std)?;
            return relu(
                &xhat
                    .broadcast_mul(&gamma.reshape(shape)?)?
                    .broadcast_add(&beta.reshape(shape)?)?,
            );
        }
        let (y, mean, var, count) = batch_norm_train_act(x, &gamma, &beta, BN_EPS, true)?;
        let count = count as f64;
        let unbiased = if count > 1.0 { count / (count - 1.0) } else { 1.0 };
        let dev = x.device();
        let (mean, var) = (Tensor::new(mean, dev)?, (Tensor::new(var, dev)? * unbiased)?);
        rm.set(&((rm.as_tensor() * (1.0 - BN_MOMENTUM))? + (mean * BN_MOMENTUM)?)?)?;
        rv.set(&((rv.as_tensor() * (1.0 - BN_MOMENTUM))? + (var * BN_MOMENTUM)?)?)?;
        nbt.set(&nbt.as_tensor().broadcast_add(&Tensor::new(1i64, nbt.device())?)?)?;
        Ok(y)
    }

    fn conv(&self, x: &Tensor, w: usize, b: usize) -> candle_core::Result<Tensor> {
        let p = ConvParams { stride: 1, padding: 1, dilation: 1 };
        conv2d_bias(x, &self.params.get(w)?, &self.params.get(b)?, p)
    }

    /// Logits `[N, classes]` for `x: [N, C, H, W]` (or `[N, C*H*W]`, reshaped).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (c, h, w) = self.in_chw;
        let x = if x.rank() == 4 { x.clone() } else { x.reshape((x.dim(0)?, c, h, w))? };
        let x = self.batch_norm_relu(&self.conv(&x, CONV1_W, CONV1_B)?)?;
        let x = max_pool_2x2(&x)?;
        let x = max_pool_2x2(&relu(&self.conv(&x, CONV2_W, CONV2_B)?)?)?;
        let x = x.flatten_from(1)?;
        fused_linear(&x, &self.params.get(FC_W)?, Some(&self.params.get(FC_B)?))
    }

    /// Mean cross-entropy, like `nn.CrossEntropyLoss()`.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.forward(x)?;
        debug_assert_eq!(logits.dim(D::Minus1).ok(), Some(self.classes));
        cross_entropy(&logits, y)
    }
}

/// 2x2 max pooling, stride 2 (the kernel keeps the argmax for backward).
fn max_pool_2x2(x: &Tensor) -> candle_core::Result<Tensor> {
    max_pool2d(x, 2, 2)
}

impl ParamModule for Cnn {
    fn param_set(&self) -> &ParamSet {
        &self.params
    }
    fn named_buffers(&self) -> Vec<(String, Var)> {
        self.buffers.clone()
    }
    fn replicate(&self, device: &Device) -> Result<Self> {
        Ok(Cnn {
            in_chw: self.in_chw,
            classes: self.classes,
            params: ParamSet::new(copy_vars(self.params.named(), device)?),
            buffers: copy_vars(&self.buffers, device)?,
            training: AtomicBool::new(self.training.load(Ordering::SeqCst)),
        })
    }
}
