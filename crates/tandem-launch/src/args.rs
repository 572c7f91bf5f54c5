//! `tandem run`'s command line — torchrun's flags, in torchrun's spellings too
//! (`--nproc-per-node` and `--nproc_per_node`) — as a clap derive (feature `clap`), the way
//! torch's `torch.distributed.run` parser is part of torch: a program can embed it.
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use tandem_comm::JobSecret;

use crate::config::{parse_local_ranks, parse_nnodes, random_run_id, Nnodes};
use crate::{LaunchConfig, LaunchError, NprocPerNode, StreamSpec};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Every worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, \
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, \
and OMP_NUM_THREADS / RAYON_NUM_THREADS = max(1, cores / nproc) unless already set.\n\
As with torchrun, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, \
PET_MAX_RESTARTS and PET_RDZV_ID (what Kubeflow's trainer sets for torchrun) are the defaults \
of their flags; a flag on the command line wins.\n\
Example: tandem run --nproc-per-node 4 -- ./train --epochs 3"
)]
pub struct LaunchArgs {
    /// Number of nodes: N, or MIN:MAX (each round starts with the nodes that joined, at least
    /// MIN; a lost node is replaced or dropped at the next restart).
    #[arg(long, env = "PET_NNODES", value_name = "N", default_value = "1", value_parser = parse_nnodes)]
    nnodes: Nnodes,

    /// Seconds the launchers of a multi-node job wait for each other at each (re)start.
    #[arg(
        long = "rdzv-timeout",
        alias = "rdzv_timeout",
        value_name = "SECS",
        default_value_t = 300.0
    )]
    rdzv_timeout: f64,

    /// Who holds the rendezvous: `static` (node 0's launcher and rank 0, at --master-addr; also
    /// `c10d`) or `etcd` (the cluster at --rdzv-endpoints: no node is special; needs a build
    /// with the `etcd` feature).
    #[arg(
        long = "rdzv-backend",
        alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        value_name = "BACKEND",
        default_value = "static"
    )]
    rdzv_backend: String,

    /// The etcd cluster's members, host:port[,host:port...] (with --rdzv-backend etcd).
    #[arg(
        long = "rdzv-endpoints",
        visible_alias = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        value_name = "HOST:PORT,..."
    )]
    rdzv_endpoints: Option<String>,

    /// Workers on this node: a count, `auto` (one per GPU, else per core), `cpu` or `gpu`.
    #[arg(
        long = "nproc-per-node",
        alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        value_name = "N",
        default_value = "1"
    )]
    nproc_per_node: NprocPerNode,

    /// This node's index in 0..nnodes (becomes GROUP_RANK; ranks are node_rank * nproc + local).
    /// Node 0's launcher hosts the launchers' rendezvous at MASTER_ADDR:MASTER_PORT. With
    /// --nnodes MIN:MAX only 0 matters: the other nodes are numbered in the order they join.
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        env = "PET_NODE_RANK",
        value_name = "R",
        default_value_t = 0
    )]
    node_rank: u32,

    /// Address of the node running rank 0, where its store listens (MASTER_ADDR).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        value_name = "HOST",
        default_value = "127.0.0.1"
    )]
    master_addr: String,

    /// Port of rank 0's store (MASTER_PORT); required with --nnodes > 1, where it is the
    /// launchers' rendezvous and node 0 picks a free port for the workers each round. Single
    /// node: a free one is picked when not given.
    #[arg(
        long = "master-port",
        alias = "master_port",
        env = "PET_MASTER_PORT",
        value_name = "PORT"
    )]
    master_port: Option<u16>,

    /// Single-node job on loopback: free port picked for you, random run id.
    #[arg(long)]
    standalone: bool,

    /// Times the whole set of workers is restarted after a worker fails (with --live-recovery:
    /// times a single dead worker is started again).
    #[arg(
        long = "max-restarts",
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        value_name = "N",
        default_value_t = 0
    )]
    max_restarts: u32,

    /// Keep training through a worker's death: the others are not stopped; the dead rank is
    /// started again alone and joins the running job at a step boundary (counted against
    /// --max-restarts), and with no restarts left the job goes on with fewer ranks. Workers
    /// re-form their group and share their state live (tandem train does; library programs use
    /// tandem::live).
    #[arg(long = "live-recovery")]
    live_recovery: bool,

    /// With --live-recovery: the fewest ranks the whole job may go on with (default 1).
    #[arg(long = "min-nproc", value_name = "N", requires = "live_recovery")]
    min_nproc: Option<u32>,

    /// With --live-recovery: the fewest ranks this node may go on with; below it the node stops
    /// its workers (default 1).
    #[arg(long = "min-nproc-per-node", value_name = "N", requires = "live_recovery")]
    min_nproc_per_node: Option<u32>,

    /// The job's secret: a private file (mode 600) every node holds a copy of. The launchers'
    /// rendezvous, the live store, the workers' store and their mesh admit only processes that
    /// prove they hold it. Required with --nnodes > 1; one node makes its own.
    #[arg(long = "secret-file", env = "TANDEM_SECRET_FILE", value_name = "FILE")]
    secret_file: Option<PathBuf>,

    /// Run without a job secret: anyone who can reach the job's ports can join or disturb it
    /// (PyTorch's model). Only for networks where every host is trusted.
    #[arg(long, conflicts_with = "secret_file")]
    insecure: bool,

    /// Seconds between checks of the workers' state (a worker's exit is seen at once).
    #[arg(
        long = "monitor-interval",
        alias = "monitor_interval",
        value_name = "SECS",
        default_value_t = 0.1
    )]
    monitor_interval: f64,

    /// Job id exported as TORCHELASTIC_RUN_ID; also names the sub-directory of --log-dir.
    #[arg(long = "run-id", alias = "run_id", env = "PET_RDZV_ID", value_name = "ID")]
    run_id: Option<String>,

    /// Write worker output to DIR/RUN_ID/attempt_K/LOCAL_RANK/{stdout,stderr}.log.
    #[arg(long = "log-dir", alias = "log_dir", value_name = "DIR")]
    log_dir: Option<PathBuf>,

    /// Streams sent only to the log files: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank (0:3,1:2).
    #[arg(short = 'r', long, value_name = "SPEC")]
    redirects: Option<StreamSpec>,

    /// Streams sent to the log files and the console too (same syntax as --redirects).
    #[arg(short = 't', long, value_name = "SPEC")]
    tee: Option<StreamSpec>,

    /// Show only these local ranks' output on the console (e.g. 0,1); log files keep everything.
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter", value_name = "RANKS", value_parser = parse_rank_list)]
    local_ranks_filter: Option<RankList>,

    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long = "stop-grace", alias = "stop_grace", value_name = "SECS", default_value_t = 5.0)]
    stop_grace: f64,

    /// Print worker output lines as they are, without the `[rank N] ` prefix.
    #[arg(long = "no-prefix")]
    no_prefix: bool,

    /// The program every worker runs, and its arguments (put `--` before it). Everything after
    /// the program is its own; a flag before it that tandem does not know is an error naming it
    /// (torchrun's behaviour), not a program to start.
    #[arg(value_name = "PROGRAM [ARGS]", required = true, trailing_var_arg = true)]
    command: Vec<OsString>,
}

