//! `tandem-bench`: the program behind `tandem bench ...` (the `tandem` binary runs this one,
//! installed beside it). Every benchmark prints ratios against a reference measured in the same
//! run; `report` writes docs/BENCHMARKS.md with plots. A program of its own, over tandem's
//! library calls, so that neither the library nor the `tandem` binary compiles clap's benchmark
//! flags, plotters or the bundled font.
// The doc comments of the flags are clap's `--help` text, `<DIR>`-style placeholders and
// `[a:b]` ranges included: they are not rustdoc markup.
#![allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// The PyTorch peer scripts (same work as tandem's benchmarks), relative to the repository root.
pub const PEERS_DIR: &str = "scripts/peers";

mod allreduce;
mod chaos;
mod ckpt;
mod ddp;
mod face;
mod face_scale;
mod fsdp;
mod live;
mod loader;
mod local_ranks;
mod ops;
mod partial_fc;
mod report;
mod save_stall;
mod train_job;
mod zero;

#[derive(Parser)]
#[command(
    name = "tandem bench",
    bin_name = "tandem bench",
    version,
    about = "Benchmarks that print ratios against a reference measured in the same run"
)]
struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// all_reduce time, algbw, busbw and memcpy bandwidth per message size.
    Allreduce(allreduce::Args),
    /// samples/s of plain training vs Ddp with N ranks.
    Ddp(ddp::Args),
    /// checkpoint save/load throughput vs dd and torch.
    Ckpt(ckpt::Args),
    /// how long a checkpoint save stops training: synchronous vs background writes.
    SaveStall(save_stall::Args),
    /// optimizer-state bytes per rank with ZeroRedundancyOptimizer vs unsharded.
    Zero(zero::Args),
    /// peak memory and samples/s of Fsdp against Ddp and PyTorch FSDP2 (arcface_torch's ViT).
    Fsdp(fsdp::Args),
    /// The face-recognition recipe's samples/s against PyTorch running it (same data and init).
    Face(face::Args),
    /// The face recipe as its head and world grow: the largest head each side trains, and
    /// samples/s and memory per rank over rank and class counts (JSON for the report).
    FaceScale(face_scale::Args),
    /// What live recovery costs: a job with a worker killed every N s against it uninterrupted.
    Live(live::Args),
    /// A soak of live recovery on 3 simulated hosts under seeded faults (kills, host 0 lost,
    /// cut links, packet loss, a full disk, etcd members lost): every run must finish cleanly.
    Chaos(chaos::Args),
    /// PartialFC class-centre memory per rank (centres + momentum) vs C*E*4*2/W.
    PartialFc(partial_fc::Args),
    /// per-op ms of every op of a network's training step (ResNet-18, IResNet-18, ViT-T,
    /// MobileFaceNet) vs torch on the same shapes and inputs.
    #[command(visible_alias = "conv")]
    Ops(ops::Args),
    /// The face input pipeline's decode rate as its worker threads grow, vs PyTorch's DataLoader.
    Loader(loader::Args),
    /// Runs all of the above beside PyTorch and writes docs/BENCHMARKS.md with PNG plots.
    Report(report::Args),
    /// One rank of a multi-rank benchmark, its job in $TANDEM_BENCH_JOB (started by the
    /// benchmark itself).
    #[command(hide = true)]
    Worker {
        #[arg(value_enum)]
        bench: local_ranks::Bench,
    },
}

/// Runs `f` in `dir`, or in a fresh `<prefix>-<pid>` directory under the current one that is
/// removed afterwards (benchmarks writing files: checkpoints, dd output).
pub(crate) fn in_scratch_dir<T>(
    dir: Option<&std::path::Path>,
    prefix: &str,
    f: impl FnOnce(&std::path::Path) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    use anyhow::Context;
    let (dir, own_dir) = match dir {
        Some(d) => (d.to_path_buf(), false),
        None => (std::path::PathBuf::from(format!("{prefix}-{}", std::process::id())), true),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Absolute: a job started in the directory must still find the files named under it.
    let dir = std::path::absolute(&dir).with_context(|| format!("resolving {}", dir.display()))?;
    let result = f(&dir);
    // A failed run's directory stays, for its logs.
    if own_dir && result.is_ok() {
        std::fs::remove_dir_all(&dir).ok();
    }
    result
}

/// The `tandem` executable the benchmarks run (`tandem train`, `tandem run`, `tandem data`):
/// `$TANDEM_EXE`, else the one beside this program (cargo builds both into one directory).
pub(crate) fn tandem_exe() -> anyhow::Result<PathBuf> {
    if let Some(exe) = std::env::var_os("TANDEM_EXE") {
        return Ok(PathBuf::from(exe));
    }
    let me = std::env::current_exe().context("locating the tandem-bench executable")?;
    let exe = me.with_file_name(format!("tandem{}", std::env::consts::EXE_SUFFIX));
    anyhow::ensure!(
        exe.is_file(),
        "no tandem executable beside {} (set TANDEM_EXE, or build both: cargo build --release)",
        me.display()
    );
    Ok(exe)
}

/// This program, for the benchmarks' own worker ranks (`tandem-bench worker ddp`).
pub(crate) fn bench_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("locating the tandem-bench executable")
}

fn main() {
    // Benchmarks allocate tensors per step; keep freed memory for reuse (as `tandem` does).
    tandem::nn::tune_allocator();
    tandem::nn::join_compute_pool();
    let args = Args::parse();
    match run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(args: Args) -> anyhow::Result<i32> {
    match args.which {
        Which::Allreduce(a) => allreduce::main(a),
        Which::Ddp(a) => ddp::main(a),
        Which::Ckpt(a) => ckpt::main(a),
        Which::Ops(a) => ops::main(a),
        Which::Loader(a) => loader::main(a),
        Which::SaveStall(a) => save_stall::main(a),
        Which::Zero(a) => zero::main(a),
        Which::Fsdp(a) => fsdp::main(a),
        Which::Face(a) => face::main(a),
        Which::FaceScale(a) => face_scale::main(a),
        Which::PartialFc(a) => partial_fc::main(a),
        Which::Live(a) => live::main(a),
        Which::Chaos(a) => chaos::main(a),
        Which::Report(a) => report::main(a),
        Which::Worker { bench } => {
            use local_ranks::{job, Bench};
            match bench {
                Bench::Allreduce => allreduce::worker(job()?),
                Bench::Ddp => ddp::worker(job()?),
                Bench::Fsdp => fsdp::worker(job()?),
                Bench::Zero => zero::worker(job()?),
            }
        }
    }
}

/// The typed rows a benchmark printed with `--json`, one JSON object per line (`what` names it
/// in errors; its other lines are not JSON).
pub(crate) fn json_lines<T: serde::de::DeserializeOwned>(
    out: &str,
    what: &str,
) -> anyhow::Result<Vec<T>> {
    let rows = out
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| serde_json::from_str(l).with_context(|| format!("{what} printed {l:?}")))
        .collect::<anyhow::Result<Vec<T>>>()?;
    anyhow::ensure!(!rows.is_empty(), "{what} printed no JSON lines");
    Ok(rows)
}
