//! In-place optimizer updates on CUDA (kernels/optim.cu), the GPU twins of tandem-optim's
//! fused CPU steps: SGD (dense, and row-sparse with the same bits as the dense step) and
//! Adam/AdamW. Everything is f32 (master weights and state).
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::{CudaStorage, DType, Device, Layout, Tensor};

use crate::batch_norm::Operand;
use crate::device::{
    alloc, cuda_device, device_of, elementwise, function, launch, read, tensor, write, CudaRef,
    Ptr, OPTIM,
};
use crate::Result;

/// An operand updated in place.
pub type Target<'a> = (&'a mut CudaStorage, &'a Layout);

use crate::{AdamRule, SgdRule};

// SAFETY: `#[repr(C)]` plain old data (floats and integers), laid out as kernels/optim.cu's
// `SgdRule`, which the kernels read by value.
unsafe impl DeviceRepr for SgdRule {}

// SAFETY: as above, for kernels/optim.cu's `AdamRule`.
unsafe impl DeviceRepr for AdamRule {}

fn f32_operand<'a>(
    (s, l): Operand<'a>,
    stream: &'a candle_core::cuda::cudarc::driver::CudaStream,
    n: usize,
    what: &str,
) -> Result<Ptr<'a>> {
    let p = read(s, l, stream, what)?;
    if p.dtype != DType::F32 || l.shape().elem_count() != n {
        candle_core::bail!(
            "fused optimizer step: {what} must hold {n} f32 values, it is {:?} {:?}",
            p.dtype,
            l.dims()
        )
    }
    Ok(p)
}

fn f32_target<'a>(
    (s, l): Target<'a>,
    stream: &'a candle_core::cuda::cudarc::driver::CudaStream,
    what: &str,
) -> Result<(Ptr<'a>, usize)> {
    let n = l.shape().elem_count();
    let p = write(s, l, stream, what)?;
    if p.dtype != DType::F32 {
        candle_core::bail!("fused optimizer step: {what} must be f32, it is {:?}", p.dtype)
    }
    Ok((p, n))
}

/// p = p − lr·step (see the CPU twin's `ParamUpdate`); `b` the momentum buffer when used.
pub fn sgd_param(p: Target<'_>, g: Operand<'_>, b: Option<Operand<'_>>, k: SgdRule) -> Result<()> {
    let dev = device_of(p.0);
    let stream = dev.cuda_stream();
    let (pp, n) = f32_target(p, &stream, "parameter")?;
    let gp = f32_operand(g, &stream, n, "gradient")?;
    let bp = b.map(|b| f32_operand(b, &stream, n, "momentum buffer")).transpose()?;
    let f = function(&dev, &OPTIM, "sgd_param")?;
    let b_addr = bp.as_ref().map_or(0, |b| b.addr);
    // SAFETY: sgd_param(float* p, const float* g, const float* b, size_t n, SgdRule k): p, g
    // and b (read only when k.use_buf) hold n values.
    unsafe { launch!(f, elementwise(n); pp.addr, gp.addr, b_addr, n, k) }
}

/// buf = momentum·buf + (1 − dampening)·d, or d on the first step (`MomentumUpdate`).
pub fn sgd_momentum(
    b: Target<'_>,
    g: Operand<'_>,
    p: Operand<'_>,
    k: SgdRule,
    first: bool,
) -> Result<()> {
    let dev = device_of(b.0);
    let stream = dev.cuda_stream();
    let (bp, n) = f32_target(b, &stream, "momentum buffer")?;
    let gp = f32_operand(g, &stream, n, "gradient")?;
    let pp = f32_operand(p, &stream, n, "parameter")?;
    let f = function(&dev, &OPTIM, "sgd_momentum")?;
    // SAFETY: sgd_momentum(float* b, const float* g, const float* p, size_t n, SgdRule k,
    // int first): b, g, p hold n values.
    unsafe { launch!(f, elementwise(n); bp.addr, gp.addr, pp.addr, n, k, first as i32) }
}

