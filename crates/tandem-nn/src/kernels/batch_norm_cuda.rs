//! Training-mode BatchNorm (+ ReLU, + residual add and ReLU) as custom ops on a GPU: the CUDA
//! twins of [`super::batch_norm`]'s CPU ops, running tandem-cuda's kernels. Activations may be
//! f32, f16 or bf16 (mixed precision); γ, β, the statistics and their gradients are f32, as in
//! PyTorch's `cudnn_batch_norm`. The statistics stay on the device: nothing is read back.
use candle_core::{CudaStorage, CustomOp3, Layout, Shape, Tensor};

/// The batch's `[3, C]` statistics (mean, biased variance, invstd) on the device, and the
/// values per channel they came from.
pub struct DeviceStats {
    pub stats: Tensor,
    pub count: usize,
}

impl DeviceStats {
    /// The batch mean `[C]`.
    pub fn mean(&self) -> candle_core::Result<Tensor> {
        self.stats.get(0)
    }

    /// The biased batch variance `[C]`.
    pub fn var(&self) -> candle_core::Result<Tensor> {
        self.stats.get(1)
    }
}

/// BatchNorm then (when `relu`) ReLU: operands x, γ, β.
struct BatchNormTrainCuda {
    stats: Tensor,
    relu: bool,
}

impl CustomOp3 for BatchNormTrainCuda {
    fn name(&self) -> &'static str {
        "tandem-batch-norm-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("tandem-batch-norm-cuda runs on CUDA tensors only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
        bs: &CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let y = tandem_cuda::batch_norm::apply(
            (xs, xl),
            (gs, gl),
            (bs, bl),
            &self.stats,
            None,
            self.relu,
        )?;
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mask = self.relu.then_some(y);
        let gy = gy.to_dtype(x.dtype())?;
        let g = tandem_cuda::batch_norm::backward(
            x,
            &gy,
            mask,
            &self.stats,
            gamma,
            x.track_op(),
            false,
        )?;
        let ggamma = gamma.track_op().then(|| g.affine.get(0)).transpose()?;
        let gbeta = beta.track_op().then(|| g.affine.get(1)).transpose()?;
        Ok((g.x, ggamma, gbeta))
    }
}

/// `relu(BatchNorm(x) + residual)`: operands x, `cat(γ, β)`, the residual.
struct BatchNormAddReluCuda {
    stats: Tensor,
}

impl CustomOp3 for BatchNormAddReluCuda {
    fn name(&self) -> &'static str {
        "tandem-batch-norm-add-relu-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("tandem-batch-norm-add-relu-cuda runs on CUDA tensors only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ps: &CudaStorage,
        pl: &Layout,
        rs: &CudaStorage,
        rl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let c = pl.shape().elem_count() / 2;
        let (gl, bl) = (pl.narrow(0, 0, c)?, pl.narrow(0, c, c)?);
        let y = tandem_cuda::batch_norm::apply(
            (xs, xl),
            (ps, &gl),
            (ps, &bl),
            &self.stats,
            Some((rs, rl)),
            true,
        )?;
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        r: &Tensor,
        y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = params.elem_count() / 2;
        let gamma = params.narrow(0, 0, c)?;
        let gy = gy.to_dtype(x.dtype())?;
        let g = tandem_cuda::batch_norm::backward(
            x,
            &gy,
            Some(y),
            &self.stats,
            &gamma,
            x.track_op(),
            r.track_op(),
        )?;
        let gparams = params.track_op().then(|| g.affine.flatten_all()).transpose()?;
        Ok((g.x, gparams, g.residual))
    }
}

fn check(x: &Tensor, gamma: &Tensor) -> candle_core::Result<usize> {
    let (n, c, h, w) = x.dims4()?;
    if gamma.elem_count() != c {
        candle_core::bail!("batch_norm: {} weights for {c} channels", gamma.elem_count())
    }
    Ok(n * h * w)
}

/// Training BatchNorm (then ReLU when `relu`) of a CUDA `x: [N, C, H, W]`: the output and the
/// batch statistics for the running ones.
pub fn batch_norm_train_cuda(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    relu: bool,
) -> candle_core::Result<(Tensor, DeviceStats)> {
    let count = check(x, gamma)?;
    let x = x.contiguous()?;
    let stats = tandem_cuda::batch_norm::batch_stats(&x, eps)?;
    let op = BatchNormTrainCuda { stats: stats.clone(), relu };
    let y = x.apply_op3(&gamma.contiguous()?, &beta.contiguous()?, op)?;
    Ok((y, DeviceStats { stats, count }))
}

/// `relu(batch_norm_train(x) + residual)` on CUDA tensors (the residual in x's dtype).
pub fn batch_norm_train_add_relu_cuda(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    residual: &Tensor,
    eps: f64,
) -> candle_core::Result<(Tensor, DeviceStats)> {
    super::batch_norm::check_residual(x, residual)?;
    let count = check(x, gamma)?;
    let x = x.contiguous()?;
    let stats = tandem_cuda::batch_norm::batch_stats(&x, eps)?;
    let op = BatchNormAddReluCuda { stats: stats.clone() };
    let params = Tensor::cat(&[gamma, beta], 0)?;
    let residual = residual.to_dtype(x.dtype())?.contiguous()?;
    let y = x.apply_op3(&params, &residual, op)?;
    Ok((y, DeviceStats { stats, count }))
}
