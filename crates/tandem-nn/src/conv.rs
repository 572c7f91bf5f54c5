//! [`FastConv2d`]: candle-nn's `FastConv2d` (same constructor arguments and variables: `weight`,
//! `bias`, same names, shapes and initialisation) whose forward and backward run tandem's CPU
//! kernels ([`crate::kernels::conv2d`]): swap `candle_nn::conv2d` for `tandem::nn::fast_conv2d`
//! and nothing else changes. Grouped convolutions (depthwise included) run tandem's direct
//! grouped kernel on CPU and cuDNN on a GPU ([`crate::kernels::grouped_conv`]).
//! Named apart from candle-nn's so both can be imported.
use candle_core::{Module, Tensor};
use candle_nn::{Conv2dConfig, Init, VarBuilder};

use crate::autocast::cast;
use crate::kernels::conv2d::{add_channel_bias, conv2d as conv2d_kernel, conv2d_bias, ConvParams};
use crate::kernels::conv_batch_norm::Conv;
use crate::kernels::grouped_conv::{grouped_conv2d, GroupedConvParams};

#[derive(Clone, Debug)]
pub struct FastConv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: Conv2dConfig,
}

impl FastConv2d {
    pub fn new(weight: Tensor, bias: Option<Tensor>, config: Conv2dConfig) -> Self {
        FastConv2d { weight, bias, config }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Stride, padding and dilation for tandem's ungrouped kernels: `None` for a grouped
    /// convolution.
    pub fn kernel_params(&self) -> Option<ConvParams> {
        let c = self.config;
        (c.groups == 1).then_some(ConvParams {
            stride: c.stride,
            padding: c.padding,
            dilation: c.dilation,
        })
    }

    /// The CPU kernel this layer runs: tandem's ungrouped convolution or its grouped one (the
    /// layer's forward, and the fused convolution → BatchNorm op).
    pub(crate) fn kernel(&self) -> Conv {
        let c = self.config;
        match self.kernel_params() {
            Some(p) => Conv::Plain(p),
            None => Conv::Grouped(GroupedConvParams {
                stride: c.stride,
                padding: c.padding,
                dilation: c.dilation,
                groups: c.groups,
            }),
        }
    }
}

impl Module for FastConv2d {
    /// Under [`crate::autocast`] on a GPU the input, weight and bias are cast to the 16-bit
    /// type first (the cast is differentiable: the f32 weight gets its gradient).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dev = x.device();
        let (x, weight) = (cast(x, dev)?, cast(&self.weight, dev)?);
        let bias = self.bias.as_ref().map(|b| cast(b, dev)).transpose()?;
        match (self.kernel(), &bias) {
            (Conv::Plain(p), Some(b)) => conv2d_bias(&x, &weight, b, p),
            (Conv::Plain(p), None) => conv2d_kernel(&x, &weight, p),
            (Conv::Grouped(p), Some(b)) => add_channel_bias(&grouped_conv2d(&x, &weight, p)?, b),
            (Conv::Grouped(p), None) => grouped_conv2d(&x, &weight, p),
        }
    }
}

fn weight(
    cin: usize,
    cout: usize,
    k: usize,
    cfg: Conv2dConfig,
    vb: &VarBuilder,
) -> candle_core::Result<Tensor> {
    if cfg.groups == 0 || !cin.is_multiple_of(cfg.groups) {
        candle_core::bail!(
            "conv2d `{}`: {cin} input channels do not split into {} groups",
            vb.prefix(),
            cfg.groups
        )
    }
    vb.get_with_hints(
        (cout, cin / cfg.groups, k, k),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )
}

/// `candle_nn::conv2d`'s signature and variables (weight and bias).
pub fn fast_conv2d(
    cin: usize,
    cout: usize,
    k: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder,
) -> candle_core::Result<FastConv2d> {
    let w = weight(cin, cout, k, cfg, &vb)?;
    // candle-nn's bound (1/sqrt(in_channels)), so the layer is a drop-in.
    let bound = 1.0 / (cin as f64).sqrt();
    let b = vb.get_with_hints(cout, "bias", Init::Uniform { lo: -bound, up: bound })?;
    Ok(FastConv2d::new(w, Some(b), cfg))
}

/// `candle_nn::conv2d_no_bias`'s signature and variable.
pub fn fast_conv2d_no_bias(
    cin: usize,
    cout: usize,
    k: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder,
) -> candle_core::Result<FastConv2d> {
    Ok(FastConv2d::new(weight(cin, cout, k, cfg, &vb)?, None, cfg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::VarMap;

    /// Same variables as candle-nn's layer and the same values through either (grouped ones too).
    #[test]
    fn a_drop_in_for_candle_nn_conv2d() {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        for (groups, stride, padding) in [(1, 1, 1), (1, 2, 0), (2, 1, 1)] {
            let cfg = Conv2dConfig { stride, padding, groups, ..Default::default() };
            let name = format!("c{groups}{stride}{padding}");
            let ours = fast_conv2d(4, 6, 3, cfg, vb.pp(&name)).unwrap();
            let theirs = candle_nn::conv2d(4, 6, 3, cfg, vb.pp(&name)).unwrap();
            let x = Tensor::randn(0f32, 1.0, (2, 4, 7, 6), &Device::Cpu).unwrap();
            let (a, b) = (ours.forward(&x).unwrap(), theirs.forward(&x).unwrap());
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "groups {groups} stride {stride} padding {padding}: {d}");
        }
        let names: Vec<String> = {
            let mut v: Vec<String> = vm.data().lock().unwrap().keys().cloned().collect();
            v.sort();
            v
        };
        assert_eq!(names.len(), 6, "{names:?}: weight and bias per layer, shared with candle-nn's");
    }
}
