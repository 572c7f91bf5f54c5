//! tandem-comm: the rendezvous store, process-group initialisation and CPU collectives
//! (TCP ring and shared memory). Owns bytes, dtypes and ranks; knows nothing of tensors,
//! candle, models or checkpoints.
//!
//! ```no_run
//! let pg = tandem_comm::init()?;                       // torchrun / Slurm / OpenMPI / world of one
//! let mut grads = vec![1.0f32; 1024];
//! pg.all_reduce(&mut grads, tandem_comm::ReduceOp::Avg)?;
//! pg.barrier()?;
//! # Ok::<(), tandem_comm::CommError>(())
//! ```
mod agent_store;
pub mod auth;
mod collectives;
mod diagnostics;
mod dyn_collectives;
mod element;
mod env;
mod error;
mod file_init;
mod frame;
mod group;
pub mod live;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
mod net;
mod order;
#[doc(hidden)]
pub mod procfs;
mod rendezvous;
pub mod slurm;
mod store;
mod transport;
mod work;

pub use auth::JobSecret;
pub use diagnostics::debug_line;
pub use dyn_collectives::{Collectives, CommSource, LocalGroup, SingleProcess};
pub use element::{Element, ReduceOp, WireType};
pub use env::{debug_level, job_id_from_env, DebugLevel, InitMethod, InitOptions};
pub use error::CommError;
pub use frame::MAX_FRAME;
pub use group::{P2PKind, P2POp, ProcessGroup};
pub use live::{LiveGroup, LiveJobState, LiveOptions, LiveStoreAt};
pub use mesh::DeviceMesh;
pub use net::host_port;
pub use rendezvous::init_with;
#[doc(hidden)]
pub use store::fuzz_store_session;
pub use store::{Store, StoreServer, StoreWire, HANDSHAKE_LIMIT, SERVER_ID_KEY};
#[doc(hidden)]
pub use transport::fuzz_mesh_hello;
pub use transport::TransportKind;
pub use work::Work;

/// Initialises the default group from the environment (torchrun's `env://` variables, Slurm,
/// OpenMPI); with none of them, a world of one that needs no network.
pub fn init() -> Result<ProcessGroup, CommError> {
    init_from(&InitMethod::Env)
}

/// Initialises the default group from an explicit method, e.g.
/// `InitMethod::tcp("tcp://10.0.0.1:29500", rank, world_size)`. Options come from the
/// environment (TANDEM_TRANSPORT, TANDEM_TIMEOUT, ...); see `init_with` to set them in code.
pub fn init_from(method: &InitMethod) -> Result<ProcessGroup, CommError> {
    init_with(method, &InitOptions::from_env()?)
}
