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
/// as `tandem run` and `tandem train` show them. A line that cannot be written (stderr a file
/// on a full disk) is dropped: the launcher supervises on (`eprintln!` would panic).
pub fn launcher_events_on_stderr() -> tandem::launch::EventSink {
    tandem::launch::EventSink::new(|e| {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "{e}");
    })
}
