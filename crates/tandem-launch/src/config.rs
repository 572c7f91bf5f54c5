//! What a launch is asked to do: `LaunchConfig` and the torchrun-style value syntaxes it is
//! built from (`--nnodes 1:1`, `--nproc-per-node auto`, `--redirects 0:3,1:2`, ...). Parsing
//! lives here so the CLI and in-process callers (`tandem train`) share one set of rules.
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;
use tandem_comm::auth::{JobSecret, SECRET_VAR};

use crate::error::LaunchError;
use crate::events::EventSink;

/// How many worker processes to start on this node (`--nproc-per-node`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NprocPerNode {
    /// An explicit count.
    Count(u32),
    /// One per visible GPU when there are GPUs, else one per CPU core (torchrun's `auto`).
    Auto,
    /// One per CPU core available to this process.
    Cpu,
    /// One per visible GPU; an error when there is none.
    Gpu,
}

impl FromStr for NprocPerNode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "gpu" => Ok(Self::Gpu),
            other => match other.parse::<u32>() {
                Ok(0) => Err("must be at least 1".into()),
                Ok(n) => Ok(Self::Count(n)),
                Err(_) => {
                    Err(format!("`{other}` is not a positive integer, `auto`, `cpu` or `gpu`"))
                }
            },
        }
    }
}

impl NprocPerNode {
    /// The number of workers this resolves to on this host.
    pub fn resolve(self) -> Result<u32, LaunchError> {
        match self {
            Self::Count(n) => Ok(n),
            Self::Cpu => Ok(available_cores()),
            Self::Auto => Ok(match visible_gpu_count() {
                0 => available_cores(),
                n => n,
            }),
            Self::Gpu => match visible_gpu_count() {
                0 => Err(LaunchError::config(
                    "--nproc-per-node",
                    "`gpu` asked for one worker per GPU, but no NVIDIA GPU is visible \
                     (no /dev/nvidiaN device, or CUDA_VISIBLE_DEVICES is empty)",
                )),
                n => Ok(n),
            },
        }
    }
}

/// CPU cores this process may use (affinity and cgroup limits included), at least 1.
pub fn available_cores() -> u32 {
    std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1)
}

/// GPUs a worker could see: the entries of `CUDA_VISIBLE_DEVICES` when it is set, else the
/// `/dev/nvidiaN` device nodes. The launcher knows nothing of CUDA; this is only a count.
fn visible_gpu_count() -> u32 {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v.split(',').filter(|s| !s.trim().is_empty()).count() as u32;
    }
    let Ok(dir) = std::fs::read_dir("/dev") else { return 0 };
    dir.filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("nvidia")
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        })
        .count() as u32
}

/// `--nnodes`: `N`, or `MIN:MAX` (an elastic job: each round starts with as many nodes as
/// joined, at least MIN, at most MAX).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nnodes {
    pub min: u32,
    pub max: u32,
}

/// Parses `--nnodes`: `N` or `MIN:MAX` with `1 <= MIN <= MAX`.
pub fn parse_nnodes(s: &str) -> Result<Nnodes, String> {
    let parse_one = |part: &str| -> Result<u32, String> {
        match part.trim().parse::<u32>() {
            Ok(0) => Err("must be at least 1".into()),
            Ok(n) => Ok(n),
            Err(_) => Err(format!("`{part}` is not a positive integer")),
        }
    };
    match s.split_once(':') {
        None => parse_one(s).map(|n| Nnodes { min: n, max: n }),
        Some((min, max)) => {
            let (min, max) = (parse_one(min)?, parse_one(max)?);
            if min > max {
                Err(format!("`{s}`: MIN is larger than MAX"))
            } else {
                Ok(Nnodes { min, max })
            }
        }
    }
}

/// Which of a worker's output streams a setting applies to (torchrun's `Std`: 0 none,
/// 1 stdout, 2 stderr, 3 both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    pub const NONE: Streams = Streams { stdout: false, stderr: false };
    pub const BOTH: Streams = Streams { stdout: true, stderr: true };

    fn from_code(code: &str) -> Result<Self, String> {
        match code.trim() {
            "0" => Ok(Self::NONE),
            "1" => Ok(Streams { stdout: true, stderr: false }),
            "2" => Ok(Streams { stdout: false, stderr: true }),
            "3" => Ok(Self::BOTH),
            other => Err(format!("`{other}` is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")),
        }
    }

    pub fn any(self) -> bool {
        self.stdout || self.stderr
    }
}

/// `--redirects` / `--tee`: one `Streams` for every local rank (`3`), or a per-local-rank map
/// (`0:3,1:2`; local ranks not named get none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamSpec {
    All(Streams),
    PerLocalRank(BTreeMap<u32, Streams>),
}