/// Which gradient row each of `n_rows` rows has (an i32 map, −1 for none) for the ascending
/// `rows`, on `device`: built once per step, read by both row-sparse updates.
pub fn rows_map(rows: &[u32], n_rows: usize, device: &Device) -> Result<Tensor> {
    let dev = match device {
        Device::Cuda(d) => d.clone(),
        other => candle_core::bail!("rows_map: expected a CUDA device, got {other:?}"),
    };
    if rows.last().is_some_and(|&r| r as usize >= n_rows) {
        candle_core::bail!("rows_map: row {} of {n_rows}", rows[rows.len() - 1])
    }
    let stream = dev.cuda_stream();
    let listed = Tensor::from_slice(rows, rows.len(), device)?;
    let mut map = alloc(&dev, DType::I32, n_rows)?;
    {
        let mp = write(&mut map, &Layout::contiguous(n_rows), &stream, "row map")?;
        let f = function(&dev, &OPTIM, "rows_map_clear")?;
        // SAFETY: rows_map_clear(int* map, size_t n_rows): map holds n_rows values.
        unsafe { launch!(f, elementwise(n_rows); mp.addr, n_rows) }?;
        if !rows.is_empty() {
            let lr = CudaRef::new(&listed, "rows")?;
            let lp = read(lr.storage()?, lr.layout, &stream, "rows")?;
            let f = function(&dev, &OPTIM, "rows_map_set")?;
            // SAFETY: rows_map_set(const uint32_t* rows, size_t n, int* map): rows holds n
            // values, each below n_rows (checked above), map n_rows.
            unsafe { launch!(f, elementwise(rows.len()); lp.addr, rows.len(), mp.addr) }?;
        }
    }
    Ok(tensor(map, n_rows))
}

/// Rows of the dense target and the row length; checks the gradient rows' size.
fn rows_geometry(dims: &[usize], map: &Tensor, g_rows: usize) -> Result<usize> {
    let (n_rows, cols) = match dims {
        [r, rest @ ..] => (*r, rest.iter().product::<usize>()),
        [] => candle_core::bail!("fused optimizer step: a row-sparse tensor has no rows"),
    };
    if map.elem_count() != n_rows || (cols > 0 && !g_rows.is_multiple_of(cols)) {
        candle_core::bail!(
            "fused optimizer step: {n_rows} rows of {cols}, a map of {} rows, {g_rows} gradient values",
            map.elem_count()
        )
    }
    Ok(cols)
}

/// [`sgd_param`] where the gradient is zero but for the rows `map` lists, stacked in `g_rows`.
pub fn sgd_param_rows(
    p: Target<'_>,
    g_rows: Operand<'_>,
    b: Option<Operand<'_>>,
    map: &Tensor,
    k: SgdRule,
) -> Result<()> {
    let cols = rows_geometry(p.1.dims(), map, g_rows.1.shape().elem_count())?;
    let dev = device_of(p.0);
    let stream = dev.cuda_stream();
    let g_len = g_rows.1.shape().elem_count();
    let (pp, n) = f32_target(p, &stream, "parameter")?;
    let gp = f32_operand(g_rows, &stream, g_len, "gradient rows")?;
    let bp = b.map(|b| f32_operand(b, &stream, n, "momentum buffer")).transpose()?;
    let mr = CudaRef::new(map, "row map")?;
    let mp = read(mr.storage()?, mr.layout, &stream, "row map")?;
    let f = function(&dev, &OPTIM, "sgd_param_rows")?;
    let b_addr = bp.as_ref().map_or(0, |b| b.addr);
    // SAFETY: sgd_param_rows(float* p, const float* g_rows, const float* b, const int* map,
    // size_t cols, size_t n, SgdRule k): p and b hold n = rows·cols values, map one entry per
    // row, each −1 or a row of g_rows (rows_map).
    unsafe { launch!(f, elementwise(n); pp.addr, gp.addr, b_addr, mp.addr, cols, n, k) }
}

