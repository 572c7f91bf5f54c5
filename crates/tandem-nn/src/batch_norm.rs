//! `FastBatchNorm2d` for VarBuilder-built models, PyTorch's `nn.BatchNorm2d` with a switch that
//! makes it `nn.SyncBatchNorm`.
//!
//! Same variables and names as PyTorch (`weight`, `bias`, and the buffers `running_mean`,
//! `running_var`, `num_batches_tracked`, the last an i64 scalar), so state dicts move both ways
//! and Ddp recognises the buffers. Training mode normalises with the batch's mean and biased
//! variance and updates the running statistics with momentum 0.1 and the unbiased variance;
//! eval mode uses the running statistics.
//!
//! Synchronised (after tandem-dist-nn's `convert_sync_batchnorm`, or [`FastBatchNorm2d::set_sync`]
//! with any [`StatsReducer`]), training mode takes the mean and variance over the union of
//! every rank's batch: the per-channel sums and counts, then the sums of squared deviations, go
//! through a differentiable all-reduce, so backward reduces their gradients across ranks too,
//! as PyTorch's SyncBatchNorm does. Those are collectives on the main thread: give the layers a
//! group of their own (`group.new_group(&all_ranks)`) when the model is wrapped by a Ddp that
//! overlaps its bucket all-reduces with backward (a [`crate::ParamSet`] model), so the two
//! streams of collectives cannot interleave differently on different ranks. A VarMap model's
//! buckets are reduced after backward, so the Ddp group itself is safe there.
use std::sync::{Arc, RwLock};

use candle_core::{DType, Tensor, Var};
use candle_nn::{Init, Module, ModuleT, VarBuilder};

use crate::conv::FastConv2d;
use crate::kernels::batch_norm::{
    batch_norm_train, batch_norm_train_act, batch_norm_train_add_relu, batch_norm_train_prelu,
};
#[cfg(feature = "cuda")]
use crate::kernels::batch_norm_cuda::{batch_norm_train_add_relu_cuda, batch_norm_train_cuda};
use crate::kernels::conv_batch_norm::{conv_batch_norm_train, After};
use crate::kernels::relu::{add_relu, relu};
use crate::prelu::FastPRelu;

/// What a synchronised BatchNorm reduces its statistics with: a differentiable sum over the
/// ranks (forward sums every rank's tensor, backward sums the gradients the same way).
/// tandem-dist-nn's `CommStats` is one over a process group; tandem-nn knows no process groups.
pub trait StatsReducer: Send + Sync {
    /// `x` summed over the ranks; `what` names the caller in errors.
    fn all_reduce_sum(&self, x: &Tensor, what: &str) -> candle_core::Result<Tensor>;
}

const EPS: f64 = 1e-5;
const MOMENTUM: f64 = 0.1;

pub struct FastBatchNorm2d {
    /// Where the layer sits in the model (`layer1.0.bn1`), for error messages.
    path: String,
    weight: Tensor,
    bias: Tensor,
    running_mean: Var,
    running_var: Var,
    num_batches_tracked: Var,
    /// Added to the variance (PyTorch's `eps`; 1e-5 unless [`FastBatchNorm2d::with_eps`]).
    eps: f64,
    sync: RwLock<Option<Arc<dyn StatsReducer>>>,
}

/// `nn.BatchNorm2d(channels)` (eps 1e-5, momentum 0.1, affine, tracking running statistics),
/// its variables under `vb`'s path.
pub fn fast_batch_norm2d(channels: usize, vb: VarBuilder) -> candle_core::Result<FastBatchNorm2d> {
    let weight = vb.get_with_hints(channels, "weight", Init::Const(1.0))?;
    let bias = vb.get_with_hints(channels, "bias", Init::Const(0.0))?;
    let running_mean = vb.get_with_hints(channels, "running_mean", Init::Const(0.0))?;
    let running_var = vb.get_with_hints(channels, "running_var", Init::Const(1.0))?;
    let num_batches_tracked =
        vb.get_with_hints_dtype((), "num_batches_tracked", Init::Const(0.0), DType::I64)?;
    Ok(FastBatchNorm2d {
        path: vb.prefix(),
        weight,
        bias,
        running_mean: Var::from_tensor(&running_mean)?,
        running_var: Var::from_tensor(&running_var)?,
        num_batches_tracked: Var::from_tensor(&num_batches_tracked)?,
        eps: EPS,
        sync: RwLock::new(None),
    })
}

