//! One module per subcommand. Each exposes `Args` (clap) and `main(Args) -> anyhow::Result<i32>`
//! returning the process exit code.
pub mod bench;
pub mod check;
pub mod ckpt;
pub mod data;
pub mod embed;
pub mod eval;
pub mod export;
pub mod onnxruntime;
pub mod run;
pub mod sampler;
pub mod train;

/// The launcher's events (restarts, lost ranks, the failure summary) on stderr, one line each,
/// as `tandem run` and `tandem train` show them.
pub fn launcher_events_on_stderr() -> tandem::launch::EventSink {
    tandem::launch::EventSink::new(|e| eprintln!("{e}"))
}
