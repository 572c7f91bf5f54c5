//! PReLU on CUDA (kernels/prelu.cu): forward, and the backward's input and slope gradients.
//! Slopes are f32: one per channel of dim 1, or one for the whole tensor.
use candle_core::{CudaStorage, DType, Layout, Tensor};

use crate::batch_norm::Operand;
use crate::device::{
    alloc, chunked, chunking, cuda_device, device_of, elementwise, function, launch, per_row, read,
    suffix, tensor, write, CudaRef, PRELU,
};
use crate::Result;

/// `x` where positive, else `a·x`; `(c, hw)`: the slopes and the values per plane (the
/// caller's geometry: one slope per channel of dim 1, or `c == 1` for all).
pub fn forward(x: Operand<'_>, a: Operand<'_>, (c, hw): (usize, usize)) -> Result<CudaStorage> {
    let what = "prelu";
    let total = x.1.shape().elem_count();
    let dev = device_of(x.0);
    let stream = dev.cuda_stream();
    let xp = read(x.0, x.1, &stream, "prelu input")?;
    let ap = read(a.0, a.1, &stream, "prelu slopes")?;
    if ap.dtype != DType::F32 {
        candle_core::bail!("{what}: the slopes must be f32")
    }
    let mut y = alloc(&dev, xp.dtype, total)?;
    let f = function(&dev, &PRELU, &format!("prelu_fwd_{}", suffix(xp.dtype, what)?))?;
    let yp = write(&mut y, &Layout::contiguous(total), &stream, "prelu output")?;
    // SAFETY: prelu_fwd(const T* x, const float* a, T* y, size_t total, size_t c, size_t hw):
    // x and y hold `total` values, a holds c (c == 1: one).
    unsafe { launch!(f, elementwise(total); xp.addr, ap.addr, yp.addr, total, c, hw) }?;
    drop(yp);
    Ok(y)
}

/// The input's gradient (when `want_x`) and the slopes' (`Σ gy·x` over `x ≤ 0`, shaped as `a`),
/// with [`forward`]'s geometry.
pub fn backward(
    x: &Tensor,
    a: &Tensor,
    gy: &Tensor,
    (c, hw): (usize, usize),
    want_x: bool,
) -> Result<(Option<Tensor>, Tensor)> {
    let what = "prelu backward";
    let total = x.elem_count();
    let dev = cuda_device(x, what)?;
    let stream = dev.cuda_stream();
    let (a, gy) = (a.contiguous()?, gy.contiguous()?);
    let (xr, ar, gr) = (CudaRef::new(x, what)?, CudaRef::new(&a, what)?, CudaRef::new(&gy, what)?);
    let xp = read(xr.storage()?, xr.layout, &stream, "prelu input")?;
    let ap = read(ar.storage()?, ar.layout, &stream, "prelu slopes")?;
    let gp = read(gr.storage()?, gr.layout, &stream, "prelu output gradient")?;
    let sfx = suffix(xp.dtype, what)?;
    let per_slope = total / c;
    let (chunks, chunk_len) = chunking(per_slope, c);
    let mut partials = alloc(&dev, DType::F64, c * chunks)?;
    let mut ga = alloc(&dev, DType::F32, c)?;
    {
        let pp = write(&mut partials, &Layout::contiguous(c * chunks), &stream, "partials")?;
        let f = function(&dev, &PRELU, &format!("prelu_grad_partials_{sfx}"))?;
        // SAFETY: prelu_grad_partials(const T* x, const T* gy, size_t total, size_t c,
        // size_t hw, size_t chunk_len, double* partials): x and gy hold `total` values,
        // partials c·chunks.
        unsafe {
            launch!(f, chunked(chunks, c)?; xp.addr, gp.addr, total, c, hw, chunk_len, pp.addr)
        }?;
    }
    {
        let pp = read(&partials, &Layout::contiguous(c * chunks), &stream, "partials")?;
        let gap = write(&mut ga, &Layout::contiguous(c), &stream, "slope gradient")?;
        let f = function(&dev, &PRELU, "prelu_grad_slopes")?;
        // SAFETY: prelu_grad_slopes(const double* partials, size_t chunks, float* ga):
        // partials c·chunks, ga c.
        unsafe { launch!(f, per_row(c)?; pp.addr, chunks, gap.addr) }?;
    }
    let gx = if want_x {
        let mut gx = alloc(&dev, xp.dtype, total)?;
        {
            let gxp = write(&mut gx, &Layout::contiguous(total), &stream, "input gradient")?;
            let f = function(&dev, &PRELU, &format!("prelu_grad_input_{sfx}"))?;
            // SAFETY: prelu_grad_input(const T* x, const T* gy, const float* a, T* gx,
            // size_t total, size_t c, size_t hw): x, gy, gx hold `total` values, a c.
            unsafe {
                launch!(f, elementwise(total); xp.addr, gp.addr, ap.addr, gxp.addr, total, c, hw)
            }?;
        }
        Some(tensor(gx, x.shape().clone()))
    } else {
        None
    };
    Ok((gx, tensor(ga, a.shape().clone())))
}
