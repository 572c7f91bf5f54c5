//! tandem-nn: the layer below models and data parallelism. What candle-nn does not have and
//! tandem's models need:
//!
//! - CPU kernels for convolutional nets ([`kernels`]: conv2d, BatchNorm(+ReLU), pooling, ReLU)
//!   and layers on them for `VarBuilder` models ([`FastConv2d`], [`FastBatchNorm2d`], which
//!   synchronises its statistics like PyTorch's `SyncBatchNorm` through any [`StatsReducer`],
//!   [`FastPRelu`]);
//! - a model's parameters as Ddp sees them: [`ParamModule`] (PyTorch's `nn.Module` contract:
//!   named parameters and buffers, strict `load_state_dict`), [`ParamSet`] (a parameter view
//!   with per-parameter backward hooks, what lets Ddp overlap all-reduce with backward),
//!   [`OrderedVarMap`] / [`NamedVars`] (candle's `VarMap`, in a fixed order);
//! - state dicts to and from checkpoint data ([`weights`]), with tandem-ckpt doing the files.
//!
//! It knows nothing of process groups, launchers, samplers, optimizers or gradient reduction:
//! the distributed layers (differentiable collectives, SyncBatchNorm over a process group) are
//! tandem-dist-nn's, one layer up.
mod alloc;
mod autocast;
mod backward;
mod batch_norm;
mod checkpoint;
mod conv;
pub mod convert;
mod error;
pub mod functional;
mod hook;
pub mod kernels;
mod linear;
mod module;
mod no_grad;
mod params;
mod prelu;
mod recompute;
mod scoped;
mod threads;
pub mod torch_init;
mod vars;
pub mod weights;

pub use alloc::{allocator_tuned, release_freed_memory, tune_allocator};
pub use autocast::{autocast, compute_dtype, Autocast};
pub use backward::{backward, backward_with_sink, GradSink};
pub use batch_norm::{fast_batch_norm2d, FastBatchNorm2d, HasBatchNorm, StatsReducer};
pub use checkpoint::{checkpoint, CheckpointFn};
pub use conv::{fast_conv2d, fast_conv2d_no_bias, FastConv2d};
pub use error::{NnError, Result};
pub use hook::ViewHooks;
pub use linear::{fast_linear, fast_linear_no_bias, FastLinear};
pub use module::ParamModule;
pub use no_grad::{cut_graph, grad_enabled, no_grad};
pub use params::ParamSet;
pub use prelu::{fast_prelu, FastPRelu};
pub use recompute::{recompute, recomputing};
pub use threads::{compute_pool_joined, join_compute_pool};
pub use vars::{is_buffer, NamedVars, OrderedVarMap};

/// The f32 values of a contiguous CPU input of a custom op; `what` and `op` name it in errors.
#[doc(hidden)]
pub fn contiguous_f32<'a>(
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
