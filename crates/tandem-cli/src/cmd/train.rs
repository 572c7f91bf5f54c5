//! `tandem train`: the main job. Run plainly, it is its own launcher: it starts
//! `--nproc-per-node` copies of itself through tandem-launch (console shows rank 0) and exits
//! with the job's code. Started by `tandem run`, torchrun, Slurm or mpirun, it is one rank.
use crate::train::config::TrainConfig;
use crate::train::console::Console;
use anyhow::Context;
use tandem::launch::{LaunchConfig, NprocPerNode};
use tandem::train::events::validation_text;
use tandem::train::Reporter;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub(crate) cfg: TrainConfig,
}

/// Marks a process started by `tandem train` itself (so it trains instead of launching again).
const WORKER_MARK: &str = "TANDEM_TRAIN_WORKER";

/// True when some launcher already described a world to this process.
fn launched() -> bool {
    ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", WORKER_MARK]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

pub fn main(args: Args, matches: Option<&clap::ArgMatches>) -> anyhow::Result<i32> {
    let mut cfg = match matches {
        Some(m) => crate::train::config::apply_config_file(args.cfg, m)?,
        None => args.cfg,
    };
    cfg.validate()?;
    if !launched() && (cfg.nproc_per_node > 1 || cfg.live_recovery) {
        return launch_ranks(cfg);
    }
    if cfg.out.is_none() && launched() {
        // Ranks started by an outside launcher must agree on one run directory without talking.
        // The launcher's job id (as the store is scoped by it), else the port every rank was
        // given (mpirun sets no id).
        let id = tandem::comm::job_id_from_env()
            .or_else(|| std::env::var("MASTER_PORT").ok())
            .unwrap_or_else(|| "job".into());
        cfg.out = Some(std::path::PathBuf::from("runs").join(format!("train-{id}")));
    }
    if cfg.fsdp {
        tandem::release_freed_memory(); // a sharded rank's memory follows what it holds
    }
    let run_dir = cfg.run_dir();
    let mut options = cfg.options(run_dir.clone())?;
    options.run.record = crate::train::config::to_toml(&cfg)?;
    let reporter = Reporter::new().with(Console::new());
    let summary = tandem::recipes::train(&options, &reporter)?;
    if summary.rank == 0 {
        if !summary.verification.is_empty() {
            println!("verification:{}", validation_text(&summary.verification));
        }
        if let (true, Some(times)) = (cfg.model.is_face(), summary.step_times) {
            eprintln!("{}", times.line());
        }
        print_op_times()?;
        if summary.device_peak_bytes.iter().any(|&b| b > 0) {
            let gib: Vec<String> = summary
                .device_peak_bytes
                .iter()
                .map(|&b| format!("{:.2}", b as f64 / (1u64 << 30) as f64))
                .collect();
            eprintln!("peak GPU memory per rank (GiB): {}", gib.join(" "));
        }
        if !launched() {
            write_config(&cfg, &run_dir)?;
        }
        let mut line = format!("final: epochs={} steps={}", summary.epochs, summary.steps);
        if let Some(acc) = summary.eval_accuracy {
            line += &format!(" eval_accuracy={acc:.4}");
        }
        if let Some(acc) = summary.verification_accuracy {
            line += &format!(" verification_accuracy={acc:.4}");
        }
        let checkpoint = summary.checkpoint.as_ref().map(|p| p.display().to_string());
        println!(
            "{line} samples_per_s={} checkpoint={}",
            tandem::train::metrics::three_figures(summary.samples_per_s),
            checkpoint.unwrap_or_else(|| "-".into())
        );
    }
    Ok(0)
}

/// With `TANDEM_PROFILE=ops`: rank 0's device time per kernel (tandem-cuda's kernels and cuDNN
/// calls), slowest first.
fn print_op_times() -> anyhow::Result<()> {
    use tandem::cuda::profile::{mode, op_times_text, take_op_times, Profile};
    if mode() == Profile::Ops {
        eprint!("{}", op_times_text(&take_op_times()?));
    }
    Ok(())
}

/// Writes `RUN_DIR/config.toml` (every setting of the run) and returns its path.
fn write_config(
    cfg: &TrainConfig,
    run_dir: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("creating run directory {}", run_dir.display()))?;
    let path = run_dir.join("config.toml");
    std::fs::write(&path, crate::train::config::to_toml(cfg)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Starts the ranks of this job on this host and waits for them. Each rank reads the job's
/// settings from the run's `config.toml` (written first, every setting in it), so the ranks
/// train exactly what this process parsed.
fn launch_ranks(mut cfg: TrainConfig) -> anyhow::Result<i32> {
    let run_dir = cfg.run_dir();
    cfg.out = Some(run_dir.clone());
    let config = write_config(&cfg, &run_dir)?;
    let exe = std::env::current_exe().context("locating the tandem executable")?;
    let args = vec!["train".into(), "--config".into(), config.into_os_string()];
    let mut lc = LaunchConfig::new(exe, args);
    lc.nproc_per_node = NprocPerNode::Count(cfg.nproc_per_node as u32);
    lc.run_id = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "train".into());
    // The console shows rank 0 as if it ran alone; the others' output reaches the failure summary.
    lc.local_ranks_filter = Some(vec![0]);
    lc.prefix_output = false;
    lc.stdout_passthrough_local_rank = Some(0);
    lc.extra_env.push((WORKER_MARK.into(), "1".into()));
    lc.live_recovery = cfg.live_recovery;
    lc.max_restarts = cfg.max_restarts;
    // Restarts and the failure summary (rank, exit code or signal, stderr tail) on stderr.
    lc.on_event = super::launcher_events_on_stderr();
    let outcome = tandem::launch::launch(&lc).context("starting the training ranks")?;
    Ok(outcome.exit_code)
}
