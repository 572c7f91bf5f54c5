//! tandem-dist-nn: layers whose forward and backward talk to the other ranks, over any
//! [`tandem_comm::Collectives`] (a process group, a live world, threads in one process):
//!
//! - differentiable collectives ([`all_gather`], [`all_reduce_sum`]: PyTorch's
//!   `torch.distributed.nn.functional`), what PartialFC gathers its embeddings with;
//! - SyncBatchNorm: [`convert_sync_batchnorm`] makes every `tandem_nn::FastBatchNorm2d` of a
//!   model reduce its batch statistics over a group ([`CommStats`]), as PyTorch's
//!   `nn.SyncBatchNorm.convert_sync_batchnorm` does.
//!
//! tandem-nn below it knows no process groups; models and kernels build without the comm stack.
mod all_gather;
mod all_reduce;
mod sync_batch_norm;

pub use all_gather::{all_gather, GatherGrad};
pub use all_reduce::all_reduce_sum;
pub use sync_batch_norm::{convert_sync_batchnorm, CommStats};
