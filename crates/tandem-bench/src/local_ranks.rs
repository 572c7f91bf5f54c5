//! What the multi-rank benchmarks share: starting N copies of this executable as the ranks of
//! one loopback job (torchrun's variables, rank 0's stdout piped back for its `RESULT` lines),
//! reaping them with a deadline so a stuck world never hangs the benchmark, and the median.
//! The benchmarks need rank 0's stdout as a stream, so they spawn directly rather than through
//! tandem-launch's supervisor.
use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// The ranks of one benchmark job on this host.
pub struct LocalRanks {
    children: Vec<Child>,
}

/// What every rank of job `job` gets, however it is started: this executable, and the store
/// port, run id and init timeout.
fn job_basics(job: &str) -> anyhow::Result<(PathBuf, [(&'static str, String); 3])> {
    let port = tandem::launch::pick_master_port().context("picking a port for rank 0's store")?;
    let exe = crate::bench_exe()?;
    let vars = [
        ("MASTER_PORT", port.to_string()),
        ("TANDEM_RUN_ID", format!("{job}-{}", std::process::id())),
        ("TANDEM_INIT_TIMEOUT", "60".to_string()),
    ];
    Ok((exe, vars))
}

impl LocalRanks {
    /// Starts `nproc` ranks of `current_exe() ARGS`, each with RANK/WORLD_SIZE/LOCAL_RANK/
    /// LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, a run id naming `job`, and `env` on top.
    /// Returns rank 0's stdout.
    pub fn spawn<S: AsRef<OsStr>>(
        nproc: usize,
        job: &str,
        args: &[S],
        env: &[(&str, Option<String>)],
    ) -> anyhow::Result<(LocalRanks, ChildStdout)> {
        let (exe, job_vars) = job_basics(job)?;
        let mut ranks = LocalRanks { children: Vec::with_capacity(nproc) };
        for rank in 0..nproc {
            let mut cmd = Command::new(&exe);
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", nproc.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", nproc.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .envs(job_vars.iter().map(|(k, v)| (k, v)))
                .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() })
                .stderr(Stdio::inherit());
            for (key, value) in env {
                match value {
                    Some(v) => cmd.env(key, v),
                    None => cmd.env_remove(key),
                };
            }
            // On an error here, Drop kills the ranks already started.
            ranks.children.push(cmd.spawn().with_context(|| format!("spawning rank {rank}"))?);
        }
        let stdout = ranks.children[0].stdout.take().context("rank 0 stdout")?;
        Ok((ranks, stdout))
    }

    /// As [`LocalRanks::spawn`], with the ranks started by `mpirun` (OpenMPI's variables name
    /// them; `env` and a fresh MASTER_PORT are passed on with `-x`). The one child is mpirun;
    /// the returned stdout is all ranks' (only rank 0 prints results).
    pub fn spawn_mpirun<S: AsRef<OsStr>>(
        nproc: usize,
        job: &str,
        args: &[S],
        env: &[(&str, Option<String>)],
    ) -> anyhow::Result<(LocalRanks, ChildStdout)> {
        let (exe, job_vars) = job_basics(job)?;
        let mut cmd = Command::new("mpirun");
        // --allow-run-as-root: CI and containers run as root; --oversubscribe: more ranks
        // than cores is allowed, as for the other backends.
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &nproc.to_string()]);
        let given = env.iter().filter_map(|(k, v)| Some((*k, v.clone()?)));
        for (k, v) in job_vars.into_iter().chain(given) {
            cmd.env(k, v).arg("-x").arg(k);
        }
        for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
            cmd.env_remove(v);
        }
        cmd.arg(&exe).args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("starting mpirun (Debian: apt install openmpi-bin)")?;
        let stdout = child.stdout.take().context("mpirun stdout")?;
        Ok((LocalRanks { children: vec![child] }, stdout))
    }

    /// Waits for every rank until `deadline` from now (killing those still running then, or at
    /// once when `kill_now`); true when every rank exited successfully.
    pub fn reap(&mut self, deadline: Duration, kill_now: bool) -> anyhow::Result<bool> {
        let deadline = Instant::now() + deadline;
        let mut ok = true;
        for (rank, c) in self.children.iter_mut().enumerate() {
            loop {
                if let Some(st) = c.try_wait()? {
                    if !st.success() {
                        eprintln!("rank {rank} exited with {st}");
                        ok = false;
                    }
                    break;
                }
                if kill_now || Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    eprintln!("rank {rank} did not exit; killed");
                    ok = false;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(ok)
    }
}

impl Drop for LocalRanks {
    /// No rank outlives the benchmark, whatever path it leaves by.
    fn drop(&mut self) {
        for c in &mut self.children {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// The median (upper median for an even count) of a non-empty list.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
