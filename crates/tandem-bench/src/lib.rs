//! tandem-bench: the `tandem bench ...` subcommands. Every benchmark prints ratios against a
//! reference measured in the same run; `report` writes docs/BENCHMARKS.md with plots. Kept out
//! of the `tandem` library so that users do not compile clap, plotters or the bundled font.
use clap::Subcommand;

/// The PyTorch peer scripts (same work as tandem's benchmarks), relative to the repository root.
pub const PEERS_DIR: &str = "scripts/peers";

pub mod allreduce;
pub mod ckpt;
pub mod conv;
pub mod ddp;
pub mod face;
pub mod live;
mod local_ranks;
pub mod partial_fc;
pub mod report;
pub mod save_stall;
pub mod zero;

#[derive(clap::Args)]
pub struct Args {
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
    /// The face-recognition recipe's samples/s against PyTorch running it (same data and init).
    Face(face::Args),
    /// What live recovery costs: a job with a worker killed every N s against it uninterrupted.
    Live(live::Args),
    /// PartialFC class-centre memory per rank (centres + momentum) vs C*E*4*2/W.
    PartialFc(partial_fc::Args),
    /// per-op ms of the conv and BatchNorm kernels on ResNet-18's shapes vs torch.
    Conv(conv::Args),
    /// Runs all of the above beside PyTorch and writes docs/BENCHMARKS.md with PNG plots.
    Report(report::Args),
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
    let result = f(&dir);
    if own_dir {
        std::fs::remove_dir_all(&dir).ok();
    }
    result
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    match args.which {
        Which::Allreduce(a) => allreduce::main(a),
        Which::Ddp(a) => ddp::main(a),
        Which::Ckpt(a) => ckpt::main(a),
        Which::Conv(a) => conv::main(a),
        Which::SaveStall(a) => save_stall::main(a),
        Which::Zero(a) => zero::main(a),
        Which::Face(a) => face::main(a),
        Which::PartialFc(a) => partial_fc::main(a),
        Which::Live(a) => live::main(a),
        Which::Report(a) => report::main(a),
    }
}
