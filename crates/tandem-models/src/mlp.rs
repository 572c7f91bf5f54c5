//! `Mlp`: Linear → ReLU → … → Linear, layers named `fc1`, `fc2`, … with weights `[out, in]` as
//! in `nn.Linear`, so state dicts move both ways with PyTorch's `fc1 = nn.Linear(in, H);
//! fc2 = nn.Linear(H, classes)` (`Mlp::new(&[in, H, classes])`). The bench's deeper model is
//! `Mlp::new(&[784, 1024, 1024, 10])` (fc1..fc3; PyTorch's `nn.Sequential` calls them 0, 2, 4).
use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;

use tandem_nn::functional::{cross_entropy, fused_linear};
use tandem_nn::kernels::relu::relu;
use tandem_nn::torch_init::{copy_vars, default_layer};
use tandem_nn::ParamModule;
use tandem_nn::ParamSet;
use tandem_nn::{NnError, Result};

pub struct Mlp {
    dims: Vec<usize>,
    params: ParamSet,
    /// The dtype the layers compute in (autocast); parameters stay float32.
    compute_dtype: DType,
}

impl Mlp {
    /// `dims = [in, hidden.., classes]`, at least two entries; PyTorch-default init from `seed`.
    pub fn new(dims: &[usize], seed: u64, device: &Device) -> Result<Self> {
        if dims.len() < 2 || dims.contains(&0) {
            return Err(NnError::InvalidOption {
                what: "Mlp dims",
                why: format!("{dims:?}: need [in, .., out], all > 0"),
            });
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut named = Vec::new();
        for (i, w) in dims.windows(2).enumerate() {
            let (weight, bias) = default_layer(&mut rng, &[w[1], w[0]], device)?;
            named.push((format!("fc{}.weight", i + 1), weight));
            named.push((format!("fc{}.bias", i + 1), bias));
        }
        Ok(Mlp { dims: dims.to_vec(), params: ParamSet::new(named), compute_dtype: DType::F32 })
    }

    /// Computes the layers in `dtype` (bf16 or f16) over the float32 parameters, as under
    /// `torch.autocast`: input, weights and biases are cast on every forward (the casts are
    /// differentiable, so gradients arrive in float32) and the logits come back as float32 for
    /// the loss.
    pub fn with_compute_dtype(mut self, dtype: DType) -> Self {
        self.compute_dtype = dtype;
        self
    }

    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Logits `[batch, classes]` for `x: [batch, in]` (other shapes are flattened from dim 1).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dt = self.compute_dtype;
        let mut h = if x.rank() == 2 { x.clone() } else { x.flatten_from(1)? };
        h = h.to_dtype(dt)?;
        let layers = self.dims.len() - 1;
        for l in 0..layers {
            let w = self.params.get(2 * l)?.to_dtype(dt)?;
            let b = self.params.get(2 * l + 1)?.to_dtype(dt)?;
            h = fused_linear(&h, &w, Some(&b))?;
            if l + 1 < layers {
                h = relu(&h)?;
            }
        }
        h.to_dtype(DType::F32)
    }

    /// Mean cross-entropy of `forward(x)` against class indices `y` (u32 or i64), like
    /// `nn.CrossEntropyLoss()`.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        cross_entropy(&self.forward(x)?, y)
    }
}

impl ParamModule for Mlp {
    fn param_set(&self) -> &ParamSet {
        &self.params
    }
    fn replicate(&self, device: &Device) -> Result<Self> {
        Ok(Mlp {
            dims: self.dims.clone(),
            params: ParamSet::new(copy_vars(self.params.named(), device)?),
            compute_dtype: self.compute_dtype,
        })
    }
}

/// Class-index targets in the dtype cross_entropy wants.
pub fn targets(labels: &[u32], device: &Device) -> candle_core::Result<Tensor> {
    Tensor::from_slice(labels, labels.len(), device)?.to_dtype(DType::U32)
}