impl FastBatchNorm2d {
    /// The layer with another `eps` (PyTorch's `nn.BatchNorm1d(n, eps=2e-5)`).
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// The layer with its scale fixed (PyTorch's `bn.weight.requires_grad = False`): the
    /// forward reads `weight` without recording a gradient for it; loading a state dict still
    /// sets it. Keep the variable out of the optimizer and out of Ddp's gradient reduction
    /// ([`crate::NamedVars::freeze`]).
    pub fn with_frozen_weight(mut self) -> Self {
        self.weight = self.weight.detach();
        self
    }

    /// Synchronise batch statistics through `comm` (`Some`), or go back to this rank's batch
    /// alone (`None`).
    pub fn set_sync(&self, comm: Option<Arc<dyn StatsReducer>>) {
        *self.sync.write().unwrap_or_else(|p| p.into_inner()) = comm;
    }

    pub fn is_sync(&self) -> bool {
        self.sync.read().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    pub fn running_mean(&self) -> &Tensor {
        self.running_mean.as_tensor()
    }

    pub fn running_var(&self) -> &Tensor {
        self.running_var.as_tensor()
    }

    /// The training batches the statistics have seen (PyTorch's `num_batches_tracked`).
    pub fn num_batches_tracked(&self) -> &Tensor {
        self.num_batches_tracked.as_tensor()
    }

    /// `relu(self(x))`, fused into one kernel in training mode on the CPU (unsynchronised).
    pub fn forward_t_relu(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.takes_cuda_kernels(x, train) {
            self.check_input(x)?;
            let out = batch_norm_train_cuda(x, &self.weight, &self.bias, self.eps, true)?;
            return self.record_device_batch(out);
        }
        if self.takes_fused_kernels(x, train) {
            self.check_input(x)?;
            return self.record_batch(batch_norm_train_act(
                x,
                &self.weight,
                &self.bias,
                self.eps,
                true,
            )?);
        }
        relu(&self.forward_t(x, train)?)
    }

    /// `prelu(self(x))`, fused into one kernel in training mode on the CPU (unsynchronised, a
    /// slope per channel): the BatchNorm's output gets no zeroed gradient buffer in backward
    /// and the PReLU is not a pass of its own; the same values as the two modules apart.
    pub fn forward_t_prelu(
        &self,
        x: &Tensor,
        prelu: &FastPRelu,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        if self.takes_fused_kernels(x, train) && self.fuses(prelu)? {
            self.check_input(x)?;
            let affine = (&self.weight, &self.bias);
            return self.record_batch(batch_norm_train_prelu(x, affine, prelu.weight(), self.eps)?);
        }
        prelu.forward(&self.forward_t(x, train)?)
    }

    /// Whether `prelu` can run inside the fused kernels after this layer: a CPU f32 slope per
    /// channel (arcface_torch's `nn.PReLU(channels)`).
    fn fuses(&self, prelu: &FastPRelu) -> candle_core::Result<bool> {
        let a = prelu.weight();
        let channels = self.weight.dim(0)?;
        Ok(a.dims() == [channels] && a.device().is_cpu() && a.dtype() == DType::F32)
    }

    /// `self(conv(x))`: in training mode on the CPU (unsynchronised, the convolution without
    /// bias; grouped or not) one op, PyTorch's `ConvBn2d` — the convolution's output gets no zeroed
    /// gradient buffer in backward (see `kernels::conv_batch_norm`); the same values as the
    /// two modules apart.
    pub fn forward_conv_t(
        &self,
        conv: &FastConv2d,
        x: &Tensor,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        match self.fused_conv(conv, x, train, After::Nothing)? {
            Some(y) => Ok(y),
            None => self.forward_t(&conv.forward(x)?, train),
        }
    }

    /// `relu(self(conv(x)))`, fused as [`FastBatchNorm2d::forward_conv_t`] is (`ConvBnReLU2d`).
    pub fn forward_conv_t_relu(
        &self,
        conv: &FastConv2d,
        x: &Tensor,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        match self.fused_conv(conv, x, train, After::Relu)? {
            Some(y) => Ok(y),
            None => self.forward_t_relu(&conv.forward(x)?, train),
        }
    }

    /// `prelu(self(conv(x)))`, fused as [`FastBatchNorm2d::forward_conv_t`] is, the PReLU
    /// inside the same op (arcface_torch's conv → BatchNorm → PReLU blocks).
    pub fn forward_conv_t_prelu(
        &self,
        conv: &FastConv2d,
        x: &Tensor,
        prelu: &FastPRelu,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        if !self.fuses(prelu)? {
            return prelu.forward(&self.forward_conv_t(conv, x, train)?);
        }
        match self.fused_conv(conv, x, train, After::PRelu(prelu.weight()))? {
            Some(y) => Ok(y),
            None => self.forward_t_prelu(&conv.forward(x)?, prelu, train),
        }
    }

    /// The fused convolution + BatchNorm (+ ReLU or PReLU), or `None` where it does not apply.
    fn fused_conv(
        &self,
        conv: &FastConv2d,
        x: &Tensor,
        train: bool,
        after: After,
    ) -> candle_core::Result<Option<Tensor>> {
        let kernel = conv.bias().is_none().then(|| conv.kernel());
        let (Some(p), true) = (kernel, self.takes_fused_kernels(x, train)) else {
            return Ok(None);
        };
        if conv.weight().dim(0)? != self.weight.dim(0)? {
            candle_core::bail!(
                "FastBatchNorm2d `{}` expects {} channels, the convolution before it makes {}",
                self.path,
                self.weight.dim(0)?,
                conv.weight().dim(0)?
            )
        }
        let affine = (&self.weight, &self.bias);
        self.record_batch(conv_batch_norm_train(x, conv.weight(), p, affine, self.eps, after)?)
            .map(Some)
    }

    /// `relu(self(x) + residual)` — a residual block's tail — fused into one kernel in
    /// training mode on the CPU (unsynchronised): the same values as the three ops apart, one
    /// pass forward and no zeroed gradient buffer for the BatchNorm's output in backward.
    pub fn forward_t_add_relu(
        &self,
        x: &Tensor,
        residual: &Tensor,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.takes_cuda_kernels(x, train) && residual.device().same_device(x.device()) {
            self.check_input(x)?;
            let out =
                batch_norm_train_add_relu_cuda(x, &self.weight, &self.bias, residual, self.eps)?;
            return self.record_device_batch(out);
        }
        let residual_cpu_f32 = residual.device().is_cpu() && residual.dtype() == DType::F32;
        if self.takes_fused_kernels(x, train) && residual_cpu_f32 {
            self.check_input(x)?;
            let out = batch_norm_train_add_relu(x, &self.weight, &self.bias, residual, self.eps)?;
            return self.record_batch(out);
        }
        add_relu(&self.forward_t(x, train)?, residual)
    }

    /// Whether training on `x` takes tandem's fused CPU kernels: training mode, this
    /// process's statistics only (not synchronised), a CPU f32 `[N, C, H, W]` input.
    fn takes_fused_kernels(&self, x: &Tensor, train: bool) -> bool {
        train && !self.is_sync() && x.device().is_cpu() && x.dtype() == DType::F32 && x.rank() == 4
    }

    /// Whether training on `x` takes tandem-cuda's kernels: a `cuda` build, training mode,
    /// this process's statistics only, a float `[N, C, H, W]` input on a GPU (f16 and bf16
    /// too: mixed precision keeps γ, β and the statistics in f32).
    #[cfg(feature = "cuda")]
    fn takes_cuda_kernels(&self, x: &Tensor, train: bool) -> bool {
        train
            && !self.is_sync()
            && x.device().is_cuda()
            && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
            && x.rank() == 4
    }

    /// A CUDA kernel's output, its statistics (on the device) folded into the running ones.
    #[cfg(feature = "cuda")]
    fn record_device_batch(
        &self,
        (y, stats): (Tensor, crate::kernels::batch_norm_cuda::DeviceStats),
    ) -> candle_core::Result<Tensor> {
        self.update_running(&stats.mean()?, &stats.var()?, stats.count as f64)?;
        Ok(y)
    }

    /// A fused kernel's output, its batch mean and biased variance folded into the running
    /// statistics (`count` elements per channel).
    fn record_batch(
        &self,
        (y, mean, var, count): (Tensor, Vec<f32>, Vec<f32>, usize),
    ) -> candle_core::Result<Tensor> {
        let (mean, var) = (Tensor::new(mean, y.device())?, Tensor::new(var, y.device())?);
        self.update_running(&mean, &var, count as f64)?;
        Ok(y)
    }

    fn check_input(&self, x: &Tensor) -> candle_core::Result<()> {
        if x.rank() != 4 || x.dim(1)? != self.weight.dim(0)? {
            candle_core::bail!(
                "FastBatchNorm2d `{}` expects [N, {}, H, W], got {:?}",
                self.path,
                self.weight.dim(0)?,
                x.dims()
            )
        }
        Ok(())
    }

    fn forward_train(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.takes_cuda_kernels(x, true) {
            let out = batch_norm_train_cuda(x, &self.weight, &self.bias, self.eps, false)?;
            return self.record_device_batch(out);
        }
        if x.dtype() != DType::F32 {
            // A 16-bit input (mixed precision) where no kernel takes it: f32 statistics and
            // arithmetic, the output in the input's type.
            return self.forward_train(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
        }
        let (n, c, h, w) = x.dims4()?;
        let comm = self.sync.read().unwrap_or_else(|p| p.into_inner()).clone();
        if comm.is_none() && x.device().is_cpu() && x.dtype() == DType::F32 {
            // One process's statistics: the fused CPU kernel.
            return self.record_batch(batch_norm_train(x, &self.weight, &self.bias, self.eps)?);
        }
        let local_count = (n * h * w) as f64;
        let dims = (0, 2, 3);
        // Per-channel sums, then (synchronised) their all-rank totals.
        let sum = x.sum_keepdim(dims)?.flatten_all()?;
        let (sum, count) = match &comm {
            None => (sum, local_count),
            Some(comm) => {
                let with_count =
                    Tensor::cat(&[&sum, &Tensor::new(&[local_count as f32], x.device())?], 0)?;
                let what = format!("SyncBatchNorm `{}` batch mean", self.path);
                let total = comm.all_reduce_sum(&with_count, &what)?;
                let count = total.get(c)?.to_scalar::<f32>()? as f64;
                (total.narrow(0, 0, c)?, count)
            }
        };
        let mean = (sum / count)?;
        let centered = x.broadcast_sub(&mean.reshape((1, c, 1, 1))?)?;
        let squares = centered.sqr()?.sum_keepdim(dims)?.flatten_all()?;
        let squares = match &comm {
            None => squares,
            Some(comm) => {
                let what = format!("SyncBatchNorm `{}` batch variance", self.path);
                comm.all_reduce_sum(&squares, &what)?
            }
        };
        let var = (squares / count)?;
        self.update_running(&mean, &var, count)?;
        let scale = (self.weight.as_ref() / (var + self.eps)?.sqrt()?)?.reshape((1, c, 1, 1))?;
        centered.broadcast_mul(&scale)?.broadcast_add(&self.bias.reshape((1, c, 1, 1))?)
    }

    fn update_running(&self, mean: &Tensor, var: &Tensor, count: f64) -> candle_core::Result<()> {
        if crate::recomputing() {
            return Ok(()); // this step's forward already counted this batch
        }
        let unbiased = if count > 1.0 { count / (count - 1.0) } else { 1.0 };
        let blend = |running: &Var, batch: Tensor| -> candle_core::Result<()> {
            running.set(&((running.as_tensor() * (1.0 - MOMENTUM))? + (batch * MOMENTUM)?)?)
        };
        blend(&self.running_mean, mean.detach())?;
        blend(&self.running_var, (var.detach() * unbiased)?)?;
        let tracked = &self.num_batches_tracked;
        tracked.set(&(tracked.as_tensor() + Tensor::new(1i64, tracked.device())?)?)
    }

    fn forward_eval(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.dtype() != DType::F32 {
            return self.forward_eval(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype());
        }
        let c = x.dim(1)?;
        let mean = self.running_mean.as_detached_tensor().reshape((1, c, 1, 1))?;
        let std = (self.running_var.as_detached_tensor() + self.eps)?.sqrt()?;
        let scale = (self.weight.as_ref() / std)?.reshape((1, c, 1, 1))?;
        x.broadcast_sub(&mean)?
            .broadcast_mul(&scale)?
            .broadcast_add(&self.bias.reshape((1, c, 1, 1))?)
    }
}

impl ModuleT for FastBatchNorm2d {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.check_input(x)?;
        if train {
            self.forward_train(x)
        } else {
            self.forward_eval(x)
        }
    }
}

/// A model that can list its BatchNorm layers (for tandem-dist-nn's `convert_sync_batchnorm`).
pub trait HasBatchNorm {
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::VarMap;