/// [`sgd_momentum`] with the row-sparse gradient of [`sgd_param_rows`].
pub fn sgd_momentum_rows(
    b: Target<'_>,
    g_rows: Operand<'_>,
    p: Operand<'_>,
    map: &Tensor,
    k: SgdRule,
    first: bool,
) -> Result<()> {
    let cols = rows_geometry(b.1.dims(), map, g_rows.1.shape().elem_count())?;
    let dev = device_of(b.0);
    let stream = dev.cuda_stream();
    let g_len = g_rows.1.shape().elem_count();
    let (bp, n) = f32_target(b, &stream, "momentum buffer")?;
    let gp = f32_operand(g_rows, &stream, g_len, "gradient rows")?;
    let pp = f32_operand(p, &stream, n, "parameter")?;
    let mr = CudaRef::new(map, "row map")?;
    let mp = read(mr.storage()?, mr.layout, &stream, "row map")?;
    let f = function(&dev, &OPTIM, "sgd_momentum_rows")?;
    // SAFETY: sgd_momentum_rows(float* b, const float* g_rows, const float* p, const int* map,
    // size_t cols, size_t n, SgdRule k, int first): as sgd_param_rows.
    unsafe {
        launch!(f, elementwise(n); bp.addr, gp.addr, pp.addr, mp.addr, cols, n, k, first as i32)
    }
}

/// One of Adam's elementwise updates of `dst` from two operands (`kernel` names it).
fn adam_update(
    kernel: &str,
    dst: Target<'_>,
    a: Operand<'_>,
    b: Operand<'_>,
    k: Option<AdamRule>,
) -> Result<()> {
    let dev = device_of(dst.0);
    let stream = dev.cuda_stream();
    let (dp, n) = f32_target(dst, &stream, kernel)?;
    let ap = f32_operand(a, &stream, n, kernel)?;
    let bp = f32_operand(b, &stream, n, kernel)?;
    let f = function(&dev, &OPTIM, kernel)?;
    match k {
        // SAFETY: adam_first_moment / adam_second_moment / adam_param(float* dst, const float*
        // a, const float* b, size_t n, AdamRule k): all hold n values.
        Some(k) => unsafe { launch!(f, elementwise(n); dp.addr, ap.addr, bp.addr, n, k) },
        // SAFETY: adam_running_max(float* mx, const float* v, size_t n): both hold n values.
        None => unsafe { launch!(f, elementwise(n); dp.addr, ap.addr, n) },
    }
}

/// exp_avg += (d − exp_avg)·(1 − β1), d = g (+ wd·p for Adam's coupled decay).
pub fn adam_first_moment(m: Target<'_>, g: Operand<'_>, p: Operand<'_>, k: AdamRule) -> Result<()> {
    adam_update("adam_first_moment", m, g, p, Some(k))
}

/// exp_avg_sq = β2·exp_avg_sq + (1 − β2)·d².
pub fn adam_second_moment(
    v: Target<'_>,
    g: Operand<'_>,
    p: Operand<'_>,
    k: AdamRule,
) -> Result<()> {
    adam_update("adam_second_moment", v, g, p, Some(k))
}

/// amsgrad's max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq).
pub fn adam_running_max(mx: Target<'_>, v: Operand<'_>) -> Result<()> {
    adam_update("adam_running_max", mx, v, v, None)
}

/// p = decay(p) − step_size·exp_avg / (sqrt(second)·inv_bc2_sqrt + eps).
pub fn adam_param(p: Target<'_>, m: Operand<'_>, s: Operand<'_>, k: AdamRule) -> Result<()> {
    adam_update("adam_param", p, m, s, Some(k))
}

/// A CUDA tensor's device, for callers that hold tensors (re-exported for the optimizers).
pub fn device(t: &Tensor) -> Result<candle_core::CudaDevice> {
    cuda_device(t, "fused optimizer step")
}
