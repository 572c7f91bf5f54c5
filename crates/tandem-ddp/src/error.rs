//! The errors of tandem-ddp's wrappers (Ddp, DataParallel) and reducer.
use tandem_comm::CommSource;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum DdpError {
    #[error("tensor engine: {0}")]
    Candle(#[from] candle_core::Error),

    /// The model: a state dict that does not fit, a tensor that cannot be converted, ...
    #[error(transparent)]
    Nn(#[from] tandem_nn::NnError),

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
        "register_comm_hook: rank {rank} registered `{ours}` but rank {other} registered \
         `{theirs}`; every rank must register the same hook"
    )]
    CommHookMismatch { rank: usize, ours: String, other: usize, theirs: String },

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

    /// A gradient handed to the reducer has the wrong number of elements.
    #[error("gradient of parameter #{index} (`{name}`) has {got} elements; the parameter has {expected}")]
    GradientLength { index: usize, name: String, got: usize, expected: usize },

    /// Rank 0's bucket order (broadcast after the first step) is not a permutation of the
    /// parameters: the ranks do not hold the same model, or the broadcast was corrupted.
    #[error("rank 0's gradient arrival order ({got} entries) is not a permutation of the {expected} parameters")]
    BucketOrder { got: usize, expected: usize },

    #[error("the communication thread stopped unexpectedly")]
    CommThreadGone,

    /// A device that cannot be opened, or a CUDA tensor the NCCL path cannot hand to NCCL
    /// (not f32, not contiguous, ...).
    #[error("CUDA: {0}")]
    Device(String),

    #[error("DataParallel: {0}")]
    DataParallel(String),
}

pub type Result<T, E = DdpError> = std::result::Result<T, E>;

impl DdpError {
    pub(crate) fn comm(op: &'static str, rank: usize, source: impl Into<CommSource>) -> Self {
        DdpError::Comm { op, rank, source: source.into() }
    }
}
