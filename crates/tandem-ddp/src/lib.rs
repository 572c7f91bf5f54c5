//! tandem-ddp: DistributedDataParallel and DataParallel on candle, optimizers, schedulers, and
//! reference models. The gradient reducer itself (`reducer`, `bucket`) is engine-agnostic: named
//! flat f32 buffers in ready order; `params`/`hook`/`ddp` are the candle adapter that feeds it.
//! Collectives come through the `comm::GradComm` trait (implemented for tandem-comm's
//! `ProcessGroup`); this crate knows nothing of sockets, launchers or checkpoint file formats.
pub mod amp;
pub mod metrics;
pub mod optim;
pub mod sched;

pub mod alloc;
pub mod bucket;
#[cfg(any(feature = "cuda", test))]
mod bucketed;
pub mod comm;
pub mod comm_hooks;
pub mod convert;
pub mod data_parallel;
pub mod ddp;
#[cfg(feature = "cuda")]
mod device;
pub mod error;
pub mod functional;
mod hook;
pub mod kernels;
pub mod models;
pub mod module;
pub mod nn;
pub mod params;
pub mod powersgd;
pub mod reducer;
pub mod vars;
pub mod weights;

pub use alloc::tune_allocator;
pub use comm::{GradComm, LocalGroup, SingleProcess};
pub use comm_hooks::{BucketParam, CommHook, GradBucket};
pub use data_parallel::{chunk_sizes, DataParallel};
pub use ddp::{Ddp, DdpOptions, JoinOptions, Unhooked};
pub use error::{DdpError, Result};
pub use module::ParamModule;
pub use params::ParamSet;
pub use vars::{NamedVars, OrderedVarMap};
