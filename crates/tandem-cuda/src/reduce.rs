//! Whole-model reductions with one read-back from the device (kernels/reduce.cu): the total
//! Σ x² over many tensors (clip_grad_norm's norm), and whether any of them holds an inf or NaN
//! (GradScaler's found_inf). Per parameter, a `to_scalar` would synchronise the host with the
//! GPU once each — a few hundred waits per step for a ResNet.
use candle_core::{DType, Layout, Tensor};

use crate::device::{
    alloc, cuda_device, function, launch, per_row, read, suffix, tensor, write, CudaRef, REDUCE,
};
use crate::Result;

/// Blocks per tensor of the sum of squares (kernels/reduce.cu's SUMSQ_BLOCKS).
const SUMSQ_BLOCKS: usize = 64;

/// Σ x² over every element of every tensor (all on one GPU; f32, f16 or bf16), accumulated in
/// f64 in a fixed order, as a one-element f64 tensor on the device (no read-back).
pub fn sum_squares(tensors: &[&Tensor]) -> Result<Tensor> {
    let what = "sum of squares";
    let Some(first) = tensors.first() else { candle_core::bail!("{what}: no tensors") };
    let dev = cuda_device(first, what)?;
    let stream = dev.cuda_stream();
    let slots = tensors.len() * SUMSQ_BLOCKS;
    let mut partials = alloc(&dev, DType::F64, slots)?;
    for (i, t) in tensors.iter().enumerate() {
        let t = t.contiguous()?;
        let r = CudaRef::new(&t, what)?;
        let tp = read(r.storage()?, r.layout, &stream, what)?;
        let n = t.elem_count();
        let layout = Layout::contiguous(slots).narrow(0, i * SUMSQ_BLOCKS, SUMSQ_BLOCKS)?;
        let pp = write(&mut partials, &layout, &stream, "partials")?;
        let f = function(&dev, &REDUCE, &format!("sumsq_partials_{}", suffix(tp.dtype, what)?))?;
        let cfg = candle_core::cuda::cudarc::driver::LaunchConfig {
            grid_dim: (SUMSQ_BLOCKS as u32, 1, 1),
            block_dim: (crate::device::BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sumsq_partials(const T* x, size_t n, double* partials): x holds n values,
        // partials (this tensor's slots) one per block of the SUMSQ_BLOCKS-block grid.
        unsafe { launch!(f, cfg; tp.addr, n, pp.addr) }?;
    }
    let mut out = alloc(&dev, DType::F64, 1)?;
    {
        let pp = read(&partials, &Layout::contiguous(slots), &stream, "partials")?;
        let op = write(&mut out, &Layout::contiguous(1), &stream, "sum")?;
        let f = function(&dev, &REDUCE, "sum_slots")?;
        // SAFETY: sum_slots(const double* partials, size_t n, double* out): partials holds n
        // values, out one.
        unsafe { launch!(f, per_row(1)?; pp.addr, slots, op.addr) }?;
    }
    Ok(tensor(out, 1))
}

/// Whether any element of the tensors is inf or NaN, as a one-element i32 tensor on the
/// device (1 or 0; no read-back).
pub fn any_nonfinite(tensors: &[&Tensor]) -> Result<Tensor> {
    let what = "non-finite check";
    let Some(first) = tensors.first() else { candle_core::bail!("{what}: no tensors") };
    let dev = cuda_device(first, what)?;
    let stream = dev.cuda_stream();
    let mut flag = crate::device::zeroed_i32(&dev, 1)?;
    {
        let fp = write(&mut flag, &Layout::contiguous(1), &stream, "flag")?;
        for t in tensors {
            let t = t.contiguous()?;
            let r = CudaRef::new(&t, what)?;
            let tp = read(r.storage()?, r.layout, &stream, what)?;
            let n = t.elem_count();
            let f = function(&dev, &REDUCE, &format!("any_nonfinite_{}", suffix(tp.dtype, what)?))?;
            // SAFETY: any_nonfinite(const T* x, size_t n, int* flag): x holds n values, flag one.
            unsafe { launch!(f, crate::device::elementwise(n); tp.addr, n, fp.addr) }?;
        }
    }
    Ok(tensor(flag, 1))
}
