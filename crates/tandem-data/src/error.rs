//! The crate's error type: every variant names the file, field, rank or argument at fault.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("num_replicas must be at least 1 (got 0)")]
    NoReplicas,
    #[error("rank {rank} is out of range for num_replicas {num_replicas} (valid ranks are 0..{num_replicas})")]
    InvalidRank { rank: usize, num_replicas: usize },
    #[error("sampler state: no {kind} `{key}`")]
    StateField { key: &'static str, kind: &'static str },
    #[error("sampler state does not fit this sampler: saved {field} = {saved}, this sampler has {current}")]
    StateMismatch { field: &'static str, saved: String, current: String },
    #[error("cannot advance the sampler by {requested}: only {remaining} samples are left in epoch {epoch}")]
    AdvancePastEnd { requested: usize, remaining: usize, epoch: u64 },
    #[error("{what} must be at least 1 (got 0)")]
    ZeroArgument { what: &'static str },
    #[error("the sampler covers {sampler_len} samples but the dataset has {dataset_len}")]
    SamplerDatasetMismatch { sampler_len: usize, dataset_len: usize },
    #[error("index {index} is out of range for a dataset of {len} examples")]
    IndexOutOfRange { index: usize, len: usize },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: {reason}", path.display())]
    Malformed { path: PathBuf, reason: String },
    #[error("embedded {name} data is malformed: {reason}")]
    Embedded { name: &'static str, reason: String },
    #[error("bad dataset spec {spec:?}: {reason} (expected \"digits\", \"mnist:DIR\", \"cifar10:DIR\", \"synthetic-cifar[:N]\" or \"synthetic[:N[:DIM[:CLASSES]]]\")")]
    BadSpec { spec: String, reason: String },
    #[error("example {index} has {got} features, expected {expected}")]
    FeatureLength { index: usize, got: usize, expected: usize },
    #[error("example {index} has label {label}, outside 0..{num_classes}")]
    LabelOutOfRange { index: usize, label: i64, num_classes: usize },
    #[error("collating a batch into a tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("data loader worker {worker} stopped unexpectedly{}", detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default())]
    WorkerDied { worker: usize, detail: Option<String> },
    #[error("all-reducing evaluation metrics: {0}")]
    Collective(#[from] tandem_comm::CommError),
}
