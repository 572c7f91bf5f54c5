//! The crate's one error: what failed, in the words of the option, file, rank or step at
//! fault, with the typed error underneath as its `source()` (a collective's `CommError`, a
//! checkpoint file's `CkptError`, the optimizer's `OptimError`, ...), so callers can still ask
//! what kind of failure it was (`tandem_comm::live::is_peer_failure` walks the chain).
use std::error::Error as StdError;
use std::ops::Range;
use std::path::PathBuf;

use tandem_ckpt::CkptError;
use tandem_comm::CommError;

/// A failure of the training loop, its checkpoints, its state or live recovery.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Something that cannot work, said in full: options that do not go together (`--model
    /// cnn --data rec:...`), a saved state or a peer's message that does not fit, ...
    #[error("{0}")]
    Invalid(String),
    /// `what` failed because of `source`.
    #[error("{what}")]
    Failed {
        what: String,
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// An option at fault, named by its key in the options' terms
    /// (`lr_scheduler`, `init_from`: the `--config` keys), with the value at fault when it is
    /// worth showing. Shown as `key=value: what`; a binary names its own flag for the key
    /// ([`TrainError::naming_option`]).
    #[error("{}", option_line(key, value.as_deref(), what.as_deref(), |k| k.to_string(), "="))]
    Option {
        key: &'static str,
        value: Option<String>,
        /// What is wrong with it, when no `source` says.
        what: Option<String>,
        #[source]
        source: Option<Box<dyn StdError + Send + Sync>>,
    },
    /// A file or directory could not be read or written (`what`: `creating`, `reading`, ...).
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint could not be written or read (the file, the directory and why).
    #[error(transparent)]
    Checkpoint(Box<tandem_checkpoint::CheckpointError>),
    /// A field of a saved training state that does not fit this run.
    #[error("{}: field `{field}`: {problem}", path.display())]
    Field { path: PathBuf, field: &'static str, problem: String },
    /// A collective failed while `what` was being done (a dead peer during a save, a mirror,
    /// a re-split).
    #[error("{what}: {source}")]
    Comm {
        what: String,
        // Not boxed: `source()` must give the `CommError` itself for `is_peer_failure` to
        // find it (a `Box<CommError>` is another type to a downcast).
        #[source]
        source: CommError,
    },
    /// One phase of an optimizer step failed.
    #[error(transparent)]
    Step(#[from] tandem_optim::StepError),
    /// A learning-rate schedule could not be built or resumed.
    #[error(transparent)]
    Schedule(Box<tandem_optim::lr_scheduler::schedule::ScheduleError>),
    /// A sharded optimizer already holds every entry on its owner; a part cannot take some.
    #[error("a sharded optimizer cannot hand entries to the state's parts")]
    ShardedWithParts,
    #[error("live recovery: this process was not started by `tandem run --live-recovery` ({var} is not set)")]
    NotLive { var: &'static str },
    /// A part's re-split needed keys no surviving rank holds, and reading them from the last
    /// checkpoint failed.
    #[error("{part}: reading keys {keys:?} that no rank holds")]
    Fill {
        part: &'static str,
        keys: Range<usize>,
        /// A `TrainError`, boxed as `dyn Error` so that the chain shows it (a
        /// `Box<TrainError>` would skip to its source).
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// An error of a recipe's own, kept whole and typed (its `Display` and `source()` are the
    /// error's: a caller may downcast it).
    #[error(transparent)]
    Recipe(Box<dyn StdError + Send + Sync>),
    /// A line of a metrics file that is not a record.
    #[error("{}:{line}: not a metrics record: {source}", path.display())]
    Record {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
}

impl From<tandem_checkpoint::CheckpointError> for TrainError {
    fn from(e: tandem_checkpoint::CheckpointError) -> Self {
        TrainError::Checkpoint(Box::new(e))
    }
}

impl From<tandem_optim::lr_scheduler::schedule::ScheduleError> for TrainError {
    fn from(e: tandem_optim::lr_scheduler::schedule::ScheduleError) -> Self {
        TrainError::Schedule(Box::new(e))
    }
}

/// `name(key)` with the value and what is wrong: `lr_scheduler=poly: unknown schedule`.
fn option_line(
    key: &str,
    value: Option<&str>,
    what: Option<&str>,
    name: impl Fn(&str) -> String,
    joiner: &str,
) -> String {
    let mut line = name(key);
    if let Some(v) = value {
        line.push_str(joiner);
        line.push_str(v);
    }
    if let Some(w) = what {
        line.push_str(": ");
        line.push_str(w);
    }
    line
}

/// `text` with each `` `word` `` that `flag` knows as a setting replaced by what it gives.
fn naming_settings(text: &str, flag: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('`') {
        let Some(len) = rest[open + 1..].find('`') else { break };
        let quoted = &rest[open..open + len + 2];
        out.push_str(&rest[..open]);
        match flag(&quoted[1..quoted.len() - 1]) {
            Some(named) => out.push_str(&named),
            None => out.push_str(quoted),
        }
        rest = &rest[open + len + 2..];
    }
    out.push_str(rest);
    out
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl TrainError {
    pub fn invalid(why: impl Into<String>) -> Self {
        TrainError::Invalid(why.into())
    }

    /// A collective's failure while `what` was being done, kept whole (a dead peer in it is a
    /// peer failure).
    pub fn comm(what: impl Into<String>, source: CommError) -> Self {
        TrainError::Comm { what: what.into(), source }
    }

    /// Option `key` (its `value`, when shown) cannot work: `what` says why.
    pub fn option(key: &'static str, value: Option<String>, what: impl Into<String>) -> Self {
        TrainError::Option { key, value, what: Some(what.into()), source: None }
    }

    /// This error's own line (not its causes') as a command line reads it: the option named
    /// as `flag(key)` with its value after a space (`--lr-scheduler poly: ...`), and every other
    /// setting its text names in backticks (`` `steps` ``) that `flag` knows likewise. `flag`
    /// gives `None` for a word that is not a setting.
    pub fn naming_option(&self, flag: impl Fn(&str) -> Option<String>) -> String {
        match self {
            TrainError::Option { key, value, what, .. } => {
                let what = what.as_deref().map(|w| naming_settings(w, &flag));
                let name = |k: &str| flag(k).unwrap_or_else(|| k.to_string());
                option_line(key, value.as_deref(), what.as_deref(), name, " ")
            }
            other => other.to_string(),
        }
    }

    /// Whether the chain holds a dead or silent peer (live recovery regroups on those).
    pub fn is_peer_failure(&self) -> bool {
        tandem_comm::live::is_peer_failure(self)
    }

    /// The error and its causes on one line, `outer: inner: ...` (a cause whose text the line
    /// already holds is left out).
    pub fn chain_text(&self) -> String {
        let mut line = self.to_string();
        let mut cur: Option<&(dyn StdError + 'static)> = self.source();
        while let Some(e) = cur {
            let text = e.to_string();
            if !line.contains(&text) {
                line = format!("{line}: {text}");
            }
            cur = e.source();
        }
        line
    }

    /// The innermost error's text (the root cause).
    pub fn root_cause(&self) -> String {
        let mut cur: &(dyn StdError + 'static) = self;
        while let Some(next) = cur.source() {
            cur = next;
        }
        cur.to_string()
    }
}

/// `.context(what)` on any result: the error becomes the source of a [`TrainError::Failed`]
/// saying what was being done.
pub trait Context<T> {
    fn context(self, what: impl Into<String>) -> Result<T>;
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
    /// The error as the failure of option `key` (`value`: the value at fault, when shown).
    fn option(self, key: &'static str, value: Option<String>) -> Result<T>;
}

impl<T, E: StdError + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| TrainError::Failed { what: what.into(), source: Box::new(e) })
    }
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| TrainError::Failed { what: what().into(), source: Box::new(e) })
    }
    fn option(self, key: &'static str, value: Option<String>) -> Result<T> {
        self.map_err(|e| TrainError::Option { key, value, what: None, source: Some(Box::new(e)) })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| TrainError::Invalid(what.into()))
    }
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| TrainError::Invalid(what().into()))
    }
    fn option(self, key: &'static str, value: Option<String>) -> Result<T> {
        self.ok_or(TrainError::Option { key, value, what: None, source: None })
    }
}

/// Errors of the layers below, kept whole as the source of a [`TrainError::Failed`].
macro_rules! failed_from {
    ($($ty:ty => $what:literal),* $(,)?) => {$(
        impl From<$ty> for TrainError {
            fn from(e: $ty) -> Self {
                TrainError::Failed { what: $what.into(), source: Box::new(e) }
            }
        }
    )*};
}

failed_from! {
    candle_core::Error => "a tensor operation",
    CommError => "a collective",
    CkptError => "a checkpoint file",
    tandem_data::DataError => "the data",
    tandem_nn::NnError => "the model",
    tandem_optim::OptimError => "the optimizer, its schedule or its GradScaler",
    tandem_ddp::DdpError => "Ddp",
    tandem_fsdp::FsdpError => "Fsdp",
    std::io::Error => "I/O",
}

/// `return Err(TrainError::Invalid(format!(...)))`, as `anyhow::bail!` for a recipe.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::TrainError::Invalid(format!($($arg)*)))
    };
}
pub(crate) use crate::bail;

