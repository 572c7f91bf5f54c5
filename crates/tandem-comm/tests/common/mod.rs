//! Worlds of N ranks as threads with real sockets (and real shared memory), bounded in time:
//! tandem-testutil's world with this suite's defaults.
#![allow(dead_code)]
use std::time::Duration;
use tandem_comm::{InitOptions, ProcessGroup, TransportKind};

pub use tandem_testutil::run_world as run_world_with;

pub fn opts(kind: TransportKind) -> InitOptions {
    tandem_testutil::test_options(kind)
}

pub fn run_world<R: Send + 'static>(
    n: usize,
    kind: TransportKind,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_world_with(n, opts(kind), Duration::from_secs(30), f)
}