    fn input(seed: u32, n: usize) -> Tensor {
        let data: Vec<f32> = (0..n * 3 * 2 * 2)
            .map(|i| ((i as u32 * 7919 + seed * 104729) % 97) as f32 / 13.0)
            .collect();
        Tensor::from_vec(data, (n, 3, 2, 2), &Device::Cpu).unwrap()
    }

    /// The gradients of `Σ y·ramp` (a ramp of 0.1 steps), by tandem's backward or candle's.
    fn weighted_sum_grads(y: &Tensor, tandem_backward: bool) -> candle_core::backprop::GradStore {
        let ramp = (Tensor::arange(0f32, y.elem_count() as f32, y.device()).unwrap() * 0.1)
            .unwrap()
            .reshape(y.shape())
            .unwrap();
        let loss = (y * ramp).unwrap().sum_all().unwrap();
        if tandem_backward {
            crate::backward(&loss).unwrap()
        } else {
            loss.backward().unwrap()
        }
    }

    /// The fused convolution + BatchNorm (+ ReLU) equals the two modules apart: outputs,
    /// running statistics and every gradient (input, conv weight, γ, β), for a Winograd
    /// convolution (3x3, 8 channels) and an im2col one (stride 2), through tandem's backward
    /// and candle's, and with an input outside the graph (the data) too.
    #[test]
    fn fused_conv_batch_norm_equals_the_two_modules() {
        let dev = Device::Cpu;
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (stride, relu, tandem_backward, x_in_graph, groups) in [
            (1, true, true, true, 1),
            (1, false, false, true, 1),
            (2, true, false, true, 1),
            (2, false, true, false, 1),
            // Depthwise, and two channels a group (tandem's grouped kernels).
            (1, false, true, true, 8),
            (2, true, false, true, 4),
        ] {
            let run = |fused: bool| {
                let vm = VarMap::new();
                let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
                let cfg =
                    candle_nn::Conv2dConfig { padding: 1, stride, groups, ..Default::default() };
                let conv = crate::fast_conv2d_no_bias(8, 8, 3, cfg, vb.pp("conv")).unwrap();
                let bn = fast_batch_norm2d(8, vb.pp("bn")).unwrap();
                let vars = vm.data().lock().unwrap().clone();
                let ramp = |n: usize, a: f32, b: f32| {
                    (0..n).map(|i| ((i * 37) % 11) as f32 * a + b).collect::<Vec<f32>>()
                };
                let w = ramp(576 / groups, 0.02, -0.1);
                vars["conv.weight"]
                    .set(&Tensor::from_vec(w, (8, 8 / groups, 3, 3), &dev).unwrap())
                    .unwrap();
                vars["bn.weight"].set(&Tensor::new(ramp(8, 0.2, 0.5), &dev).unwrap()).unwrap();
                vars["bn.bias"].set(&Tensor::new(ramp(8, 0.1, -0.4), &dev).unwrap()).unwrap();
                let x = Var::from_tensor(
                    &Tensor::from_vec(ramp(3 * 8 * 36, 0.3, -1.2), (3, 8, 6, 6), &dev).unwrap(),
                )
                .unwrap();
                let input = if x_in_graph { x.as_tensor().clone() } else { x.as_detached_tensor() };
                let y = match (fused, relu) {
                    (true, true) => bn.forward_conv_t_relu(&conv, &input, true),
                    (true, false) => bn.forward_conv_t(&conv, &input, true),
                    (false, true) => bn.forward_t_relu(&conv.forward(&input).unwrap(), true),
                    (false, false) => bn.forward_t(&conv.forward(&input).unwrap(), true),
                }
                .unwrap();
                let g = weighted_sum_grads(&y, tandem_backward);
                let mut out = vec![values(&y), values(bn.running_mean()), values(bn.running_var())];
                for name in ["conv.weight", "bn.weight", "bn.bias"] {
                    out.push(values(g.get(vars[name].as_tensor()).expect(name)));
                }
                match g.get(x.as_tensor()) {
                    Some(gx) => out.push(values(gx)),
                    None => assert!(!x_in_graph, "the input's gradient is missing"),
                }
                out
            };
            let (a, b) = (run(true), run(false));
            let case = format!(
                "stride {stride} relu {relu} tandem backward {tandem_backward} groups {groups}"
            );
            assert_eq!(a.len(), b.len(), "{case}");
            let names = ["y", "running_mean", "running_var", "gconv", "ggamma", "gbeta", "gx"];
            for ((p, q), name) in a.iter().zip(&b).zip(names) {
                assert_eq!(p, q, "{name}, {case}");
            }
            assert!(a[0].contains(&0.0) == relu, "clamped outputs only with the ReLU, {case}");
        }
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let conv = crate::fast_conv2d_no_bias(3, 4, 3, Default::default(), vb.pp("c")).unwrap();
        let bn = fast_batch_norm2d(3, vb.pp("bn")).unwrap();
        let err = bn.forward_conv_t(&conv, &input(1, 2), true).unwrap_err();
        assert!(err.to_string().contains("makes 4"), "{err}");
    }

