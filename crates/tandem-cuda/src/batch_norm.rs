//! Training-mode BatchNorm2d on CUDA (kernels/batch_norm.cu): batch statistics, the output
//! (with an optional residual add and ReLU), and the backward. Activations are f32, f16 or
//! bf16; γ, β, the statistics and the gradients of γ and β are f32.
use candle_core::{CudaStorage, DType, Layout, Tensor};

use crate::device::{
    alloc, chunked, chunking, cuda_device, device_of, elementwise, function, launch, per_row, read,
    suffix, tensor, write, CudaRef, BATCH_NORM,
};
use crate::Result;

fn dims4(dims: &[usize], what: &str) -> Result<(usize, usize, usize)> {
    match dims {
        &[n, c, h, w] => Ok((n, c, h * w)),
        _ => candle_core::bail!("{what}: expected [N, C, H, W], got {dims:?}"),
    }
}

/// Per-channel statistics of `x: [N, C, H, W]` (contiguous, on a GPU): a `[3, C]` f32 tensor
/// holding the mean, the biased variance and `1/sqrt(var + eps)`.
pub fn batch_stats(x: &Tensor, eps: f64) -> Result<Tensor> {
    let what = "batch_norm statistics";
    let (n, c, hw) = dims4(x.dims(), what)?;
    let dev = cuda_device(x, what)?;
    let stream = dev.cuda_stream();
    let m = n * hw;
    let (chunks, chunk_len) = chunking(m, c);
    let mut partials = alloc(&dev, DType::F64, c * chunks * 2)?;
    let mut stats = alloc(&dev, DType::F32, 3 * c)?;
    {
        let xr = CudaRef::new(x, what)?;
        let xp = read(xr.storage()?, xr.layout, &stream, "batch_norm input")?;
        let f = function(&dev, &BATCH_NORM, &format!("bn_partials_{}", suffix(xp.dtype, what)?))?;
        let pl = Layout::contiguous(c * chunks * 2);
        let pp = write(&mut partials, &pl, &stream, "partials")?;
        // SAFETY: bn_partials(const T* x, size_t n, size_t c, size_t hw, size_t chunk_len,
        // double* partials): x holds n·c·hw values of its dtype, partials c·chunks·2.
        unsafe { launch!(f, chunked(chunks, c)?; xp.addr, n, c, hw, chunk_len, pp.addr) }?;
    }
    {
        let f = function(&dev, &BATCH_NORM, "bn_stats")?;
        let pp = read(&partials, &Layout::contiguous(c * chunks * 2), &stream, "partials")?;
        let sp = write(&mut stats, &Layout::contiguous(3 * c), &stream, "statistics")?;
        // SAFETY: bn_stats(const double* partials, size_t chunks, size_t count, double eps,
        // size_t c, float* stats): partials c·chunks·2, stats 3·c.
        unsafe { launch!(f, per_row(c)?; pp.addr, chunks, m, eps, c, sp.addr) }?;
    }
    Ok(tensor(stats, (3, c)))
}

/// An operand given as a storage and its layout (what a custom op's `cuda_fwd` receives).
pub type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// `x·scale + shift` (+ `residual`) (then ReLU when `relu`) with `scale = γ·invstd`,
/// `shift = β − mean·scale` from `stats` ([`batch_stats`]); the output has `x`'s dtype.
pub fn apply(
    x: Operand<'_>,
    gamma: Operand<'_>,
    beta: Operand<'_>,
    stats: &Tensor,
    residual: Option<Operand<'_>>,
    relu: bool,
) -> Result<CudaStorage> {
    let what = "batch_norm";
    let (_, c, hw) = dims4(x.1.dims(), what)?;
    let total = x.1.shape().elem_count();
    let dev = device_of(x.0);
    let stream = dev.cuda_stream();
    let xp = read(x.0, x.1, &stream, "batch_norm input")?;
    let mut y = alloc(&dev, xp.dtype, total)?;
    let gp = read(gamma.0, gamma.1, &stream, "batch_norm weight")?;
    let bp = read(beta.0, beta.1, &stream, "batch_norm bias")?;
    if gp.dtype != DType::F32 || bp.dtype != DType::F32 || gamma.1.shape().elem_count() != c {
        candle_core::bail!("{what}: weight and bias must be {c} f32 values")
    }
    let sr = CudaRef::new(stats, "batch_norm statistics")?;
    let sp = read(sr.storage()?, sr.layout, &stream, "batch_norm statistics")?;
    let rp = match residual {
        Some((s, l)) => {
            if l.shape().elem_count() != total {
                candle_core::bail!("{what}: residual {:?} for input {:?}", l.dims(), x.1.dims())
            }
            Some(read(s, l, &stream, "batch_norm residual")?)
        }
        None => None,
    };
    if rp.as_ref().is_some_and(|r| r.dtype != xp.dtype) {
        candle_core::bail!("{what}: the residual's dtype differs from the input's")
    }
    let f = function(&dev, &BATCH_NORM, &format!("bn_apply_{}", suffix(xp.dtype, what)?))?;
    let yp = write(&mut y, &Layout::contiguous(total), &stream, "batch_norm output")?;
    let r_addr = rp.as_ref().map_or(0u64, |r| r.addr);
    // SAFETY: bn_apply(const T* x, const float* gamma, const float* beta, const float* stats,
    // const T* residual, int relu, T* y, size_t total, size_t c, size_t hw): x, y and the
    // residual (or null) hold `total` values, γ and β c, stats 3·c.
    unsafe {
        launch!(f, elementwise(total);
            xp.addr, gp.addr, bp.addr, sp.addr, r_addr, relu as i32, yp.addr, total, c, hw)
    }?;
    drop(yp);
    Ok(y)
}

