//! Errors of the launcher itself (bad settings, a program that cannot start, an unwritable log
//! directory). A worker that fails is not an error: it is a `LaunchOutcome` with an exit code.
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{flag}: {message}")]
    Config { flag: &'static str, message: String },

    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        rank: u32,
        program: String,
        #[source]
        source: io::Error,
    },

    #[error("cannot create log file {}: {source}", path.display())]
    LogFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] io::Error),

    #[error("cannot wait for rank {rank}: {source}")]
    Wait {
        rank: u32,
        #[source]
        source: io::Error,
    },

    #[error("no free port for MASTER_PORT on {addr}: {source}")]
    NoFreePort {
        addr: String,
        #[source]
        source: io::Error,
    },
}

impl LaunchError {
    pub(crate) fn config(flag: &'static str, message: impl Into<String>) -> Self {
        LaunchError::Config { flag, message: message.into() }
    }
}
