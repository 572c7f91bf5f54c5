//! The errors of tandem-nn: state dicts that do not fit, tensors that cannot become checkpoint
//! data, bad layer options.
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NnError {
    #[error("tensor engine: {0}")]
    Candle(#[from] candle_core::Error),

    /// Reading or writing a checkpoint file (the error names the file).
    #[error(transparent)]
    Checkpoint(#[from] tandem_ckpt::CkptError),

    #[error("invalid option {what}: {why}")]
    InvalidOption { what: &'static str, why: String },

    /// A strict `load_state_dict` found keys that do not fit; nothing was written.
    #[error(
        "state dict does not fit the model: missing keys {missing:?}, unexpected keys \
         {unexpected:?}, shape mismatches {mismatched:?}"
    )]
    StateDictMismatch { missing: Vec<String>, unexpected: Vec<String>, mismatched: Vec<String> },

    /// A tensor that cannot move between candle and a checkpoint (dtype, byte order).
    #[error("tensor {}: {reason}", key.as_deref().map_or("(unnamed)".to_string(), |k| format!("`{k}`")))]
    TensorConversion { key: Option<String>, reason: String },

    /// A device that cannot be opened (a `map_location` naming a missing GPU, ...).
    #[error("CUDA: {0}")]
    Device(String),
}

pub type Result<T, E = NnError> = std::result::Result<T, E>;
