use tandem_comm::CommError;

/// What can go wrong sharding a model or running a sharded step. Each names the parameter,
/// unit or option at fault.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// Units that claim the same parameter (FSDP2 would nest them; tandem's units are one level
    /// under the root).
    #[error(
        "parameter `{param}` is in unit `{first}` and in unit `{second}`: units must not overlap"
    )]
    OverlappingUnits { param: String, first: String, second: String },
    /// A parameter outside every unit while the root is not sharded.
    #[error(
        "parameter `{param}` is in no unit and the root is not sharded (FsdpOptions::shard_root): \
         add a unit for it or shard the root"
    )]
    Unassigned { param: String },
    /// A unit that claims no parameter (a typo in its prefix, most likely).
    #[error("unit `{unit}` matches no parameter")]
    EmptyUnit { unit: String },
    /// A unit name that was not declared.
    #[error("no unit named `{unit}` (the units are {known})")]
    UnknownUnit { unit: String, known: String },
    /// A parameter FSDP cannot shard.
    #[error("parameter `{param}`: {why}")]
    Unsupported { param: String, why: String },
    /// An option that makes no sense.
    #[error("invalid option {what}: {why}")]
    InvalidOption { what: &'static str, why: String },
    /// Calls out of order (a unit outside `Fsdp::forward`, a backward without a forward).
    #[error("{0}")]
    Order(String),
    /// A gradient for a parameter where none can be: read outside its unit.
    #[error(
        "parameter `{param}` of unit `{unit}` got a gradient outside that unit's forward: a \
         parameter read by several units belongs to their common parent (the root), as in FSDP2"
    )]
    ReadOutsideUnit { param: String, unit: String },
    /// A collective failed.
    #[error("{op}: {source}")]
    Comm {
        op: &'static str,
        #[source]
        source: Box<CommError>,
    },
    /// Ranks that were given different models (found before any parameter moves).
    #[error("rank {rank} and rank 0 were given different models: {why}")]
    ModelsDiffer { rank: usize, why: String },
    /// Clipping the sharded gradients failed (a bad `max_norm`, a non-finite norm, a failed
    /// all-reduce).
    #[error(transparent)]
    Clip(Box<tandem_optim::OptimError>),
    /// A weights file that cannot be read, or that does not fit the model (missing or
    /// unknown keys, another shape).
    #[error("{}: {why}", file.display())]
    Weights { file: std::path::PathBuf, why: String },
    /// A weights file that cannot be read (tandem-ckpt's error names it).
    #[error(transparent)]
    Read(Box<tandem_ckpt::CkptError>),
    /// A tensor operation failed.
    #[error("{context}: {source}")]
    Tensor {
        context: String,
        #[source]
        source: Box<candle_core::Error>,
    },
}

pub type Result<T, E = FsdpError> = std::result::Result<T, E>;

/// Wraps a candle error with what was being done.
pub(crate) fn tensor(context: impl Into<String>) -> impl FnOnce(candle_core::Error) -> FsdpError {
    let context = context.into();
    move |source| FsdpError::Tensor { context, source: Box::new(source) }
}

pub(crate) fn comm(op: &'static str) -> impl FnOnce(CommError) -> FsdpError {
    move |source| FsdpError::Comm { op, source: Box::new(source) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Live recovery tells a lost peer from other failures by finding the `CommError` in the
    /// chain: a boxed one counts.
    #[test]
    fn a_peer_failure_inside_is_found_by_live_recovery() {
        let lost =
            CommError::Peer { op: "reduce_scatter", seq: 3, peer: 1, reason: "closed".into() };
        assert!(tandem_comm::live::is_peer_failure(&comm("reduce_scatter")(lost)));
        let other = FsdpError::Order("unit `b` ran outside Fsdp::forward".into());
        assert!(!tandem_comm::live::is_peer_failure(&other));
    }
}
