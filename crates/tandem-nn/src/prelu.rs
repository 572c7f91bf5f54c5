//! [`FastPRelu`]: PyTorch's `nn.PReLU(num_parameters)`, one learnable slope per channel (dim 1)
//! applied to negative inputs, `y = max(0, x) + a * min(0, x)`, initialised to 0.25, on the
//! fused kernel of [`crate::kernels::prelu`]; arcface_torch's IResNet uses it after every stem
//! and block BatchNorm.
use candle_core::{Module, Tensor};
use candle_nn::{Init, VarBuilder};

#[derive(Clone, Debug)]
pub struct FastPRelu {
    weight: Tensor,
}

/// `nn.PReLU(channels)`: its `weight` (`[channels]`, 0.25) under `vb`'s path.
pub fn fast_prelu(channels: usize, vb: VarBuilder) -> candle_core::Result<FastPRelu> {
    Ok(FastPRelu { weight: vb.get_with_hints(channels, "weight", Init::Const(0.25))? })
}

impl FastPRelu {
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl Module for FastPRelu {
    /// `x`: `[N, C, ...]` with `C` the slopes' count (or a single slope for any shape); one
    /// fused pass each way on CPU f32 tensors ([`crate::kernels::prelu`]).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        crate::kernels::prelu::prelu(x, &self.weight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};
    use candle_nn::VarMap;

    #[test]
    fn slopes_apply_per_channel_to_negative_inputs_with_both_gradients() {
        let vm = VarMap::new();
        let p = fast_prelu(2, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)).unwrap();
        let x = Var::new(&[[[[-2.0f32, 3.0]], [[-1.0, 0.5]]]], &Device::Cpu).unwrap(); // [1, 2, 1, 2]
        let y = p.forward(x.as_tensor()).unwrap();
        let got: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(got, [-0.5, 3.0, -0.25, 0.5]);
        let g = y.sum_all().unwrap().backward().unwrap();
        let gx: Vec<f32> = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(gx, [0.25, 1.0, 0.25, 1.0]);
        let gw: Vec<f32> = g.get(p.weight()).unwrap().to_vec1().unwrap();
        assert_eq!(gw, [-2.0, -1.0], "d/da = sum of the negative inputs per channel");
        let bad = Tensor::zeros((1, 3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(p.forward(&bad).unwrap_err().to_string().contains("2 slopes"));
    }
}
