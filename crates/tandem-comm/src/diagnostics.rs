//! Lines a user asked for or must see, sent through `tracing`: the set-up logs that
//! `TORCH_DISTRIBUTED_DEBUG=INFO` asks for, and a process's last words before `MPI_Abort`.
//!
//! Both go to the program's `tracing` subscriber (target `tandem::debug`). When none would show
//! them (no subscriber, or one that filters them out) they go to stderr instead: PyTorch prints
//! the same set-up lines on stderr when asked, and an aborting process has no caller left to
//! hand its reason to. This module is the one place the library writes to stderr.

use std::io::Write;

/// The `tracing` target of these lines.
pub const TARGET: &str = "tandem::debug";

/// A set-up line asked for by `TORCH_DISTRIBUTED_DEBUG` / `TANDEM_DEBUG` (INFO or DETAIL).
pub fn debug_line(line: &str) {
    if tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        tracing::info!(target: TARGET, "{line}");
    } else {
        to_stderr(line);
    }
}

/// Why this process is about to abort, said where it can still be read.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn last_words(line: &str) {
    if tracing::enabled!(target: TARGET, tracing::Level::ERROR) {
        tracing::error!(target: TARGET, "{line}");
    } else {
        to_stderr(line);
    }
}

fn to_stderr(line: &str) {
    // Nothing to do if stderr is gone.
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
