//! The crate's error: the checkpoint file or directory at fault, and why.
use std::path::PathBuf;

use tandem_ckpt::CkptError;
use tandem_comm::CommError;

/// A checkpoint that could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file or directory could not be read or written (`what`: `creating`, `reading`, ...).
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint file could not be encoded or decoded.
    #[error("{}", file_line(path, source))]
    File {
        path: PathBuf,
        #[source]
        source: CkptError,
    },
    /// A checkpoint (file or directory) whose content does not fit: a missing shard, a
    /// manifest that disagrees with its files, row blocks that do not stack.
    #[error("{}: {why}", path.display())]
    Corrupt { path: PathBuf, why: String },
    /// A collective of a save failed while `what` was being done (a dead peer).
    #[error("{what}: {source}")]
    Comm {
        what: String,
        // Not boxed: `source()` must give the `CommError` itself (`is_peer_failure` downcasts).
        #[source]
        source: CommError,
    },
}

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// `path: source`, or only `source` when it names the file already (as most of `CkptError`
/// does).
fn file_line(path: &std::path::Path, source: &CkptError) -> String {
    let text = source.to_string();
    if text.contains(&path.display().to_string()) {
        text
    } else {
        format!("{}: {text}", path.display())
    }
}

pub(crate) fn comm(what: impl Into<String>) -> impl FnOnce(CommError) -> CheckpointError {
    let what = what.into();
    move |source| CheckpointError::Comm { what, source }
}

/// An I/O failure on `path` while `what` (`creating`, `reading`, ...) was being done.
pub(crate) fn io(
    what: &'static str,
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io { what, path, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_file_is_named_once() {
        let path = std::path::PathBuf::from("ck/rank-0.pt");
        let format = CkptError::Format { path: path.clone(), msg: "bad zip".into() };
        let e = CheckpointError::File { path: path.clone(), source: format };
        assert_eq!(e.to_string(), "ck/rank-0.pt: bad zip");
        let field = CkptError::TrainingField { field: "epoch".into(), problem: "missing".into() };
        let e = CheckpointError::File { path, source: field };
        assert_eq!(e.to_string(), "ck/rank-0.pt: training checkpoint field `epoch`: missing");
    }
}
