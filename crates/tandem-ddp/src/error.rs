//! The errors of tandem-ddp's wrappers (Ddp, DataParallel, models, conversion).
use thiserror::Error;

/// A failure reported by the communication layer, kept opaque so the reducer stays
/// independent of which collective backend carried it.
pub type CommSource = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, Error)]
pub enum DdpError {
    #[error("tensor engine: {0}")]
    Candle(#[from] candle_core::Error),

    #[error("collective `{op}` failed on rank {rank}: {source}")]
    Comm {
        op: &'static str,
        rank: usize,
        #[source]
        source: CommSource,
    },

    #[error(
        "parameter mismatch across ranks: {what} (rank {rank_a}: {a}; rank {rank_b}: {b}); \
         every rank must build the same model before wrapping it in Ddp"
    )]
    ParamMismatch { what: String, rank_a: usize, a: String, rank_b: usize, b: String },

    #[error(
        "parameter(s) {names:?} received no gradient in this backward (rank {rank}). \
         If they are unused on purpose (a branch not taken, a frozen head), construct Ddp with \
         DdpOptions {{ find_unused_parameters: true, .. }} so they count as zero gradients; \
         otherwise make the loss depend on them"
    )]
    UnusedParameters { rank: usize, names: Vec<String> },

    #[error("parameter `{name}` has dtype {dtype:?}; the reducer handles f32 parameters only")]
    UnsupportedDtype { name: String, dtype: candle_core::DType },

    #[error("parameter `{name}` got its gradient twice in one backward (the same forward view was used twice?)")]
    DoubleReady { name: String },

    #[error("invalid option {what}: {why}")]
    InvalidOption { what: &'static str, why: String },

    #[error("state dict: {0}")]
    StateDict(String),

    #[error("the communication thread stopped unexpectedly")]
    CommThreadGone,

    #[error("DataParallel: {0}")]
    DataParallel(String),
}

pub type Result<T, E = DdpError> = std::result::Result<T, E>;

impl DdpError {
    pub(crate) fn comm(op: &'static str, rank: usize, source: impl Into<CommSource>) -> Self {
        DdpError::Comm { op, rank, source: source.into() }
    }
}