impl Default for StreamSpec {
    fn default() -> Self {
        StreamSpec::All(Streams::NONE)
    }
}

impl StreamSpec {
    pub fn for_local_rank(&self, local_rank: u32) -> Streams {
        match self {
            StreamSpec::All(s) => *s,
            StreamSpec::PerLocalRank(m) => m.get(&local_rank).copied().unwrap_or(Streams::NONE),
        }
    }

    /// True when some local rank has some stream selected.
    pub fn any(&self) -> bool {
        match self {
            StreamSpec::All(s) => s.any(),
            StreamSpec::PerLocalRank(m) => m.values().any(|s| s.any()),
        }
    }
}

impl FromStr for StreamSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if !s.contains(':') {
            return Streams::from_code(s).map(StreamSpec::All);
        }
        let mut map = BTreeMap::new();
        for entry in s.split(',').filter(|e| !e.trim().is_empty()) {
            let (rank, code) = entry
                .split_once(':')
                .ok_or_else(|| format!("`{entry}` is not LOCAL_RANK:CODE (e.g. `0:3,1:2`)"))?;
            let rank: u32 = rank
                .trim()
                .parse()
                .map_err(|_| format!("`{rank}` in `{entry}` is not a local rank"))?;
            map.insert(rank, Streams::from_code(code)?);
        }
        Ok(StreamSpec::PerLocalRank(map))
    }
}

/// A fresh run id (16 hex digits) for jobs that did not name one, as `--standalone` does.
pub fn random_run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// Parses `--local-ranks-filter`: a comma-separated list of local ranks (`0,1`).
pub fn parse_local_ranks(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.trim().parse::<u32>().map_err(|_| format!("`{p}` is not a local rank")))
        .collect()
}

/// Everything one launch needs. Build with [`LaunchConfig::new`] and adjust fields; the
/// defaults are torchrun's (one node, one worker, no restarts).
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// The executable each worker runs (looked up in PATH like a shell would).
    pub program: OsString,
    pub args: Vec<OsString>,
    /// Number of nodes (launchers) in the job; with `min_nnodes`, the most nodes.
    pub nnodes: u32,
    /// `--nnodes MIN:MAX`: rounds may start with as few as MIN nodes (`None`: exactly `nnodes`).
    pub min_nnodes: Option<u32>,
    /// How long the launchers of a multi-node job wait for each other to start a round.
    pub rdzv_timeout: Duration,
    /// Workers on this node.
    pub nproc_per_node: NprocPerNode,
    /// This node's index in `0..nnodes`; becomes GROUP_RANK.
    pub node_rank: u32,
    /// Where rank 0's store listens; exported as MASTER_ADDR.
    pub master_addr: String,
    /// MASTER_PORT. `None` picks a free port (allowed only with `nnodes == 1`).
    pub master_port: Option<u16>,
    /// `--rdzv-backend etcd --rdzv-endpoints H:P,...`: the etcd cluster that holds the
    /// launchers' rendezvous and the workers' store, so that no node hosts them (`None`: node
    /// 0's launcher and rank 0 host them, at `master_addr`). Needs the `etcd` feature.
    pub rdzv_etcd: Option<Vec<String>>,
    /// Whole-group restarts allowed after a worker fails.
    pub max_restarts: u32,
    /// How often workers are polled for exit.
    pub monitor_interval: Duration,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub stop_grace: Duration,
    /// TORCHELASTIC_RUN_ID; also names the job's log sub-directory.
    pub run_id: String,
    /// Base directory of per-rank log files (`<dir>/<run_id>/attempt_<k>/<local_rank>/`).
    pub log_dir: Option<PathBuf>,
    /// Streams that go only to the log files.
    pub redirects: StreamSpec,
    /// Streams that go to the log files and to the console.
    pub tee: StreamSpec,
    /// Only these local ranks' output reaches the console (`None`: all). Log files and the
    /// failure summary are not filtered.
    pub local_ranks_filter: Option<Vec<u32>>,
    /// Prefix console lines with `[rank N] `.
    pub prefix_output: bool,
    /// This local rank's stdout is the launcher's stdout itself (not piped: no prefix, no log
    /// file, and a terminal stays a terminal, e.g. for a progress bar). Library use only.
    pub stdout_passthrough_local_rank: Option<u32>,
    /// Extra variables for every worker (applied after the inherited environment, before the
    /// launcher's own variables, which always win).
    pub extra_env: Vec<(OsString, OsString)>,
    /// Install SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers that forward the signal to every worker.
    /// Process-wide: after `launch` returns, these signals no longer use their default action.
    pub forward_signals: bool,
    /// Lines of a failed worker's stderr kept for the summary.
    pub summary_tail_lines: usize,
    /// `--live-recovery`: a dead worker is restarted alone and joins the running job; the
    /// others are not stopped (see `launch_live`).
    pub live_recovery: bool,
    /// `--min-nproc`: with live recovery, the fewest ranks the job may go on with.
    pub min_nproc: Option<u32>,
    /// `--min-nproc-per-node`: with live recovery, the fewest ranks this node may go on with.
    pub min_nproc_per_node: Option<u32>,
    /// The job's secret (`--secret-file`): the launchers' rendezvous, the live store and the
    /// workers' store, mesh and shared memory admit only processes that prove they hold it. A
    /// single-node launch without one makes its own; a multi-node one needs it (or `insecure`).
    pub secret: Option<JobSecret>,
    /// `--insecure`: run with no secret at all; anyone who can reach the job's ports can join
    /// or disturb it (PyTorch's model; docs/security.md).
    pub insecure: bool,
    /// The job's wall-clock limit (`None`: none): past it, the workers are stopped as on a
    /// signal (SIGTERM, then SIGKILL after `stop_grace`) and the launch ends with exit code 124,
    /// as `timeout(1)`'s. For a program that must not hang on a stuck world (a benchmark).
    /// Not with live recovery.
    pub deadline: Option<Duration>,
    /// Where the launch's events go (restarts, lost ranks, the failure summary); by default
    /// to `tracing`. The `tandem` binary writes them to stderr.
    pub on_event: EventSink,
}

