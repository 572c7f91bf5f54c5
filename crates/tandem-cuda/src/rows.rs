//! The face head's row-wise kernels on CUDA (kernels/rows.cu): L2 normalisation of rows, the
//! combined margin (ArcFace / CosFace, inter-class filtering), and the softmax cross-entropy
//! whose classes are split over ranks (PartialFC's), each forward and backward.
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::{CudaStorage, DType, Layout, Tensor};

use crate::batch_norm::Operand;
use crate::device::{
    alloc, cuda_device, device_of, function, launch, per_row, read, suffix, tensor, write, CudaRef,
    ROWS,
};
use crate::Result;

fn dims2(dims: &[usize], what: &str) -> Result<(usize, usize)> {
    match dims {
        &[n, k] => Ok((n, k)),
        _ => candle_core::bail!("{what}: expected [rows, columns], got {dims:?}"),
    }
}

/// `x / max(‖x‖, 1e-12)` per row of `x: [rows, features]` (`F.normalize(x, dim=1)`).
pub fn normalize(x: Operand<'_>) -> Result<CudaStorage> {
    let what = "normalize";
    let (n, f) = dims2(x.1.dims(), what)?;
    let dev = device_of(x.0);
    let stream = dev.cuda_stream();
    let xp = read(x.0, x.1, &stream, "normalize input")?;
    let mut y = alloc(&dev, xp.dtype, n * f)?;
    if n > 0 {
        let yp = write(&mut y, &Layout::contiguous(n * f), &stream, "normalize output")?;
        let func = function(&dev, &ROWS, &format!("normalize_fwd_{}", suffix(xp.dtype, what)?))?;
        // SAFETY: normalize_fwd(const T* x, T* y, size_t f): one block per row; x and y hold
        // n·f values.
        unsafe { launch!(func, per_row(n)?; xp.addr, yp.addr, f) }?;
    }
    Ok(y)
}

/// The gradient of [`normalize`]: `(g − y·(g·y)) / ‖x‖` per row (`g / eps` where the norm is
/// clamped).
pub fn normalize_backward(x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
    let what = "normalize backward";
    let (n, f) = dims2(x.dims(), what)?;
    let dev = cuda_device(x, what)?;
    let stream = dev.cuda_stream();
    let g = g.contiguous()?;
    let (xr, yr, gr) = (CudaRef::new(x, what)?, CudaRef::new(y, what)?, CudaRef::new(&g, what)?);
    let xp = read(xr.storage()?, xr.layout, &stream, "normalize input")?;
    let yp = read(yr.storage()?, yr.layout, &stream, "normalize output")?;
    let gp = read(gr.storage()?, gr.layout, &stream, "normalize output gradient")?;
    if yp.dtype != xp.dtype || gp.dtype != xp.dtype {
        candle_core::bail!("{what}: input, output and gradient dtypes differ")
    }
    let mut gx = alloc(&dev, xp.dtype, n * f)?;
    if n > 0 {
        let gxp = write(&mut gx, &Layout::contiguous(n * f), &stream, "input gradient")?;
        let func = function(&dev, &ROWS, &format!("normalize_bwd_{}", suffix(xp.dtype, what)?))?;
        // SAFETY: normalize_bwd(const T* x, const T* y, const T* g, T* gx, size_t f): one block
        // per row; all hold n·f values.
        unsafe { launch!(func, per_row(n)?; xp.addr, yp.addr, gp.addr, gxp.addr, f) }?;
    }
    Ok(tensor(gx, x.shape().clone()))
}

/// arcface_torch's CombinedMarginLoss constants (kernels/rows.cu's `Margin`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Margin {
    pub s: f32,
    /// ArcFace's angular margin (kind 0).
    pub m2: f32,
    /// CosFace's cosine margin (kind 1).
    pub m3: f32,
    /// Inter-class filtering threshold (0: off).
    pub threshold: f32,
    /// 0 ArcFace, 1 CosFace.
    pub kind: i32,
}

// SAFETY: a plain C struct of f32 and i32 fields, laid out as the kernels' `Margin`.
unsafe impl DeviceRepr for Margin {}

/// Checks labels: one i64 per row, on the device.
fn labels_ptr<'a>(
    labels: &'a CudaRef<'a>,
    stream: &'a candle_core::cuda::cudarc::driver::CudaStream,
    n: usize,
) -> Result<crate::device::Ptr<'a>> {
    let p = read(labels.storage()?, labels.layout, stream, "labels")?;
    if p.dtype != DType::I64 || labels.layout.shape().elem_count() != n {
        candle_core::bail!("margin / cross-entropy: labels must be {n} i64 values")
    }
    Ok(p)
}

