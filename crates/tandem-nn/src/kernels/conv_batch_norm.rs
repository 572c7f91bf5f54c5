//! A convolution followed by a training-mode BatchNorm (and a ReLU when asked) as one custom
//! op — PyTorch's `ConvBn2d` / `ConvBnReLU2d` pair of modules, for training.
//!
//! Why: apart, the convolution's output is a tensor of candle's graph, and candle's backward
//! adds the BatchNorm's input gradient into a zeroed accumulator of that size before the
//! convolution reads it (a memset and an add over every such activation: ~5% of a CIFAR
//! ResNet-18 step). Here the op keeps the convolution's output itself and hands the
//! BatchNorm's input gradient straight to the convolution's backward. The kernels are the
//! two ops' own, in the same order, so the values are theirs bit for bit (up to the sign of a
//! zero gradient, which candle's `0 + g` turns positive).
use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::batch_norm::{affine_grad, backward_slices, batch_stats, inverse_std, normalize, Stats};
use super::conv2d::{self, ConvParams};
use crate::contiguous_f32;
use crate::kernels::with_f32_slice;

/// What the forward leaves for the backward and for the module's running statistics.
struct Saved {
    /// The convolution's output, `[N, C, H, W]` flat.
    z: Vec<f32>,
    dims: (usize, usize, usize),
    mean: Vec<f32>,
    var: Vec<f32>,
    invstd: Vec<f32>,
}

struct ConvBatchNorm {
    conv: ConvParams,
    eps: f64,
    relu: bool,
    /// Set by the forward; shared with [`conv_batch_norm_train`], which reads the statistics.
    saved: Arc<OnceLock<Saved>>,
}

impl CustomOp3 for ConvBatchNorm {
    fn name(&self) -> &'static str {
        "tandem-conv2d-batch-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (z, shape) = conv2d::forward_f32(self.conv, (xs, xl), (ws, wl))?;
        let &[n, c, h, w] = shape.dims() else { unreachable!("conv2d outputs [N, C, H, W]") };
        let params = contiguous_f32(ps, pl, "conv_batch_norm", "weight and bias")?;
        if params.len() != 2 * c {
            candle_core::bail!(
                "conv_batch_norm: {} BatchNorm weight and bias values for {c} channels",
                params.len()
            )
        }
        let dims = (n, c, h * w);
        let (mean, var, _) = batch_stats(&z, dims);
        let invstd = inverse_std(&var, self.eps);
        let (gamma, beta) = params.split_at(c);
        let y = normalize(&z, gamma, beta, (&mean, &invstd), (self.relu, None), (c, h * w));
        if self.saved.set(Saved { z, dims, mean, var, invstd }).is_err() {
            candle_core::bail!("conv_batch_norm: the op ran forward twice")
        }
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        params: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(saved) = self.saved.get() else {
            candle_core::bail!("conv_batch_norm: backward before forward")
        };
        let c = saved.dims.1;
        let p: Vec<f32> = params.to_vec1()?;
        let (gamma, beta) = p.split_at(c);
        let stats = Stats { mean: &saved.mean, invstd: &saved.invstd, gamma, beta };
        let gy = gy.contiguous()?;
        let (sums, gz) = with_f32_slice(&gy, |gy| {
            backward_slices(&saved.z, gy, &stats, self.relu, saved.dims, true)
        })?;
        let dev = x.device();
        let gz = gz.expect("asked for the input gradient");
        let gz = Tensor::from_vec(gz, gy.shape(), dev)?;
        let (gx, gw) = conv2d::backward(self.conv, x, w, &gz)?;
        Ok((gx, gw, affine_grad(params, &sums, &saved.invstd)?))
    }
}

/// `bn(conv2d(x, w))` in training mode (then `relu` when asked) on CPU f32 tensors, as one op:
/// the output, and the batch's per-channel mean and biased variance (for the running
/// statistics) with the element count.
pub fn conv_batch_norm_train(
    x: &Tensor,
    w: &Tensor,
    conv: ConvParams,
    (gamma, beta): (&Tensor, &Tensor),
    eps: f64,
    relu: bool,
) -> candle_core::Result<(Tensor, Vec<f32>, Vec<f32>, usize)> {
    let saved = Arc::new(OnceLock::new());
    let op = ConvBatchNorm { conv, eps, relu, saved: saved.clone() };
    let params = Tensor::cat(&[gamma, beta], 0)?;
    let y = x.contiguous()?.apply_op3(&w.contiguous()?, &params, op)?;
    let Some(s) = saved.get() else {
        candle_core::bail!("conv_batch_norm: the forward left no statistics")
    };
    Ok((y, s.mean.clone(), s.var.clone(), s.dims.0 * s.dims.2))
}