    /// BatchNorm → PReLU fused (after a fused convolution, and alone) equals the modules
    /// apart: the output, the running statistics and every gradient (input, conv weight, γ,
    /// β, the slopes), through tandem's backward and candle's. (`==` on the values: only the
    /// sign of a zero gradient may differ, candle's `0 + g`.)
    #[test]
    fn fused_prelu_equals_the_modules_apart() {
        let dev = Device::Cpu;
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let ramp = |n: usize, a: f32, b: f32| {
            (0..n).map(|i| ((i * 37) % 11) as f32 * a + b).collect::<Vec<f32>>()
        };
        // (a convolution first, tandem's backward, the convolution's groups and side): 1x1
        // as arcface_torch's expand layers, 3x3 depthwise as its DepthWise blocks.
        for (with_conv, tandem_backward, groups, k) in [
            (true, true, 1, 1),
            (true, false, 1, 1),
            (true, true, 8, 3),
            (false, true, 1, 1),
            (false, false, 1, 1),
        ] {
            let run = |fused: bool| {
                let vm = VarMap::new();
                let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
                let padding = k / 2;
                let cfg = candle_nn::Conv2dConfig { padding, groups, ..Default::default() };
                let conv = crate::fast_conv2d_no_bias(8, 8, k, cfg, vb.pp("conv")).unwrap();
                let bn = fast_batch_norm2d(8, vb.pp("bn")).unwrap();
                let prelu = crate::fast_prelu(8, vb.pp("prelu")).unwrap();
                let vars = vm.data().lock().unwrap().clone();
                let w = ramp(64 / groups * k * k, 0.05, -0.2);
                vars["conv.weight"]
                    .set(&Tensor::from_vec(w, (8, 8 / groups, k, k), &dev).unwrap())
                    .unwrap();
                vars["bn.weight"].set(&Tensor::new(ramp(8, 0.2, 0.5), &dev).unwrap()).unwrap();
                vars["bn.bias"].set(&Tensor::new(ramp(8, 0.1, -0.4), &dev).unwrap()).unwrap();
                vars["prelu.weight"].set(&Tensor::new(ramp(8, 0.05, 0.1), &dev).unwrap()).unwrap();
                let x = Var::from_tensor(
                    &Tensor::from_vec(ramp(3 * 8 * 25, 0.3, -1.2), (3, 8, 5, 5), &dev).unwrap(),
                )
                .unwrap();
                let x_ = x.as_tensor();
                let y = match (fused, with_conv) {
                    (true, true) => bn.forward_conv_t_prelu(&conv, x_, &prelu, true),
                    (true, false) => bn.forward_t_prelu(x_, &prelu, true),
                    (false, true) => prelu.forward(&bn.forward_conv_t(&conv, x_, true).unwrap()),
                    (false, false) => prelu.forward(&bn.forward_t(x_, true).unwrap()),
                }
                .unwrap();
                let g = weighted_sum_grads(&y, tandem_backward);
                let mut out = vec![values(&y), values(bn.running_mean()), values(bn.running_var())];
                for name in ["bn.weight", "bn.bias", "prelu.weight"] {
                    out.push(values(g.get(vars[name].as_tensor()).expect(name)));
                }
                out.push(values(g.get(x_).expect("the input's gradient")));
                if with_conv {
                    out.push(values(g.get(vars["conv.weight"].as_tensor()).expect("conv")));
                }
                out
            };
            let (a, b) = (run(true), run(false));
            let case = format!(
                "with a conv {with_conv} ({k}x{k}, groups {groups}), tandem backward \
                 {tandem_backward}"
            );
            assert_eq!(a.len(), b.len(), "{case}");
            let names =
                ["y", "running_mean", "running_var", "ggamma", "gbeta", "gslope", "gx", "gw"];
            for ((p, q), name) in a.iter().zip(&b).zip(names) {
                assert_eq!(p, q, "{name}, {case}");
            }
            assert!(a[0].iter().any(|&v| v < 0.0), "negative outputs (the slopes at work), {case}");
            assert!(a[5].iter().all(|&v| v != 0.0), "every slope has a gradient, {case}");
        }
    }

