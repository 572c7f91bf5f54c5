//! The one error type of this crate: every variant names the rank and value at fault.

#[derive(Debug, thiserror::Error)]
pub enum PartialFcError {
    /// A configuration that arcface_torch does not define or that cannot work.
    #[error("PartialFc config: {0}")]
    Config(String),

    /// A rank's batch does not fit the others' or the configuration.
    #[error("PartialFc: rank {rank}: {what}")]
    Batch { rank: usize, what: String },

    /// A label outside `0..classes`.
    #[error(
        "PartialFc: rank {rank}: label {label} at batch index {index} is outside 0..{classes}"
    )]
    Label { rank: usize, index: usize, label: i64, classes: usize },

    /// A collective failed (a peer died, timed out, or the group broke).
    #[error("PartialFc: rank {rank}: {op}: {reason}")]
    Comm { rank: usize, op: &'static str, reason: String },

    /// A shard state dict that does not fit this head, or rows no shard holds.
    #[error("PartialFc state: {0}")]
    State(String),

    /// A tensor operation failed.
    #[error("PartialFc: {0}")]
    Candle(#[from] candle_core::Error),
}
