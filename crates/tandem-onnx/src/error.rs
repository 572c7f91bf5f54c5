//! Why an export failed, naming the model, the state-dict key and the shapes involved.
use tandem_ckpt::CkptError;

#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("{model}: the state dict has no `{key}` (keys not used so far: {present})")]
    MissingKey { model: &'static str, key: String, present: String },
    #[error("{model}: `{key}` has shape {got:?}, expected {expected}")]
    Shape { model: &'static str, key: String, got: Vec<usize>, expected: String },
    #[error(
        "{model}: the state dict has keys the model does not use: {keys} (a checkpoint of \
         another model? pick it with --model)"
    )]
    UnexpectedKeys { model: &'static str, keys: String },
    #[error("{model}: `{key}` is {dtype}, not a floating-point tensor")]
    NotFloat { model: &'static str, key: String, dtype: &'static str },
    #[error(
        "the model's weights are {bytes} bytes; one ONNX file holds at most 2 GiB (external \
         data files are not supported)"
    )]
    TooLarge { bytes: usize },
    #[error(transparent)]
    Write(#[from] CkptError),
    #[error("{path}: {reason}")]
    Read { path: String, reason: String },
}

pub type Result<T> = std::result::Result<T, OnnxError>;
