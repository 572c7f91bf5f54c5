//! tandem-ddp: PyTorch's `DistributedDataParallel` ([`Ddp`]) and `DataParallel` on candle, with
//! the reducer behind them: gradient buckets (`bucket`, `reducer`, engine-agnostic: named flat
//! f32 buffers in ready order), communication hooks (fp16/bf16 compression, PowerSGD) and
//! `Join` for uneven inputs, plus metrics averaged across ranks.
//!
//! A model comes as any [`tandem_nn::ParamModule`]: a candle `VarMap` ([`Ddp::from_varmap`],
//! the default way to hold one) or a [`tandem_nn::ParamSet`] model, the opt-in that lets Ddp
//! overlap all-reduce with backward. Collectives come through [`tandem_comm::Collectives`].
//! This crate knows nothing of sockets, launchers, optimizers or checkpoint file formats.
mod bucket;
#[cfg(any(feature = "cuda", test))]
mod bucketed;
pub mod comm_hooks;
mod data_parallel;
mod ddp;
#[cfg(feature = "cuda")]
mod device;
mod error;
pub mod metrics;
pub mod powersgd;
mod reducer;

pub use comm_hooks::{BucketParam, CommHook, DeviceWire, GradBucket};
pub use data_parallel::{chunk_sizes, DataParallel};
pub use ddp::{Ddp, DdpOptions, JoinOptions, Unhooked};
pub use error::{DdpError, Result};
pub use powersgd::{PowerSgd, PowerSgdOptions};
