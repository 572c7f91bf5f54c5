//! How a launch ended: the exit code to use, and for a failed job which rank failed, how, and
//! the last lines it wrote to stderr.
use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;

/// How a worker process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerExit {
    Code(i32),
    Signal(i32),
}

impl WorkerExit {
    pub(crate) fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(c), _) => WorkerExit::Code(c),
            (None, Some(s)) => WorkerExit::Signal(s),
            // Neither code nor signal cannot happen for a reaped child on Unix.
            (None, None) => WorkerExit::Code(1),
        }
    }

    /// The launcher's exit code for this ending: the worker's own code, or 128 + signal as a
    /// shell reports it.
    pub fn launcher_exit_code(self) -> i32 {
        match self {
            WorkerExit::Code(c) => c,
            WorkerExit::Signal(s) => 128 + s,
        }
    }
}

impl fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WorkerExit::Code(c) => write!(f, "exit code {c}"),
            WorkerExit::Signal(s) => match signal_hook::low_level::signal_name(s) {
                Some(name) => write!(f, "signal {s} ({name})"),
                None => write!(f, "signal {s}"),
            },
        }
    }
}

/// A worker that failed on its own (not one the launcher stopped).
#[derive(Clone, Debug)]
pub struct WorkerFailure {
    pub rank: u32,
    pub local_rank: u32,
    pub node_rank: u32,
    pub exit: WorkerExit,
    /// The last lines of its stderr (at most `summary_tail_lines`).
    pub stderr_tail: Vec<String>,
}

/// The result of [`crate::launch`].
#[derive(Clone, Debug)]
pub struct LaunchOutcome {
    /// What the launcher process should exit with: 0, the failing worker's code (128 + signal
    /// if it was killed), or 128 + the signal that stopped the launcher.
    pub exit_code: i32,
    /// Restarts performed (TORCHELASTIC_RESTART_COUNT of the last attempt).
    pub restarts: u32,
    /// Workers that failed in the last attempt, the first one seen first.
    pub failures: Vec<WorkerFailure>,
    /// The termination signal the launcher received and forwarded, if that ended the job.
    pub signal: Option<i32>,
    /// MASTER_PORT of the last attempt.
    pub master_port: u16,
    /// `<log_dir>/<run_id>` when log files were written.
    pub log_dir: Option<PathBuf>,
}

impl LaunchOutcome {
    pub fn success(&self) -> bool {
        self.exit_code == 0
    }

    /// A human-readable account of a failure (empty on success), every line starting with
    /// `[launcher]`.
    pub fn summary(&self, max_restarts: u32) -> String {
        let mut s = String::new();
        if let Some(sig) = self.signal {
            let name = signal_hook::low_level::signal_name(sig).unwrap_or("signal");
            s.push_str(&format!(
                "[launcher] received {name}: stopped all workers, exiting with {}\n",
                self.exit_code
            ));
            return s;
        }
        if self.failures.is_empty() {
            return s;
        }
        // The root cause is the first failure seen, unless it only reports losing a peer and
        // another rank says something else (ranks exit within milliseconds of each other: the
        // one that lost its peer may be seen first).
        let lost_peer =
            |f: &WorkerFailure| f.stderr_tail.iter().any(|l| l.contains("closed its connection"));
        let root_at = self.failures.iter().position(|f| !lost_peer(f)).unwrap_or(0);
        let root = &self.failures[root_at];
        s.push_str(&format!(
            "[launcher] job failed after {} restart(s) (--max-restarts {max_restarts})\n",
            self.restarts
        ));
        s.push_str(&format!(
            "[launcher]   root cause: rank {} (local rank {} on node {}): {}\n",
            root.rank, root.local_rank, root.node_rank, root.exit
        ));
        if root.stderr_tail.is_empty() {
            s.push_str(&format!("[launcher]   rank {} wrote nothing to stderr\n", root.rank));
        } else {
            s.push_str(&format!(
                "[launcher]   last {} line(s) of rank {}'s stderr:\n",
                root.stderr_tail.len(),
                root.rank
            ));
            for line in &root.stderr_tail {
                s.push_str(&format!("[launcher]     | {line}\n"));
            }
        }
        let others = self.failures.iter().enumerate().filter(|(i, _)| *i != root_at);
        for other in others.map(|(_, f)| f) {
            let last = other.stderr_tail.last().map(|l| format!(": {l}")).unwrap_or_default();
            s.push_str(&format!(
                "[launcher]   also failed: rank {} (local rank {}): {}{last}\n",
                other.rank, other.local_rank, other.exit
            ));
        }
        if let Some(dir) = &self.log_dir {
            s.push_str(&format!("[launcher]   worker logs: {}\n", dir.display()));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_shell_conventions() {
        assert_eq!(WorkerExit::Code(3).launcher_exit_code(), 3);
        assert_eq!(WorkerExit::Signal(9).launcher_exit_code(), 137);
        assert_eq!(WorkerExit::Signal(9).to_string(), "signal 9 (SIGKILL)");
    }

    #[test]
    fn summary_names_rank_exit_and_stderr() {
        let o = LaunchOutcome {
            exit_code: 3,
            restarts: 1,
            failures: vec![WorkerFailure {
                rank: 5,
                local_rank: 1,
                node_rank: 1,
                exit: WorkerExit::Code(3),
                stderr_tail: vec!["boom".into()],
            }],
            signal: None,
            master_port: 1234,
            log_dir: None,
        };
        let s = o.summary(1);
        assert!(s.contains("rank 5 (local rank 1 on node 1): exit code 3"), "{s}");
        assert!(s.contains("| boom"), "{s}");
    }

    #[test]
    fn a_rank_that_only_lost_its_peer_is_not_the_root_cause() {
        let failure = |rank: u32, line: &str| WorkerFailure {
            rank,
            local_rank: rank,
            node_rank: 0,
            exit: WorkerExit::Code(1),
            stderr_tail: vec![line.into()],
        };
        let mut o = LaunchOutcome {
            exit_code: 1,
            restarts: 0,
            failures: vec![
                failure(0, "error: all_gather #2: peer rank 1 closed its connection (...)"),
                failure(1, "error: faces/p3/x.jpg: cannot decode the image"),
            ],
            signal: None,
            master_port: 1234,
            log_dir: None,
        };
        let s = o.summary(0);
        assert!(s.contains("root cause: rank 1 ") && s.contains("| error: faces/p3/x.jpg"), "{s}");
        assert!(s.contains("also failed: rank 0 (local rank 0): exit code 1: error: all_gather"));
        // When every rank only lost a peer, the first seen stays the root cause.
        o.failures[1] = failure(1, "error: peer rank 0 closed its connection");
        assert!(o.summary(0).contains("root cause: rank 0 "));
    }
}
