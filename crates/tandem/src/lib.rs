//! tandem: distributed data-parallel training in Rust, with PyTorch's semantics.
//!
//! This crate is what a training program depends on: [`init()`] joins the process group the
//! launcher (or torchrun, Slurm, mpirun) described, and the sub-crates are re-exported under
//! short names; [`save_state`] / [`load_state`] checkpoint a whole training run in one call
//! each. It holds no command-line, progress-bar or plotting code: the `tandem` binary is
//! the `tandem-cli` crate and the benchmarks are `tandem-bench`.
//!
//! The crates, bottom to top (docs/architecture.md draws the layers and what each must not
//! know): [`comm`] (process groups, collectives, the store), [`ckpt`] (checkpoint files),
//! [`data`] (datasets, the sampler, the loader), [`nn`] (layers, kernels, parameter views, state
//! dicts, autocast; comm-free), [`cuda`] (GPU kernels, cuDNN, device timing; feature `cuda`), [`dist_nn`] (differentiable collectives, SyncBatchNorm), [`optim`] (optimizers, schedulers, GradScaler, clipping, ZeRO), [`models`] (reference
//! models and `ModelKind`), [`ddp`] (Ddp, DataParallel, comm hooks), [`fsdp`] (Fsdp: FSDP2's fully sharded data parallelism), [`partial_fc`]
//! (model-parallel heads), [`train`] (the training loop's parts: the `Trainer` and its
//! `Recipe`, one mixed-precision step, schedules, training state, live recovery, metrics),
//! [`recipes`] (the built-in recipes `tandem train` runs: the classifier, arcface_torch's face
//! recipe, verification and IJB), [`onnx`] (export) and [`launch`] (the launcher).
pub use tandem_ckpt as ckpt;
pub use tandem_comm as comm;
pub use tandem_cuda as cuda;
pub use tandem_data as data;
pub use tandem_ddp as ddp;
pub use tandem_dist_nn as dist_nn;
pub use tandem_fsdp as fsdp;
pub use tandem_launch as launch;
pub use tandem_models as models;
pub use tandem_nn as nn;
pub use tandem_onnx as onnx;
pub use tandem_optim as optim;
pub use tandem_partial_fc as partial_fc;

pub use tandem_recipes as recipes;
pub use tandem_train as train;
pub use tandem_train::live;

pub use tandem_nn::{allocator_tuned, release_freed_memory, tune_allocator};
pub use tandem_nn::{compute_pool_joined, join_compute_pool};
pub use tandem_train::{load_state, load_state_from, save_state, Resumed, TrainingState};

/// Joins the process group the environment describes: `tandem run` / torchrun variables,
/// Slurm, OpenMPI, or, with none of them, a world of one. A collective on every rank.
///
/// It changes nothing else in the process. CPU training with candle runs markedly faster when
/// glibc keeps freed tensor memory for reuse; opt in with [`tune_allocator()`] at the start of
/// `main` (the `tandem` binary does) — or, training with `Fsdp`, [`release_freed_memory()`].
pub fn init() -> Result<comm::ProcessGroup, comm::CommError> {
    tandem_comm::init()
}
