//! The `tandem` command line: launcher, training job, sampler inspection, checkpoint tools and
//! benchmarks. Each subcommand lives in its own module under `cmd/`.
use clap::{Parser, Subcommand};

mod cmd;
mod train;

#[derive(Parser)]
#[command(name = "tandem", version, about = "Distributed data-parallel training toolkit")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start and supervise the ranks of a job on this host (torchrun-compatible).
    Run(cmd::run::Args),
    /// Train a model on the embedded digits data (or MNIST / synthetic) with DDP.
    Train(cmd::train::Args),
    /// Print the sample indices one rank sees (DistributedSampler) as a JSON array.
    Sampler(cmd::sampler::Args),
    /// Inspect, convert, diff and load-check checkpoints (.pt / .safetensors).
    Ckpt(cmd::ckpt::Args),
    /// Benchmarks that print ratios against a reference measured in the same run.
    Bench(tandem_bench::Args),
    /// Check a launch: every rank joins the group, all_reduces its rank and verifies the sum.
    Check(cmd::check::Args),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TANDEM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Training and benchmarks allocate tensors per step; keep freed memory for reuse.
    tandem_ddp::tune_allocator();
    let cli = Cli::parse();
    if matches!(cli.command, Command::Ckpt(_) | Command::Sampler(_)) {
        // Pure output tools die quietly on a closed pipe (`tandem ckpt inspect f.pt | head`) like
        // other Unix tools instead of panicking in println!. Not for ranks or the launcher: there
        // a closed socket or pipe must surface as an error naming the peer.
        // SAFETY: no other thread exists yet.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Run(a) => cmd::run::main(a),
        Command::Train(a) => cmd::train::main(a),
        Command::Sampler(a) => cmd::sampler::main(a),
        Command::Ckpt(a) => cmd::ckpt::main(a),
        Command::Bench(a) => tandem_bench::main(a),
        Command::Check(a) => cmd::check::main(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
