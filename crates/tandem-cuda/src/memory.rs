//! The GPU memory a run took: the high-water mark of the device's default memory pool, which
//! every stream-ordered allocation (candle's tensors, tandem's kernels' buffers) comes from,
//! as `torch.cuda.max_memory_allocated` counts PyTorch's caching allocator.
use candle_core::cuda::cudarc::driver::sys;

/// The peak bytes in use in the default memory pool of the device whose context is current on
/// this thread since the process started (or [`reset_peak`]); `None` where this thread has no
/// CUDA context (a CPU run) or the driver cannot say.
pub fn peak_bytes() -> Option<u64> {
    let pool = current_pool()?;
    let mut value: u64 = 0;
    // SAFETY: a pool handle from the driver; USED_MEM_HIGH is a cuuint64_t.
    let rc = unsafe {
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut value as *mut u64).cast(),
        )
    };
    (rc == sys::CUresult::CUDA_SUCCESS).then_some(value)
}

/// Starts the high-water mark again from the memory in use now.
pub fn reset_peak() {
    let Some(pool) = current_pool() else { return };
    let mut zero: u64 = 0;
    // SAFETY: as in `peak_bytes`; setting USED_MEM_HIGH to 0 resets it to the current use.
    let _ = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    };
}

fn current_pool() -> Option<sys::CUmemoryPool> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle (null when none is current); creates nothing.
    if unsafe { sys::cuCtxGetCurrent(&mut ctx) } != sys::CUresult::CUDA_SUCCESS || ctx.is_null() {
        return None;
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes the current context's device.
    if unsafe { sys::cuCtxGetDevice(&mut dev) } != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: writes the device's default pool handle.
    let rc = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev) };
    (rc == sys::CUresult::CUDA_SUCCESS && !pool.is_null()).then_some(pool)
}
