//! Worlds of N ranks as threads with real sockets (and real shared memory), bounded in time.
#![allow(dead_code)]
use std::sync::mpsc;
use std::time::Duration;
use tandem_comm::{init_with, InitMethod, InitOptions, ProcessGroup, TransportKind};

pub fn opts(kind: TransportKind) -> InitOptions {
    InitOptions {
        transport: Some(kind),
        timeout: Duration::from_secs(10),
        init_timeout: Duration::from_secs(20),
        run_id: "test-run".into(),
        desync_check: false,
    }
}

/// Runs `f` on every rank of a fresh `n`-rank world (one thread per rank) and returns the
/// results by rank. Panics (never hangs) if a rank takes longer than `limit`.
pub fn run_world_with<R: Send + 'static>(
    n: usize,
    opts: InitOptions,
    limit: Duration,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let port = tandem_testutil::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let f = std::sync::Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..n {
        let (tx, f, url, opts) = (tx.clone(), f.clone(), url.clone(), opts.clone());
        std::thread::spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let pg = init_with(&InitMethod::tcp(&url, rank, n), &opts).expect("init");
                f(pg)
            }));
            let _ = tx.send((rank, result));
        });
    }
    drop(tx);
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let deadline = std::time::Instant::now() + limit;
    for _ in 0..n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(r))) => out[rank] = Some(r),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or(p.downcast_ref::<&str>().map(|s| s.to_string()));
                panic!("rank {rank} panicked: {msg:?}")
            }
            Err(_) => panic!("world of {n} did not finish within {limit:?}"),
        }
    }
    out.into_iter().map(|r| r.expect("every rank reported")).collect()
}

pub fn run_world<R: Send + 'static>(
    n: usize,
    kind: TransportKind,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_world_with(n, opts(kind), Duration::from_secs(30), f)
}
