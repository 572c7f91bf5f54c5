//! One worker process: started in its own process group (so a signal to the group reaches
//! everything it started), with a parent-death signal as a backstop, its output pumped to the
//! sinks chosen by the config.
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::config::{LaunchConfig, Streams};
use crate::env::{worker_env, JobShape};
use crate::error::LaunchError;
use crate::output::{spawn_pump, Console, SharedTail, Sinks, TailBuffer};
use crate::reaper::GroupReaper;

pub(crate) struct Worker {
    pub rank: u32,
    pub local_rank: u32,
    child: Child,
    /// The worker's process group id (its own pid: it leads the group).
    pub pgid: i32,
    /// Set once the worker has been reaped.
    pub status: Option<ExitStatus>,
    pub stderr_tail: SharedTail,
    pumps: Vec<JoinHandle<()>>,
}

/// Where a local rank's two streams go: `(to log files, to console)`.
pub(crate) fn stream_routes(cfg: &LaunchConfig, local_rank: u32) -> (Streams, Streams) {
    let shown = cfg.local_ranks_filter.as_ref().is_none_or(|f| f.contains(&local_rank));
    let (file, console) = if cfg.log_dir.is_none() {
        (Streams::NONE, Streams::BOTH)
    } else if !cfg.redirects.any() && !cfg.tee.any() {
        // `--log-dir` alone: output goes to the per-rank files only.
        (Streams::BOTH, Streams::NONE)
    } else {
        let r = cfg.redirects.for_local_rank(local_rank);
        let t = cfg.tee.for_local_rank(local_rank);
        (
            Streams { stdout: r.stdout || t.stdout, stderr: r.stderr || t.stderr },
            Streams { stdout: !r.stdout, stderr: !r.stderr },
        )
    };
    let console = if shown { console } else { Streams::NONE };
    (file, console)
}

fn open_log(dir: &Path, name: &str) -> Result<File, LaunchError> {
    let path = dir.join(name);
    File::create(&path).map_err(|error| LaunchError::LogFile { path, error })
}

impl Worker {
    /// Starts local rank `local_rank`. `attempt_dir` is this attempt's log directory when
    /// log files are in use.
    pub(crate) fn spawn(
        cfg: &LaunchConfig,
        shape: &JobShape,
        local_rank: u32,
        cores: u32,
        attempt_dir: Option<&Path>,
        reaper: Option<&GroupReaper>,
    ) -> Result<Worker, LaunchError> {
        let rank = shape.rank(local_rank);
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args);
        cmd.envs(worker_env(shape, local_rank, cores, &cfg.extra_env, |k| {
            std::env::var_os(k).is_some()
        }));
        // A passthrough worker writes to the launcher's own stdout (a terminal stays a terminal,
        // so it can draw progress bars); its stderr is still captured for the failure summary.
        let passthrough = cfg.stdout_passthrough_local_rank == Some(local_rank);
        let stdout = if passthrough { Stdio::inherit() } else { Stdio::piped() };
        cmd.stdin(Stdio::null()).stdout(stdout).stderr(Stdio::piped());
        cmd.process_group(0);
        let launcher_pid = std::process::id() as libc::pid_t;
        let listing_fd = reaper.and_then(GroupReaper::listing_fd);
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // system calls (write, signal, prctl, getppid), touching no locks or allocations;
        // `listing_fd` is the watchdog pipe's write end, inherited (closed at exec).
        unsafe {
            cmd.pre_exec(move || {
                // Listed before anything of the worker runs (std has made its process group
                // by now): the launcher may die the moment `spawn` returns.
                if let Some(fd) = listing_fd {
                    crate::reaper::list_own_group(fd);
                }
                // If the launcher dies (even by SIGKILL) the worker is killed too. The signal is
                // tied to the thread that forked: `launch` spawns and waits in one thread.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before prctl took effect.
                if libc::getppid() != launcher_pid {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let (file, console) = stream_routes(cfg, local_rank);
        let rank_dir = match attempt_dir {
            Some(dir) if file.any() => {
                let d = dir.join(local_rank.to_string());
                std::fs::create_dir_all(&d)
                    .map_err(|error| LaunchError::LogFile { path: d.clone(), error })?;
                Some(d)
            }
            _ => None,
        };
        let stdout_file = match &rank_dir {
            Some(d) if file.stdout => Some(open_log(d, "stdout.log")?),
            _ => None,
        };
        let stderr_file = match &rank_dir {
            Some(d) if file.stderr => Some(open_log(d, "stderr.log")?),
            _ => None,
        };

        let mut child = cmd.spawn().map_err(|error| LaunchError::Spawn {
            rank,
            program: cfg.program.to_string_lossy().into_owned(),
            error,
        })?;
        let pgid = child.id() as i32;
        let prefix =
            if cfg.prefix_output { format!("[rank {rank}] ").into_bytes() } else { Vec::new() };
        let stderr_tail: SharedTail = Arc::new(Mutex::new(TailBuffer::new(cfg.summary_tail_lines)));
        let mut pumps = Vec::with_capacity(2);
        let worker_pumps = || -> std::io::Result<()> {
            if let Some(out) = child.stdout.take() {
                let sinks = Sinks {
                    console: console.stdout.then(|| (Console::Stdout, prefix.clone())),
                    file: stdout_file,
                    tail: None,
                };
                pumps.push(spawn_pump(format!("rank{rank}-stdout"), out, sinks)?);
            }
            if let Some(err) = child.stderr.take() {
                let sinks = Sinks {
                    console: console.stderr.then(|| (Console::Stderr, prefix.clone())),
                    file: stderr_file,
                    tail: Some(stderr_tail.clone()),
                };
                pumps.push(spawn_pump(format!("rank{rank}-stderr"), err, sinks)?);
            }
            Ok(())
        };
        if let Err(error) = worker_pumps() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(LaunchError::Spawn {
                rank,
                program: cfg.program.to_string_lossy().into_owned(),
                error,
            });
        }
        Ok(Worker { rank, local_rank, child, pgid, status: None, stderr_tail, pumps })
    }

    /// Reaps the worker if it has exited; returns its status once known.
    pub(crate) fn poll(&mut self) -> Result<Option<ExitStatus>, LaunchError> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .map_err(|error| LaunchError::Wait { rank: self.rank, error })?;
        }
        Ok(self.status)
    }

