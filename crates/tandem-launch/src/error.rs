//! Errors of the launcher itself (bad settings, a program that cannot start, an unwritable log
//! directory). A worker that fails is not an error: it is a `LaunchOutcome` with an exit code.
//! The OS error is part of each message and not a `source()`, so an error chain printed whole
//! (`{:#}`) names it once.
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{flag}: {message}")]
    Config { flag: &'static str, message: String },

    #[error("cannot start rank {rank} ({program}): {error}")]
    Spawn { rank: u32, program: String, error: io::Error },

    #[error("cannot create log file {}: {error}", path.display())]
    LogFile { path: PathBuf, error: io::Error },

    #[error("cannot install signal handlers: {0}")]
    Signals(io::Error),

    #[error("cannot wait for rank {rank}: {error}")]
    Wait { rank: u32, error: io::Error },

    /// The launchers of a multi-node job could not agree on a round, or one of them is gone.
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    #[error("no free port for MASTER_PORT on {addr}: {error}")]
    NoFreePort { addr: String, error: io::Error },
}

impl LaunchError {
    pub(crate) fn config(flag: &'static str, message: impl Into<String>) -> Self {
        LaunchError::Config { flag, message: message.into() }
    }
}