impl LaunchConfig {
    pub fn new(
        program: impl Into<OsString>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        LaunchConfig {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            nnodes: 1,
            min_nnodes: None,
            rdzv_timeout: Duration::from_secs(300),
            nproc_per_node: NprocPerNode::Count(1),
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            rdzv_etcd: None,
            master_port: None,
            max_restarts: 0,
            monitor_interval: Duration::from_millis(100),
            stop_grace: Duration::from_secs(5),
            run_id: "none".into(),
            log_dir: None,
            redirects: StreamSpec::default(),
            tee: StreamSpec::default(),
            local_ranks_filter: None,
            prefix_output: true,
            stdout_passthrough_local_rank: None,
            extra_env: Vec::new(),
            forward_signals: true,
            summary_tail_lines: 20,
            live_recovery: false,
            min_nproc: None,
            min_nproc_per_node: None,
            secret: None,
            insecure: false,
            deadline: None,
            on_event: EventSink::default(),
        }
    }

    /// This configuration with the job's secret settled and handed to the workers (in
    /// `TANDEM_SECRET`): the one given, else (one node) a fresh one, else none with `insecure`.
    /// Multi-node jobs without a secret are refused by [`LaunchConfig::validate`].
    pub fn with_job_secret(&self) -> Result<LaunchConfig, LaunchError> {
        let mut cfg = self.clone();
        if cfg.insecure {
            cfg.secret = None;
            // Workers must not pick up a secret the launchers do not use.
            cfg.extra_env.push((SECRET_VAR.into(), OsString::new()));
            return Ok(cfg);
        }
        if cfg.secret.is_none() && !cfg.is_multi_node() {
            cfg.secret = Some(JobSecret::generate().map_err(|e| {
                LaunchError::config("--secret-file", format!("cannot make a job secret: {e}"))
            })?);
        }
        if let Some(secret) = &cfg.secret {
            cfg.extra_env.push((SECRET_VAR.into(), secret.to_hex().into()));
        }
        Ok(cfg)
    }

    /// Whether launchers on several nodes must agree on each round.
    pub fn is_multi_node(&self) -> bool {
        self.nnodes > 1
    }

