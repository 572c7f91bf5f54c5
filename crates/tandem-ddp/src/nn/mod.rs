//! Layers for stock-style candle models (built from a `VarBuilder`, used through candle-nn's
//! `Module`/`ModuleT`) that need something candle-nn does not have: a BatchNorm that can
//! synchronise its batch statistics across ranks (PyTorch's `SyncBatchNorm`), the
//! differentiable all-reduce it is built on and a differentiable all-gather, and convolutions on tandem's CPU kernels.
mod all_gather;
mod all_reduce;
mod batch_norm;
mod conv;

pub use all_gather::{all_gather, GatherGrad};
pub use all_reduce::all_reduce_sum;
pub use batch_norm::{batch_norm2d, convert_sync_batchnorm, BatchNorm2d, HasBatchNorm};
pub use conv::{conv2d, conv2d_no_bias, Conv2d};

/// The f32 values of a contiguous CPU input of a custom op; `what` and `op` name it in errors.
pub(crate) fn contiguous_f32<'a>(
    storage: &'a candle_core::CpuStorage,
    layout: &candle_core::Layout,
    what: &str,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    use candle_core::backend::BackendStorage;
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what}: {op} input is not contiguous")
    };
    let candle_core::CpuStorage::F32(v) = storage else {
        candle_core::bail!("{what}: {op} needs f32, got {:?}", storage.dtype())
    };
    Ok(&v[start..end])
}
