//! tandem: distributed data-parallel training in Rust, with PyTorch's semantics.
//!
//! This crate is the facade a training binary depends on: `tandem::init()` joins the process
//! group the launcher (or torchrun, Slurm, mpirun) described, and the sub-crates are re-exported
//! under short names. It also holds the `tandem` command line's training job.
pub use tandem_ckpt as ckpt;
pub use tandem_comm as comm;
pub use tandem_data as data;
pub use tandem_ddp as ddp;
pub use tandem_launch as launch;

pub mod train;

/// Joins the process group the environment describes (`tandem_comm::init`: launcher, torchrun,
/// Slurm, mpirun, or a world of one) and tunes this process's malloc to keep freed tensor
/// memory for reuse ([`ddp::tune_allocator`]; `TANDEM_MALLOC=system` skips that), which makes
/// CPU training steps markedly faster with candle.
pub fn init() -> Result<comm::ProcessGroup, comm::CommError> {
    tandem_ddp::tune_allocator();
    tandem_comm::init()
}
