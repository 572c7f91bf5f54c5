//! CPU kernels for convolutional nets, written here because candle's CPU path is the
//! bottleneck (see each module) and no crate offers trainable conv kernels on plain slices. The
//! matrix products are `gemm`'s (the crate candle itself uses); what is ours is the data layout
//! around them and the backward passes.
pub mod batch_norm;
pub mod conv2d;
mod matmul;
pub mod pool;
pub mod prelu;
pub mod relu;
pub mod winograd;

/// Runs `f` on the tensor's data as one contiguous f32 slice, copying only when the tensor is
/// strided or not on the CPU.
pub fn with_f32_slice<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    if t.dtype() != candle_core::DType::F32 {
        candle_core::bail!("expected an f32 tensor, got {:?}", t.dtype())
    }
    if t.device().is_cpu() {
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}
