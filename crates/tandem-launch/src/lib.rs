//! tandem-launch: a torchrun-compatible supervisor that spawns, watches, restarts and stops the
//! worker processes of one node. Knows nothing of collectives or training: it only sets the
//! environment that `tandem_comm::init` reads (RANK, WORLD_SIZE, MASTER_ADDR, ...).
//!
//! ```no_run
//! let mut cfg = tandem_launch::LaunchConfig::new("my-trainer", ["--epochs", "3"]);
//! cfg.nproc_per_node = tandem_launch::NprocPerNode::Count(4);
//! let outcome = tandem_launch::launch(&cfg)?;
//! std::process::exit(outcome.exit_code);
//! # Ok::<(), tandem_launch::LaunchError>(())
//! ```
#[cfg(feature = "clap")]
mod args;
mod config;
mod env;
mod error;
mod events;
mod live;
mod nodes;
mod outcome;
mod output;
mod port;
mod reaper;
mod signals;
mod supervisor;
mod worker;

#[cfg(feature = "clap")]
pub use args::LaunchArgs;
pub use config::{
    available_cores, parse_local_ranks, parse_nnodes, random_run_id, LaunchConfig, Nnodes,
    NprocPerNode, StreamSpec, Streams,
};
pub use env::{threads_per_worker, JobShape, THREAD_VARS};
pub use error::LaunchError;
pub use events::{EventSink, LaunchEvent};
pub use outcome::{LaunchOutcome, WorkerExit, WorkerFailure};
pub use port::pick_master_port;
pub use reaper::WATCHDOG_NAME;
pub use supervisor::launch;