/// `return Err(TrainError::option(key, value, format!(...)))`: option `key` cannot work.
#[macro_export]
macro_rules! bail_option {
    ($key:literal, $value:expr, $($arg:tt)*) => {
        return Err($crate::TrainError::option($key, $value, format!($($arg)*)))
    };
}
#[allow(unused_imports)]
pub(crate) use crate::bail_option;

/// A collective's failure while `what` was being done, kept whole (a dead peer in it is a
/// peer failure).
pub(crate) fn comm(what: impl Into<String>) -> impl FnOnce(CommError) -> TrainError {
    let what = what.into();
    move |source| TrainError::comm(what, source)
}

/// An I/O failure on `path` while `what` (`creating`, `reading`, ...) was being done.
pub fn io(what: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.to_path_buf();
    move |source| TrainError::Io { what, path, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_keeps_the_typed_source_and_the_root_cause() {
        let timeout = tandem_comm::CommError::Timeout {
            op: "all_reduce",
            seq: 9,
            peer: 1,
            after: std::time::Duration::from_secs(3),
        };
        let e: Result<()> = Err(timeout).context("step 4");
        let e = e.unwrap_err();
        assert_eq!(e.to_string(), "step 4");
        assert!(e.root_cause().contains("all_reduce"), "{}", e.root_cause());
        assert!(e.is_peer_failure());
        let plain: Result<u8> = None.context("no `sampler` entry");
        let option = TrainError::option("resume", None, "needs `out`, not `model.pt`");
        let flag = |k: &str| (k == "out" || k == "resume").then(|| format!("--{k}"));
        assert_eq!(option.naming_option(flag), "--resume: needs --out, not `model.pt`");
        assert_eq!(option.to_string(), "resume: needs `out`, not `model.pt`");
        assert!(!plain.unwrap_err().is_peer_failure());
    }

    #[test]
    fn a_peer_failure_is_found_through_every_wrapping_variant() {
        let peer = || tandem_comm::CommError::Peer {
            op: "broadcast_bytes",
            seq: 0,
            peer: 0,
            reason: "closed its connection".into(),
        };
        let comm = TrainError::comm("live recovery: sending the training state", peer());
        assert!(comm.is_peer_failure());
        let fill = TrainError::Fill { part: "rows", keys: 0..4, source: Box::new(comm) };
        assert!(fill.is_peer_failure());
        // Every level shows in the chain, the wrapped TrainError's own line included.
        let text = fill.chain_text();
        assert!(text.contains("reading keys 0..4") && text.contains("sending the training state"));
        assert!(text.contains("closed its connection"), "{text}");
        let phase = tandem_optim::StepPhase::Backward;
        let step =
            TrainError::from(tandem_optim::StepError { step: 3, phase, source: peer().into() });
        assert!(step.is_peer_failure());
        assert_eq!(step.to_string(), "backward at step 3");
        let invalid =
            TrainError::Field { path: "ck".into(), field: "sampler", problem: "x".into() };
        assert!(!invalid.is_peer_failure());
    }
}
