//! The one error type of this crate. Every variant names what is at fault: the environment
//! variable, the store key, or the operation with its sequence number and the peer rank.
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A collective finished but its result is not what it must be (`ProcessGroup::self_check`).
    #[error("{op}: wrong result: {what}")]
    WrongResult { op: String, what: String },
    /// A bad or inconsistent environment variable (RANK >= WORLD_SIZE, unparsable numbers, ...).
    #[error("environment variable {var}={value:?}: {reason}")]
    Env { var: String, value: String, reason: String },

    /// The rendezvous store could not be reached (or bound) before the timeout.
    #[error(
        "cannot reach the rendezvous store at {addr} (set by {var}) within {after:?}: {reason}"
    )]
    StoreUnreachable { addr: String, var: String, after: Duration, reason: String },

    /// Something answered at the store's address, but not the expected store protocol.
    #[error("the rendezvous store at {addr} (set by {var}): {reason}")]
    StoreHandshake { addr: String, var: String, reason: String },

    /// The store (or a peer) belongs to another job. (The refusal carries nothing of the
    /// server's: a stranger learns no run id.)
    #[error("{addr} refused run {ours:?}: another job (another run id) is using the same MASTER_ADDR:MASTER_PORT")]
    RunIdMismatch { addr: String, ours: String },

    /// A store or a peer and this process do not share the job's secret.
    #[error("{addr} ({var}): the job refused this connection: {reason}")]
    AuthFailed { addr: String, var: String, reason: String },

    /// The job secret file could not be read or is not private.
    #[error("job secret file {path}: {reason}")]
    SecretFile { path: String, reason: String },
    /// The job secret variable `var` holds no valid secret.
    #[error("{var}: {reason}")]
    SecretVar { var: &'static str, reason: String },
    /// A secret of the wrong length or form.
    #[error("job secret: {0}")]
    SecretInvalid(String),
    /// The system's random source failed.
    #[error("cannot draw random bytes: {0}")]
    Random(String),

    /// A store operation did not complete in time.
    #[error("store {op} {key:?}: timed out after {after:?}")]
    StoreTimeout { op: &'static str, key: String, after: Duration },

    /// An I/O failure talking to the store.
    #[error("store {op} {key:?}: {reason}")]
    StoreIo { op: &'static str, key: String, reason: String },

    /// A malformed message on the wire.
    #[error("protocol error from {from}: {reason}")]
    Protocol { from: String, reason: String },

    /// A length prefix above the bound: refused before allocating.
    #[error("frame of {len} bytes from {from} exceeds the {max}-byte limit (corrupt stream or not a tandem peer)")]
    FrameTooLarge { len: u64, max: usize, from: String },

    /// A peer closed its connection or failed during a collective.
    #[error("{op} #{seq}: peer rank {peer} {reason}")]
    Peer { op: &'static str, seq: u64, peer: usize, reason: String },

    /// A peer made no progress for the timeout (stalled, hung or dead).
    #[error("{op} #{seq}: no progress from peer rank {peer} for {after:?} (peer stalled, dead, or called a different collective)")]
    Timeout { op: &'static str, seq: u64, peer: usize, after: Duration },

    /// Ranks called different collectives (detected with TANDEM_DEBUG=detail).
    #[error("{op} #{seq}: collective desync: rank {rank_a} called {call_a} but rank {rank_b} called {call_b}")]
    Desync {
        op: &'static str,
        seq: u64,
        rank_a: usize,
        call_a: String,
        rank_b: usize,
        call_b: String,
    },

    /// The group failed earlier; collectives on it cannot resume in a consistent state.
    #[error("{op} #{seq}: this process group already failed ({first}); create a new one")]
    Broken { op: &'static str, seq: u64, first: String },

    /// A call waited its turn behind this rank's earlier calls on the group, and none of them
    /// finished within the group timeout (an earlier async call is stuck).
    #[error("{op}: not started: this rank's {ahead} earlier call(s) on the group made no progress for {waited:?} (an earlier async call is stuck or its peers never joined it); the group is now broken")]
    QueueTimeout { op: &'static str, waited: Duration, ahead: u64 },

    /// An object collective's payload: this rank's object did not encode, or another rank's
    /// did not decode as the type this rank asked for.
    #[error("{op}: the object of rank {rank} {reason}")]
    Object { op: &'static str, rank: usize, reason: String },

    /// `monitored_barrier`: the ranks that did not arrive in time (every one of them).
    #[error("monitored_barrier #{seq}: rank(s) {} did not arrive within {after:?}", list(missing))]
    BarrierMissing { seq: u64, missing: Vec<usize>, after: Duration },

    /// A caller error (wrong buffer size, rank out of range, ...).
    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },

    /// Setting up the transport or rendezvous failed.
    #[error("rendezvous of group {group}: {reason}")]
    Rendezvous { group: String, reason: String },

    /// A shared library (NCCL, the CUDA runtime) could not be loaded.
    #[error("cannot load {library}{}: {hint}", if tried.is_empty() { String::new() } else { format!(" (tried {tried})") })]
    Library { library: String, tried: String, hint: String },

    /// NCCL or the CUDA runtime reported an error (or a device collective timed out).
    #[error("{op}: {reason}")]
    Nccl { op: &'static str, reason: String },

    /// A background operation panicked (a bug; reported instead of propagating the panic).
    #[error("{op}: internal error: {reason}")]
    Internal { op: &'static str, reason: String },
}

fn list(ranks: &[usize]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

impl CommError {
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument { op, reason: reason.into() }
    }
    pub(crate) fn env(var: &str, value: &str, reason: impl Into<String>) -> Self {
        CommError::Env { var: var.to_string(), value: value.to_string(), reason: reason.into() }
    }
    pub(crate) fn rendezvous(group: &str, reason: impl Into<String>) -> Self {
        CommError::Rendezvous { group: group.to_string(), reason: reason.into() }
    }
}