/// `s·margin(x)` of f32 logits `x: [n, k]` already clamped to [−1, 1], `labels` this rank's
/// column of each row's class (−1: not here).
pub fn margin(x: Operand<'_>, labels: &Tensor, m: Margin) -> Result<CudaStorage> {
    let what = "margin";
    let (n, k) = dims2(x.1.dims(), what)?;
    let dev = device_of(x.0);
    let stream = dev.cuda_stream();
    let xp = read(x.0, x.1, &stream, "logits")?;
    if xp.dtype != DType::F32 {
        candle_core::bail!("{what}: logits must be f32")
    }
    let lr = CudaRef::new(labels, what)?;
    let lp = labels_ptr(&lr, &stream, n)?;
    let mut out = alloc(&dev, DType::F32, n * k)?;
    if n > 0 {
        let op = write(&mut out, &Layout::contiguous(n * k), &stream, "margin output")?;
        let f = function(&dev, &ROWS, "margin_fwd")?;
        // SAFETY: margin_fwd(const float* x, const long long* labels, float* out, size_t k,
        // Margin m): one block per row; x and out hold n·k values, labels n.
        unsafe { launch!(f, per_row(n)?; xp.addr, lp.addr, op.addr, k, m) }?;
    }
    Ok(out)
}

/// The gradient of [`margin`]: `s·g`, zero where inter-class filtering dropped the logit.
pub fn margin_backward(x: &Tensor, labels: &Tensor, g: &Tensor, m: Margin) -> Result<Tensor> {
    let what = "margin backward";
    let (n, k) = dims2(x.dims(), what)?;
    let dev = cuda_device(x, what)?;
    let stream = dev.cuda_stream();
    let g = g.contiguous()?;
    let (xr, gr, lr) =
        (CudaRef::new(x, what)?, CudaRef::new(&g, what)?, CudaRef::new(labels, what)?);
    let xp = read(xr.storage()?, xr.layout, &stream, "logits")?;
    let gp = read(gr.storage()?, gr.layout, &stream, "output gradient")?;
    let lp = labels_ptr(&lr, &stream, n)?;
    let mut gx = alloc(&dev, DType::F32, n * k)?;
    if n > 0 {
        let gxp = write(&mut gx, &Layout::contiguous(n * k), &stream, "logits gradient")?;
        let f = function(&dev, &ROWS, "margin_bwd")?;
        // SAFETY: margin_bwd(const float* x, const long long* labels, const float* g,
        // float* gx, size_t k, Margin m): one block per row; x, g, gx hold n·k values, labels n.
        unsafe { launch!(f, per_row(n)?; xp.addr, lp.addr, gp.addr, gxp.addr, k, m) }?;
    }
    Ok(tensor(gx, (n, k)))
}

/// How the cross-entropy's per-row values become the world's: the maximum and the sum of a
/// `[n]` f32 device vector over every rank holding a share of the classes. A world of one
/// returns them as they are ([`OneRank`]).
pub trait RowReduce {
    fn max(&mut self, v: Tensor) -> Result<Tensor>;
    fn sum(&mut self, v: Tensor) -> Result<Tensor>;
}

/// The classes are all here: nothing to combine.
pub struct OneRank;

impl RowReduce for OneRank {
    fn max(&mut self, v: Tensor) -> Result<Tensor> {
        Ok(v)
    }
    fn sum(&mut self, v: Tensor) -> Result<Tensor> {
        Ok(v)
    }
}

/// The forward of the split softmax cross-entropy: the mean loss (a `[]` f32 device tensor,
/// no read-back) and the softmax probabilities backward needs.
pub struct CrossEntropy {
    pub loss: Tensor,
    pub softmax: Tensor,
}