/// A comma-separated list of local ranks, kept as one value (clap would otherwise treat a
/// `Vec` as a repeatable flag).
#[derive(Clone, Debug)]
struct RankList(Vec<u32>);

fn parse_rank_list(s: &str) -> Result<RankList, String> {
    parse_local_ranks(s).map(RankList)
}

fn seconds(flag: &'static str, secs: f64) -> Result<Duration, LaunchError> {
    Duration::try_from_secs_f64(secs)
        .map_err(|_| config(flag, format!("`{secs}` is not a number of seconds")))
}

fn config(flag: &'static str, message: impl Into<String>) -> LaunchError {
    LaunchError::Config { flag, message: message.into() }
}

impl LaunchArgs {
    /// The launch configuration these flags describe, contradictory flags refused by name.
    pub fn into_config(self) -> Result<LaunchConfig, LaunchError> {
        let args = self;
        let mut command = args.command.into_iter();
        let Some(program) = command.next() else {
            return Err(config("PROGRAM", "nothing to run (tandem run -- PROGRAM [ARGS])"));
        };
        let mut cfg = LaunchConfig::new(program, command);
        cfg.nnodes = args.nnodes.max;
        cfg.min_nnodes = (args.nnodes.min != args.nnodes.max).then_some(args.nnodes.min);
        cfg.rdzv_timeout = seconds("--rdzv-timeout", args.rdzv_timeout)?;
        cfg.nproc_per_node = args.nproc_per_node;
        cfg.node_rank = args.node_rank;
        cfg.master_addr = args.master_addr;
        cfg.master_port = args.master_port;
        cfg.rdzv_etcd = match (args.rdzv_backend.as_str(), args.rdzv_endpoints) {
            ("static" | "c10d", None) => None,
            ("static" | "c10d", Some(_)) => {
                return Err(config(
                    "--rdzv-endpoints",
                    "only applies with --rdzv-backend etcd (node 0 hosts a static rendezvous)",
                ))
            }
            ("etcd" | "etcd-v2", Some(list)) => Some(
                list.split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(String::from)
                    .collect(),
            ),
            ("etcd" | "etcd-v2", None) => {
                return Err(config(
                    "--rdzv-endpoints",
                    "is required with --rdzv-backend etcd (the cluster's host:port list)",
                ))
            }
            (other, _) => {
                return Err(config(
                    "--rdzv-backend",
                    format!("{other:?}: expected static, c10d or etcd"),
                ))
            }
        };
        cfg.max_restarts = args.max_restarts;
        cfg.live_recovery = args.live_recovery;
        cfg.min_nproc = args.min_nproc;
        cfg.min_nproc_per_node = args.min_nproc_per_node;
        cfg.monitor_interval = seconds("--monitor-interval", args.monitor_interval)?;
        cfg.stop_grace = seconds("--stop-grace", args.stop_grace)?;
        cfg.log_dir = args.log_dir;
        cfg.redirects = args.redirects.unwrap_or_default();
        cfg.tee = args.tee.unwrap_or_default();
        cfg.local_ranks_filter = args.local_ranks_filter.map(|l| l.0);
        cfg.prefix_output = !args.no_prefix;
        cfg.insecure = args.insecure;
        if let Some(path) = &args.secret_file {
            let secret = JobSecret::read_file(path);
            cfg.secret = Some(secret.map_err(|e| config("--secret-file", e.to_string()))?);
        }
        if args.standalone {
            if cfg.nnodes != 1 {
                let why = format!("is a single-node mode, but --nnodes is {}", cfg.nnodes);
                return Err(config("--standalone", why));
            }
            if cfg.master_port.is_some() {
                return Err(config("--standalone", "picks its own free port; drop --master-port"));
            }
            cfg.master_addr = "127.0.0.1".into();
        }
        cfg.run_id = match args.run_id {
            Some(id) => id,
            None if args.standalone => random_run_id(),
            None => "none".into(),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
