//! The `tandem` command line: launcher, training job, sampler inspection, checkpoint tools and
//! benchmarks. Each subcommand lives in its own module under `cmd/`.
// The doc comments of the flags are clap's `--help` text, `<DIR>`-style placeholders and
// `[a:b]` ranges included: they are not rustdoc markup.
#![allow(rustdoc::invalid_html_tags, rustdoc::broken_intra_doc_links)]
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
    /// Train with DDP: a classifier (mlp, cnn, resnet18) on the embedded digits, MNIST, CIFAR-10
    /// or synthetic data, or the face recipe (iresnet18 .. iresnet200 or r18 .. r200, mbf, mbf_large + PartialFC) on RecordIO faces.
    // `--lr -1` is a value to check (and reject with a reason), not an unknown flag `-1`.
    #[command(allow_negative_numbers = true)]
    Train(Box<cmd::train::Args>),
    /// Print the sample indices one rank sees (DistributedSampler) as a JSON array.
    Sampler(cmd::sampler::Args),
    /// Inspect, convert, diff and load-check checkpoints (.pt / .safetensors).
    Ckpt(cmd::ckpt::Args),
    /// Dataset tools: `synth-faces` writes a synthetic face identity set (RecordIO + pairs.bin),
    /// `pack` packs a folder of identities into RecordIO, `synth-ijb` a small IJB-B/C set.
    Data(cmd::data::Args),
    /// A face backbone's embeddings of images, folders or a RecordIO set, as a .npy
    /// (arcface_torch's inference.py).
    Embed(cmd::embed::Args),
    /// Evaluate a face backbone: `ijb` is IJB-B/C 1:1 verification (insightface's eval_ijbc.py).
    Eval(cmd::eval::Args),
    /// Write a built-in model's weights (mlp, cnn, resnet18, iresnet18 .. iresnet200 or
    /// r18 .. r200, mbf, mbf_large, vit_t .. vit_l) as an ONNX model.
    Export(cmd::export::Args),
    /// Benchmarks that print ratios against a reference measured in the same run (runs the
    /// `tandem-bench` program beside this one).
    Bench(cmd::bench::Args),
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
    // (A process's start, for a timeline of a replacement: `TANDEM_LOG=tandem::process=debug`.)
    tracing::debug!(target: "tandem::process", "started");
    // Training and benchmarks allocate tensors per step; keep freed memory for reuse.
    tandem::nn::tune_allocator();
    // Kernels' parallel loops run in place on this thread instead of being handed to a pool
    // thread one op at a time (see tandem::nn::join_compute_pool).
    tandem::nn::join_compute_pool();
    // `tandem ckpt` and `tandem train` read the face recipe's earlier checkpoints too.
    tandem::recipes::face::register_checkpoint_formats();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
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
        Command::Train(a) => cmd::train::main(*a, matches.subcommand_matches("train")),
        Command::Sampler(a) => cmd::sampler::main(a),
        Command::Ckpt(a) => cmd::ckpt::main(a),
        Command::Data(a) => cmd::data::main(a),
        Command::Export(a) => cmd::export::main(a),
        Command::Embed(a) => cmd::embed::main(a),
        Command::Eval(a) => cmd::eval::main(a),
        Command::Bench(a) => cmd::bench::main(a),
        Command::Check(a) => cmd::check::main(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // (Written without eprintln!'s panic: stderr may be a file on a full disk.)
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "error: {}", error_chain(&e));
            std::process::exit(1);
        }
    }
}

/// The error and its causes on one line, `outer: inner: ...`, leaving out a cause whose text the
/// line already holds (an error that both shows its cause and returns it from `source()` would
/// otherwise print it twice). An option the training library names by its key is named by its
/// flag (`lr_scheduler=poly` reads `--lr-scheduler poly`), as are the settings its text names.
fn error_chain(e: &anyhow::Error) -> String {
    let text_of = |cause: &(dyn std::error::Error + 'static)| match cause.downcast_ref() {
        Some(e @ tandem::train::TrainError::Option { .. }) => e.naming_option(train::setting_flag),
        _ => cause.to_string(),
    };
    let mut line = String::new();
    for cause in e.chain() {
        let text = text_of(cause);
        if line.is_empty() {
            line = text;
        } else if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}