/// The gradients of a training BatchNorm.
pub struct BatchNormGrads {
    /// Of the input, when asked for.
    pub x: Option<Tensor>,
    /// Of γ and β: a `[2, C]` f32 tensor (row 0 γ's, row 1 β's).
    pub affine: Tensor,
    /// Of the residual (the output gradient past the ReLU), when asked for.
    pub residual: Option<Tensor>,
}

/// The backward of [`apply`]: `gy` the output's gradient; `y` the output when a ReLU followed
/// (its sign masks `gy`); `stats` and `gamma` the forward's.
pub fn backward(
    x: &Tensor,
    gy: &Tensor,
    y: Option<&Tensor>,
    stats: &Tensor,
    gamma: &Tensor,
    want_x: bool,
    want_residual: bool,
) -> Result<BatchNormGrads> {
    let what = "batch_norm backward";
    let (n, c, hw) = dims4(x.dims(), what)?;
    let total = n * c * hw;
    let dev = cuda_device(x, what)?;
    let stream = dev.cuda_stream();
    let m = n * hw;
    let (chunks, chunk_len) = chunking(m, c);
    let gy = gy.contiguous()?;
    let xr = CudaRef::new(x, what)?;
    let gr = CudaRef::new(&gy, "batch_norm output gradient")?;
    let yr = y.map(|y| CudaRef::new(y, "batch_norm output")).transpose()?;
    let sr = CudaRef::new(stats, "batch_norm statistics")?;
    let gamma = gamma.contiguous()?;
    let wr = CudaRef::new(&gamma, "batch_norm weight")?;
    let xp = read(xr.storage()?, xr.layout, &stream, "batch_norm input")?;
    let gp = read(gr.storage()?, gr.layout, &stream, "batch_norm output gradient")?;
    let yp = match &yr {
        Some(r) => Some(read(r.storage()?, r.layout, &stream, "batch_norm output")?),
        None => None,
    };
    let y_addr = yp.as_ref().map_or(0u64, |p| p.addr);
    let sp = read(sr.storage()?, sr.layout, &stream, "batch_norm statistics")?;
    let wp = read(wr.storage()?, wr.layout, &stream, "batch_norm weight")?;
    if gp.dtype != xp.dtype || yp.as_ref().is_some_and(|p| p.dtype != xp.dtype) {
        candle_core::bail!("{what}: input, output and gradient dtypes differ")
    }
    let sfx = suffix(xp.dtype, what)?;
    let mut partials = alloc(&dev, DType::F64, c * chunks * 2)?;
    let mut coeffs = alloc(&dev, DType::F32, 5 * c)?;
    {
        let pp = write(&mut partials, &Layout::contiguous(c * chunks * 2), &stream, "partials")?;
        let f = function(&dev, &BATCH_NORM, &format!("bn_grad_partials_{sfx}"))?;
        // SAFETY: bn_grad_partials(const T* x, const T* gy, const T* y, const float* stats,
        // size_t n, size_t c, size_t hw, size_t chunk_len, double* partials): x, gy, y (or
        // null) hold n·c·hw values, stats 3·c, partials c·chunks·2.
        unsafe {
            launch!(f, chunked(chunks, c)?;
                xp.addr, gp.addr, y_addr, sp.addr, n, c, hw, chunk_len, pp.addr)
        }?;
    }
    {
        let pp = read(&partials, &Layout::contiguous(c * chunks * 2), &stream, "partials")?;
        let cp = write(&mut coeffs, &Layout::contiguous(5 * c), &stream, "coefficients")?;
        let f = function(&dev, &BATCH_NORM, "bn_grad_coeffs")?;
        // SAFETY: bn_grad_coeffs(const double* partials, size_t chunks, size_t count,
        // const float* stats, const float* gamma, size_t c, float* coeffs): partials
        // c·chunks·2, stats 3·c, gamma c, coeffs 5·c.
        unsafe { launch!(f, per_row(c)?; pp.addr, chunks, m, sp.addr, wp.addr, c, cp.addr) }?;
    }
    let mut gx = want_x.then(|| alloc(&dev, xp.dtype, total)).transpose()?;
    let mut gres = want_residual.then(|| alloc(&dev, xp.dtype, total)).transpose()?;
    if gx.is_some() || gres.is_some() {
        let layout = Layout::contiguous(total);
        let cp = read(&coeffs, &Layout::contiguous(5 * c), &stream, "coefficients")?;
        let gxp = gx.as_mut().map(|s| write(s, &layout, &stream, "input gradient")).transpose()?;
        let grp =
            gres.as_mut().map(|s| write(s, &layout, &stream, "residual gradient")).transpose()?;
        let f = function(&dev, &BATCH_NORM, &format!("bn_grad_input_{sfx}"))?;
        let (gx_addr, gr_addr) =
            (gxp.as_ref().map_or(0, |p| p.addr), grp.as_ref().map_or(0, |p| p.addr));
        // SAFETY: bn_grad_input(const T* x, const T* gy, const T* y, const float* stats,
        // const float* coeffs, T* gx, T* gres, size_t total, size_t c, size_t hw): x, gy, y,
        // gx, gres (each or null) hold `total` values, stats 3·c, coeffs 5·c.
        unsafe {
            launch!(f, elementwise(total);
                xp.addr, gp.addr, y_addr, sp.addr, cp.addr, gx_addr, gr_addr, total, c, hw)
        }?;
    }
    let shape = x.shape().clone();
    let coeffs = tensor(coeffs, (5, c));
    Ok(BatchNormGrads {
        x: gx.map(|s| tensor(s, shape.clone())),
        affine: coeffs.narrow(0, 0, 2)?,
        residual: gres.map(|s| tensor(s, shape)),
    })
}