    pub(crate) fn stderr_lines(&self) -> Vec<String> {
        self.stderr_tail.lock().map(|t| t.lines()).unwrap_or_default()
    }

    /// True once both output streams reached end of file.
    pub(crate) fn output_done(&self) -> bool {
        self.pumps.iter().all(|p| p.is_finished())
    }

    pub(crate) fn join_output(&mut self) {
        for p in self.pumps.drain(..) {
            let _ = p.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StreamSpec;

    fn cfg() -> LaunchConfig {
        LaunchConfig::new("true", Vec::<String>::new())
    }

    #[test]
    fn console_only_without_log_dir() {
        assert_eq!(stream_routes(&cfg(), 0), (Streams::NONE, Streams::BOTH));
    }

    #[test]
    fn log_dir_alone_sends_everything_to_files() {
        let mut c = cfg();
        c.log_dir = Some("/tmp/x".into());
        assert_eq!(stream_routes(&c, 3), (Streams::BOTH, Streams::NONE));
    }

    #[test]
    fn redirects_hide_and_tee_copies() {
        let mut c = cfg();
        c.log_dir = Some("/tmp/x".into());
        c.redirects = "0:2".parse::<StreamSpec>().unwrap();
        c.tee = "1".parse::<StreamSpec>().unwrap();
        let out_only = Streams { stdout: true, stderr: false };
        // rank 0: stderr redirected (file only), stdout teed (file and console)
        assert_eq!(stream_routes(&c, 0), (Streams::BOTH, out_only));
        // rank 1: stdout teed, stderr console only
        assert_eq!(stream_routes(&c, 1), (out_only, Streams::BOTH));
    }

    #[test]
    fn filter_silences_other_ranks_on_the_console_only() {
        let mut c = cfg();
        c.log_dir = Some("/tmp/x".into());
        c.tee = "3".parse::<StreamSpec>().unwrap();
        c.local_ranks_filter = Some(vec![1]);
        assert_eq!(stream_routes(&c, 0), (Streams::BOTH, Streams::NONE));
        assert_eq!(stream_routes(&c, 1), (Streams::BOTH, Streams::BOTH));
    }
}
