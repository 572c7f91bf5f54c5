//! [`FastLinear`]: candle-nn's `Linear` (same constructor arguments and variables: `weight`
//! `[out, in]`, `bias` `[out]`, same names and initialisation) whose forward and backward are
//! [`crate::functional::fused_linear`]: swap `candle_nn::linear` for `tandem::nn::fast_linear`
//! and nothing else changes. Named apart from candle-nn's so both can be imported.
use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use crate::functional::{fused_linear, fused_linear_relu6};

#[derive(Clone, Debug)]
pub struct FastLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl FastLinear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        FastLinear { weight, bias }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for FastLinear {
    /// Under [`crate::autocast`] on a GPU the input, weight and bias are cast to the 16-bit
    /// type first.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dev = x.device();
        if crate::autocast::compute_dtype(dev).is_some() {
            let cast = |t: &Tensor| crate::autocast::cast(t, dev);
            let bias = self.bias.as_ref().map(cast).transpose()?;
            return fused_linear(&cast(x)?, &cast(&self.weight)?, bias.as_ref());
        }
        fused_linear(x, &self.weight, self.bias.as_ref())
    }
}

impl FastLinear {
    /// `relu6(self.forward(x))`, as one op on CPU f32 ([`fused_linear_relu6`]).
    pub fn forward_relu6(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if crate::autocast::compute_dtype(x.device()).is_some() {
            return crate::functional::relu6(&self.forward(x)?);
        }
        fused_linear_relu6(x, &self.weight, self.bias.as_ref())
    }
}

/// `candle_nn::linear(in_dim, out_dim, vb)` as a [`FastLinear`] (the variables are candle-nn's).
pub fn fast_linear(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
) -> candle_core::Result<FastLinear> {
    let l = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(FastLinear::new(l.weight().clone(), l.bias().cloned()))
}

/// `candle_nn::linear_no_bias` as a [`FastLinear`].
pub fn fast_linear_no_bias(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
) -> candle_core::Result<FastLinear> {
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(FastLinear::new(l.weight().clone(), None))
}
