//! tandem: distributed data-parallel training in Rust, with PyTorch's semantics.
//!
//! This crate is the facade a training binary depends on: `tandem::init()` joins the process
//! group the launcher (or torchrun, Slurm, mpirun) described, and the sub-crates are re-exported
//! under short names. It also holds the `tandem` command line's training job.
pub use tandem_ckpt as ckpt;
pub use tandem_comm as comm;
pub use tandem_comm::init;
pub use tandem_data as data;
pub use tandem_ddp as ddp;
pub use tandem_launch as launch;

pub mod train;