    /// The fused residual tail `relu(bn(x) + r)` equals the BatchNorm then `add_relu` bit for
    /// bit: the output, the running statistics, and the gradients of x, r, γ and β (through
    /// `tandem_nn::backward` as the trainers call it, and through candle's own backward).
    #[test]
    fn fused_residual_tail_equals_batch_norm_then_add_relu() {
        let dev = Device::Cpu;
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let run = |fused: bool, tandem_backward: bool| {
            let vm = VarMap::new();
            let bn = fast_batch_norm2d(3, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
            let vars = vm.data().lock().unwrap().clone();
            vars["weight"].set(&Tensor::new(&[1.5f32, -0.7, 0.9], &dev).unwrap()).unwrap();
            vars["bias"].set(&Tensor::new(&[0.3f32, -0.2, 0.0], &dev).unwrap()).unwrap();
            let x =
                Var::from_tensor(&Tensor::cat(&[&input(1, 2), &input(2, 3)], 0).unwrap()).unwrap();
            let r = Var::from_tensor(&((input(4, 5) - 3.5).unwrap() * 0.5).unwrap()).unwrap();
            let y = if fused {
                bn.forward_t_add_relu(x.as_tensor(), r.as_tensor(), true).unwrap()
            } else {
                add_relu(&bn.forward_t(x.as_tensor(), true).unwrap(), r.as_tensor()).unwrap()
            };
            let g = weighted_sum_grads(&y, tandem_backward);
            let grad = |t: &Tensor| bits(g.get(t).expect("a gradient"));
            [
                bits(&y),
                grad(x.as_tensor()),
                grad(r.as_tensor()),
                grad(vars["weight"].as_tensor()),
                grad(vars["bias"].as_tensor()),
                bits(bn.running_mean()),
                bits(bn.running_var()),
            ]
        };
        for tandem_backward in [true, false] {
            let (a, b) = (run(true, tandem_backward), run(false, tandem_backward));
            for (i, name) in ["y", "gx", "gr", "gweight", "gbias", "running_mean", "running_var"]
                .iter()
                .enumerate()
            {
                assert_eq!(a[i], b[i], "{name} (tandem backward: {tandem_backward})");
            }
            let y: Vec<f32> = a[0].iter().map(|&v| f32::from_bits(v)).collect();
            assert!(y.contains(&0.0) && y.iter().any(|&v| v > 0.0), "some outputs are clamped");
        }
        let vm = VarMap::new();
        let bn = fast_batch_norm2d(3, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
        let err = bn.forward_t_add_relu(&input(1, 2), &input(1, 3), true).unwrap_err();
        assert!(err.to_string().contains("residual"), "{err}");
    }

    /// The fused BatchNorm+ReLU equals ReLU after the BatchNorm (itself checked against torch in
    /// tests/conv_torch.rs), values and gradients, and so does the ReLU kernel vs candle's.
    #[test]
    fn fused_relu_equals_relu_after_batch_norm() {
        let run = |fused: bool| {
            let vm = VarMap::new();
            let bn = fast_batch_norm2d(3, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))
                .unwrap();
            vm.data().lock().unwrap()["bias"]
                .set(&Tensor::new(&[0.3f32, -0.2, 0.0], &Device::Cpu).unwrap())
                .unwrap();
            let x =
                Var::from_tensor(&Tensor::cat(&[&input(1, 2), &input(2, 3)], 0).unwrap()).unwrap();
            let y = if fused {
                bn.forward_t_relu(x.as_tensor(), true).unwrap()
            } else {
                bn.forward_t(x.as_tensor(), true).unwrap().relu().unwrap()
            };
            let weights = Tensor::arange(0f32, y.elem_count() as f32, &Device::Cpu)
                .unwrap()
                .reshape(y.shape())
                .unwrap();
            let g = (y.clone() * weights).unwrap().sum_all().unwrap().backward().unwrap();
            let gw = g.get(&vm.data().lock().unwrap()["weight"]).unwrap().clone();
            (y, g.get(x.as_tensor()).unwrap().clone(), gw, bn.running_var().clone())
        };
        let (a, b) = (run(true), run(false));
        for (name, p, q) in [
            ("y", &a.0, &b.0),
            ("gx", &a.1, &b.1),
            ("gweight", &a.2, &b.2),
            ("running_var", &a.3, &b.3),
        ] {
            let d = (p - q).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "{name}: {d}");
        }
        assert!(
            a.0.flatten_all().unwrap().to_vec1::<f32>().unwrap().contains(&0.0),
            "some outputs are clamped"
        );
        let x = Var::from_tensor(&(input(3, 2) - 3.0).unwrap()).unwrap();
        let ours = crate::kernels::relu::relu(x.as_tensor()).unwrap();
        let theirs = x.as_tensor().relu().unwrap();
        assert_eq!(
            ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let r = Tensor::arange(0f32, 24.0, &Device::Cpu).unwrap().reshape((2, 3, 2, 2)).unwrap();
        let ga = (ours * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (theirs * &r).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(
            ga.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            gb.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
}
