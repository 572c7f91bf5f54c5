//! The crate's error type. Every variant names the file (and where it helps the key or global)
//! at fault, so a CLI can print one clear line.
use std::path::PathBuf;

use crate::keys::LoadReport;

#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    /// (The io error is part of the message, not a `source`, so `{:#}` chains print it once.)
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    /// The file is not a torch.save / safetensors file we can read, or its structure is broken.
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    /// The pickle names a global outside the weights_only allowlist; we never import it.
    #[error("{path}: pickle references `{global}`, which is not in the weights_only allowlist (tandem never executes pickle code)")]
    ForbiddenGlobal { path: PathBuf, global: String },
    /// A value cannot be written (e.g. a dtype safetensors or torch cannot hold, a bad view).
    #[error("cannot save {what}: {msg}")]
    Unsupported { what: String, msg: String },
    /// A strict `load_state_dict` found missing, unexpected or mis-shaped keys.
    #[error("state_dict does not fit the model:\n{0}")]
    StateDictMismatch(Box<LoadReport>),
    /// The source value holds no state dict (no dict of tensors at any known container key).
    #[error("no state dict found: {0}")]
    NoStateDict(String),
    /// A training checkpoint (`TrainingCheckpoint`) lacks a field or holds the wrong type.
    #[error("training checkpoint field `{field}`: {problem}")]
    TrainingField { field: String, problem: String },
    #[error("invalid map_location `{0}`: expected `cpu` or `cuda:N`")]
    MapLocation(String),
    /// A path into a value tree (`ckpt/model`) names a key that is not there.
    #[error("{path}: no `{missing}` (keys there: {})", there.join(", "))]
    NoKey { path: String, missing: String, there: Vec<String> },
}

impl CkptError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CkptError::Io { path: path.into(), error: source }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        CkptError::Format { path: path.into(), msg: msg.into() }
    }
}

pub type Result<T, E = CkptError> = std::result::Result<T, E>;
