//! tandem-cuda: tandem's GPU side, behind the `cuda` feature (without it the crate is empty and
//! needs no CUDA toolkit).
//!
//! - kernels for what tandem fuses on the CPU, each the twin of a CPU kernel of tandem-nn,
//!   tandem-optim or tandem-partial-fc, with the same formulas (elementwise results equal bit
//!   for bit where the CPU rounds each step; sums agree within rounding): `batch_norm`
//!   (+ ReLU, + residual add), `prelu`, `rows` (L2 normalise, the face head's margin and
//!   split cross-entropy), `optim` (SGD dense and row-sparse, Adam/AdamW, in place),
//!   `reduce` (a whole model's Σ g² or inf/NaN check with one read-back);
//! - `cudnn`: convolutions (forward and both backwards) through cuDNN, loaded at run time;
//! - `upload`: batches to the device through pinned memory on a copy stream;
//! - `timing`: CUDA events for honest phase times; `profile`: `TANDEM_PROFILE=phases|ops`
//!   (device-synchronised phases, per-kernel device times); `memory`: the device's peak use.
//!
//! The kernels (kernels/*.cu) are compiled to PTX by nvcc when the crate is built with `cuda`
//! and loaded into each device on first use. Reductions never use atomics, so a result is the
//! same bits run after run. Functions take candle's CUDA storages (what a custom op's
//! `cuda_fwd` receives) or CUDA tensors (what a `bwd` receives), and return fresh outputs
//! outside the autograd graph; errors are candle's.
//!
//! It knows nothing of layers, optimizers or process groups: the ops that call it (tandem-nn's
//! `FastBatchNorm2d`, tandem-optim's fused steps, ...) decide when a kernel applies.
#[cfg(feature = "cuda")]
pub mod batch_norm;
#[cfg(feature = "cuda")]
pub mod cudnn;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod memory;
#[cfg(feature = "cuda")]
pub mod optim;
#[cfg(feature = "cuda")]
pub mod prelu;
pub mod profile;
#[cfg(feature = "cuda")]
pub mod reduce;
#[cfg(feature = "cuda")]
pub mod rows;
mod rules;
pub mod timing;
#[cfg(feature = "cuda")]
pub mod upload;

/// candle's result: the kernels run inside candle's custom ops.
pub use rules::{AdamRule, SgdRule};

pub type Result<T> = candle_core::Result<T>;

/// Whether this build has the CUDA code (`--features cuda`).
pub const fn compiled() -> bool {
    cfg!(feature = "cuda")
}
