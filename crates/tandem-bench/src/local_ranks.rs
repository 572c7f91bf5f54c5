//! What the multi-rank benchmarks share: running N copies of this executable as the ranks of
//! one loopback job under tandem-launch (the launcher users run: torchrun's variables, the
//! job's secret, no rank outliving it), stopped at a deadline so a stuck world never hangs the
//! benchmark; the same job under `mpirun` (OpenMPI starts its ranks itself); and the median.
//!
//! A worker rank is `tandem-bench worker BENCH` with its job, the parent's typed settings, as
//! JSON in [`JOB_VAR`] (no flags spelled twice); it reports typed results as `RESULT {json}`
//! lines on rank 0's stdout, which [`run_workers`] reads back as values.
use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tandem::comm::ProcessGroup;
use tandem::launch::{EventSink, LaunchConfig, NprocPerNode, StreamSpec, Streams};

/// The environment variable a worker rank reads its job from (JSON).
pub const JOB_VAR: &str = "TANDEM_BENCH_JOB";

/// The prefix of a worker's result line; the rest of the line is one JSON value.
const RESULT: &str = "RESULT ";

/// The benchmarks whose ranks are this executable (`tandem-bench worker BENCH`).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Bench {
    Allreduce,
    Ddp,
    Fsdp,
    Zero,
}

impl Bench {
    fn name(self) -> &'static str {
        match self {
            Bench::Allreduce => "allreduce",
            Bench::Ddp => "ddp",
            Bench::Fsdp => "fsdp",
            Bench::Zero => "zero",
        }
    }

    /// The arguments that start one rank of this benchmark.
    pub fn worker_args(self) -> [&'static str; 2] {
        ["worker", self.name()]
    }
}

/// Runs `nproc` ranks of `bench` with `job` (as [`run_ranks`], `env` on top) and returns the
/// results rank 0 reported, in the order it printed them.
pub fn run_workers<J: Serialize, R: DeserializeOwned>(
    bench: Bench,
    nproc: usize,
    job: &J,
    env: &[(&str, String)],
    deadline: Duration,
) -> anyhow::Result<Vec<R>> {
    let mut env = env.to_vec();
    env.push((JOB_VAR, serde_json::to_string(job)?));
    let what = format!("bench-{}", bench.name());
    let text = run_ranks(nproc, &what, &bench.worker_args(), &env, deadline)?;
    results(&text, &what)
}

/// This worker's job, as the parent wrote it in [`JOB_VAR`].
pub fn job<J: DeserializeOwned>() -> anyhow::Result<J> {
    let text = std::env::var(JOB_VAR).with_context(|| {
        format!("a worker rank needs its job in ${JOB_VAR} (set by the parent)")
    })?;
    serde_json::from_str(&text).with_context(|| format!("${JOB_VAR} does not hold this job"))
}

/// Prints one result line (rank 0 of a worker job).
pub fn emit<R: Serialize>(result: &R) -> anyhow::Result<()> {
    println!("{RESULT}{}", serde_json::to_string(result)?);
    Ok(())
}

/// Every rank's `result`, printed by rank 0 in rank order; then a barrier.
pub fn emit_from_every_rank<R: Serialize>(pg: &ProcessGroup, result: &R) -> anyhow::Result<()> {
    let all = pg.all_gather_bytes(&serde_json::to_vec(result)?)?;
    if pg.rank() == 0 {
        for line in all {
            println!("{RESULT}{}", String::from_utf8_lossy(&line));
        }
    }
    pg.barrier()?;
    Ok(())
}

/// The result lines in `text` (its other lines are anything), typed; `what` names the run in
/// errors.
pub fn results<R: DeserializeOwned>(text: &str, what: &str) -> anyhow::Result<Vec<R>> {
    let rows = text
        .lines()
        .filter_map(|l| l.strip_prefix(RESULT))
        .map(|l| serde_json::from_str(l).with_context(|| format!("{what} reported {l:?}")))
        .collect::<anyhow::Result<Vec<R>>>()?;
    anyhow::ensure!(!rows.is_empty(), "{what} reported no results");
    Ok(rows)
}

/// Runs `nproc` ranks of this executable with `args` as job `job` on this host, `env` on top of
/// the launcher's variables, and returns what rank 0 printed. Past `deadline` the ranks are
/// stopped and the run is an error.
pub fn run_ranks<S: AsRef<OsStr>>(
    nproc: usize,
    job: &str,
    args: &[S],
    env: &[(&str, String)],
    deadline: Duration,
) -> anyhow::Result<String> {
    let logs = tempfile::tempdir().context("a directory for the ranks' output")?;
    let mut lc = LaunchConfig::new(crate::bench_exe()?, args.iter().map(|a| a.as_ref()));
    lc.nproc_per_node = NprocPerNode::Count(nproc as u32);
    lc.master_addr = "127.0.0.1".into();
    lc.run_id = format!("{job}-{}", std::process::id());
    lc.log_dir = Some(logs.path().to_path_buf());
    // Rank 0's stdout only to its file; every rank's stderr to the console as it comes.
    lc.redirects = StreamSpec::PerLocalRank([(0, Streams { stdout: true, stderr: false })].into());
    lc.prefix_output = false;
    // A library call inside a program: the program keeps its own signal handling.
    lc.forward_signals = false;
    lc.deadline = Some(deadline);
    lc.on_event = EventSink::new(|e| eprintln!("{e}"));
    lc.extra_env.push(("TANDEM_INIT_TIMEOUT".into(), "60".into()));
    lc.extra_env.extend(env.iter().map(|(k, v)| (k.into(), v.into())));
    let outcome =
        tandem::launch::launch(&lc).with_context(|| format!("starting the {job} ranks"))?;
    if outcome.exit_code != 0 {
        bail!(
            "the {nproc} {job} ranks failed (exit code {}; their errors are above)",
            outcome.exit_code
        );
    }
    let dir = outcome.log_dir.context("the launcher kept no log directory")?;
    let stdout = dir.join(format!("attempt_{}", outcome.restarts)).join("0").join("stdout.log");
    std::fs::read_to_string(&stdout).with_context(|| format!("reading {}", stdout.display()))
}

/// What every rank of an `mpirun` job gets: this executable, and the store port, run id and
/// init timeout.
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

/// The ranks of one benchmark job that `mpirun` started.
pub struct LocalRanks {
    children: Vec<Child>,
}

impl LocalRanks {
    /// `nproc` ranks of this executable started by `mpirun` (OpenMPI's variables name them;
    /// `env` and a fresh MASTER_PORT are passed on with `-x`). The one child is mpirun;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Row {
        rank: usize,
        secs: f64,
    }

    #[test]
    fn result_lines_come_back_typed_among_other_output() {
        let text = "rank 0 warming up\nRESULT {\"rank\":0,\"secs\":0.5}\nnoise RESULT x\n\
                    RESULT {\"rank\":1,\"secs\":0.25}\n";
        let rows: Vec<Row> = results(text, "bench-test").unwrap();
        assert_eq!(rows, [Row { rank: 0, secs: 0.5 }, Row { rank: 1, secs: 0.25 }]);
    }

    #[test]
    fn a_malformed_or_missing_result_is_an_error_naming_the_run() {
        let err = results::<Row>("RESULT 0 0.5\n", "bench-test").unwrap_err();
        assert!(format!("{err:#}").contains("bench-test reported \"0 0.5\""), "{err:#}");
        let err = results::<Row>("nothing here\n", "bench-test").unwrap_err();
        assert!(err.to_string().contains("bench-test reported no results"), "{err}");
    }
}