    /// Checks the combination of settings; each error names the flag at fault.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.program.is_empty() {
            return Err(LaunchError::config(
                "PROGRAM",
                "no program to run was given (tandem run -- PROGRAM [ARGS])",
            ));
        }
        if self.nnodes == 0 {
            return Err(LaunchError::config("--nnodes", "must be at least 1"));
        }
        if self.deadline.is_some() && self.live_recovery {
            return Err(LaunchError::config(
                "--live-recovery",
                "a job with a deadline cannot also be kept alive through failures",
            ));
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::config(
                "--node-rank",
                format!(
                    "{} is out of range for --nnodes {} (valid: 0..{})",
                    self.node_rank, self.nnodes, self.nnodes
                ),
            ));
        }
        if let Some(endpoints) = &self.rdzv_etcd {
            if endpoints.is_empty() {
                return Err(LaunchError::config(
                    "--rdzv-endpoints",
                    "names no etcd member (expected host:port[,host:port...])",
                ));
            }
        }
        if self.nnodes > 1 && self.master_port.is_none() && self.rdzv_etcd.is_none() {
            return Err(LaunchError::config(
                "--master-port",
                "is required with --nnodes > 1: every node must agree on rank 0's port",
            ));
        }
        if self.nnodes > 1 && self.secret.is_none() && !self.insecure {
            return Err(LaunchError::config(
                "--secret-file",
                "is required with --nnodes > 1, so that only this job's nodes can join it: make \
                 one private file (umask 077; openssl rand -hex 32 > job.secret), give every \
                 node a copy and pass --secret-file job.secret (or set TANDEM_SECRET_FILE); \
                 --insecure runs without one, open to anyone who can reach --master-port \
                 (docs/security.md)",
            ));
        }
        if self.master_port == Some(0) {
            return Err(LaunchError::config("--master-port", "0 is not a usable port"));
        }
        if self.master_addr.trim().is_empty() {
            return Err(LaunchError::config("--master-addr", "is empty"));
        }
        if self.monitor_interval.is_zero() {
            return Err(LaunchError::config("--monitor-interval", "must be greater than 0"));
        }
        if self.log_dir.is_none() {
            if self.redirects.any() {
                return Err(LaunchError::config(
                    "--redirects",
                    "needs --log-dir (where the files go)",
                ));
            }
            if self.tee.any() {
                return Err(LaunchError::config("--tee", "needs --log-dir (where the files go)"));
            }
        }
        if !self.live_recovery {
            for (flag, set) in [
                ("--min-nproc", self.min_nproc.is_some()),
                ("--min-nproc-per-node", self.min_nproc_per_node.is_some()),
            ] {
                if set {
                    return Err(LaunchError::config(flag, "only applies with --live-recovery"));
                }
            }
        }
        if self.run_id.is_empty()
            || self.run_id.contains('/')
            || self.run_id == "."
            || self.run_id == ".."
        {
            return Err(LaunchError::config(
                "--run-id",
                format!("`{}` cannot name a log directory", self.run_id),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nnodes_accepts_n_and_ranges() {
        assert_eq!(parse_nnodes("2"), Ok(Nnodes { min: 2, max: 2 }));
        assert_eq!(parse_nnodes("3:3"), Ok(Nnodes { min: 3, max: 3 }));
        assert_eq!(parse_nnodes("1:4"), Ok(Nnodes { min: 1, max: 4 }));
        assert!(parse_nnodes("3:2").unwrap_err().contains("MIN is larger"));
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("x").unwrap_err().contains("`x`"));
    }

    #[test]
    fn nproc_parses_keywords_and_counts() {
        assert_eq!("4".parse::<NprocPerNode>(), Ok(NprocPerNode::Count(4)));
        assert_eq!("auto".parse::<NprocPerNode>(), Ok(NprocPerNode::Auto));
        assert_eq!("cpu".parse::<NprocPerNode>(), Ok(NprocPerNode::Cpu));
        assert!("0".parse::<NprocPerNode>().is_err());
        assert!("many".parse::<NprocPerNode>().is_err());
        assert_eq!(NprocPerNode::Cpu.resolve().unwrap(), available_cores());
    }

    #[test]
    fn stream_spec_single_and_per_rank() {
        let all: StreamSpec = "3".parse().unwrap();
        assert_eq!(all.for_local_rank(7), Streams::BOTH);
        let per: StreamSpec = "0:1,2:2".parse().unwrap();
        assert_eq!(per.for_local_rank(0), Streams { stdout: true, stderr: false });
        assert_eq!(per.for_local_rank(1), Streams::NONE);
        assert_eq!(per.for_local_rank(2), Streams { stdout: false, stderr: true });
        assert!("4".parse::<StreamSpec>().is_err());
        assert!("a:1".parse::<StreamSpec>().is_err());
    }

    #[test]
    fn validate_names_the_flag_at_fault() {
        let mut c = LaunchConfig::new("true", Vec::<String>::new());
        c.nnodes = 2;
        c.node_rank = 2;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--node-rank"), "{e}");
        c.node_rank = 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--master-port"), "{e}");
        let mut c = LaunchConfig::new("true", Vec::<String>::new());
        c.redirects = StreamSpec::All(Streams::BOTH);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--redirects") && e.contains("--log-dir"), "{e}");
    }

    #[test]
    fn an_etcd_rendezvous_needs_no_master_port_but_endpoints() {
        let mut c = LaunchConfig::new("true", Vec::<String>::new());
        c.nnodes = 2;
        c.insecure = true;
        c.rdzv_etcd = Some(vec!["e1:2379".into()]);
        c.validate().unwrap();
        c.rdzv_etcd = Some(Vec::new());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--rdzv-endpoints"), "{e}");
        c.rdzv_etcd = Some(vec!["e1:2379".into()]);
        // Live recovery keeps its membership on the cluster too: still no --master-port.
        c.live_recovery = true;
        c.validate().unwrap();
    }
}