/// Softmax cross-entropy of f32 `logits: [n, k]` (this rank's k classes) against `labels`
/// (this rank's column, −1 elsewhere), the rows' maxima and sums combined by `world`.
pub fn cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    world: &mut dyn RowReduce,
) -> Result<CrossEntropy> {
    let what = "cross-entropy";
    let (n, k) = dims2(logits.dims(), what)?;
    let dev = cuda_device(logits, what)?;
    let stream = dev.cuda_stream();
    let logits = logits.contiguous()?;
    let xr = CudaRef::new(&logits, what)?;
    let lr = CudaRef::new(labels, what)?;
    let xp = read(xr.storage()?, xr.layout, &stream, "logits")?;
    if xp.dtype != DType::F32 {
        candle_core::bail!("{what}: logits must be f32")
    }
    let lp = labels_ptr(&lr, &stream, n)?;
    let rows = per_row(n)?;
    let vector = |s| tensor(s, n);
    // Stage 1: this rank's row maxima, then the world's.
    let mut local_max = alloc(&dev, DType::F32, n)?;
    {
        let mp = write(&mut local_max, &Layout::contiguous(n), &stream, "row maxima")?;
        let f = function(&dev, &ROWS, "ce_row_max")?;
        // SAFETY: ce_row_max(const float* x, size_t k, float* max): one block per row; x holds
        // n·k values, max n.
        unsafe { launch!(f, rows; xp.addr, k, mp.addr) }?;
    }
    let max = world.max(vector(local_max))?;
    // Stage 2: p = exp(x − max) and the row sums, then the world's sums.
    let mut p = alloc(&dev, DType::F32, n * k)?;
    let mut sums = alloc(&dev, DType::F32, n)?;
    {
        let mr = CudaRef::new(&max, "row maxima")?;
        let mp = read(mr.storage()?, mr.layout, &stream, "row maxima")?;
        let pp = write(&mut p, &Layout::contiguous(n * k), &stream, "softmax")?;
        let sp = write(&mut sums, &Layout::contiguous(n), &stream, "row sums")?;
        let f = function(&dev, &ROWS, "ce_exp_sum")?;
        // SAFETY: ce_exp_sum(const float* x, const float* max, size_t k, float* p,
        // float* sums): one block per row; x and p hold n·k values, max and sums n.
        unsafe { launch!(f, rows; xp.addr, mp.addr, k, pp.addr, sp.addr) }?;
    }
    let sums = world.sum(vector(sums))?;
    // Stage 3: normalise, and the target's probability where this rank holds the class.
    let mut target = alloc(&dev, DType::F32, n)?;
    {
        let sr = CudaRef::new(&sums, "row sums")?;
        let sp = read(sr.storage()?, sr.layout, &stream, "row sums")?;
        let pp = write(&mut p, &Layout::contiguous(n * k), &stream, "softmax")?;
        let tp = write(&mut target, &Layout::contiguous(n), &stream, "target probabilities")?;
        let f = function(&dev, &ROWS, "ce_normalize")?;
        // SAFETY: ce_normalize(float* p, const float* sums, const long long* labels, size_t k,
        // float* target): one block per row; p holds n·k values, sums, labels, target n.
        unsafe { launch!(f, rows; pp.addr, sp.addr, lp.addr, k, tp.addr) }?;
    }
    let target = world.sum(vector(target))?;
    // Stage 4: the mean loss.
    let mut loss = alloc(&dev, DType::F32, 1)?;
    {
        let tr = CudaRef::new(&target, "target probabilities")?;
        let tp = read(tr.storage()?, tr.layout, &stream, "target probabilities")?;
        let op = write(&mut loss, &Layout::contiguous(1), &stream, "loss")?;
        let f = function(&dev, &ROWS, "ce_loss")?;
        // SAFETY: ce_loss(const float* target, size_t n, float* loss): one block; target holds
        // n values, loss one.
        unsafe { launch!(f, per_row(1)?; tp.addr, n, op.addr) }?;
    }
    Ok(CrossEntropy { loss: tensor(loss, ()), softmax: tensor(p, (n, k)) })
}

/// The gradient of [`cross_entropy`]'s mean loss: `(p − onehot(label))·g/n`, `g` the loss's
/// gradient (a one-element device tensor).
pub fn cross_entropy_backward(softmax: &Tensor, labels: &Tensor, g: &Tensor) -> Result<Tensor> {
    let what = "cross-entropy backward";
    let (n, k) = dims2(softmax.dims(), what)?;
    let dev = cuda_device(softmax, what)?;
    let stream = dev.cuda_stream();
    let g = g.to_dtype(DType::F32)?.contiguous()?;
    let (pr, lr, gr) =
        (CudaRef::new(softmax, what)?, CudaRef::new(labels, what)?, CudaRef::new(&g, what)?);
    let pp = read(pr.storage()?, pr.layout, &stream, "softmax")?;
    let lp = labels_ptr(&lr, &stream, n)?;
    let gp = read(gr.storage()?, gr.layout, &stream, "loss gradient")?;
    let mut gx = alloc(&dev, DType::F32, n * k)?;
    if n > 0 {
        let gxp = write(&mut gx, &Layout::contiguous(n * k), &stream, "logits gradient")?;
        let f = function(&dev, &ROWS, "ce_bwd")?;
        // SAFETY: ce_bwd(const float* p, const long long* labels, const float* g, size_t n,
        // size_t k, float* gx): one block per row; p and gx hold n·k values, labels n, g one.
        unsafe { launch!(f, per_row(n)?; pp.addr, lp.addr, gp.addr, n, k, gxp.addr) }?;
    }
    Ok(tensor(gx, (n, k)))
}
