//! A world of N ranks as threads in this process, each with a real `ProcessGroup` rendezvoused
//! over loopback TCP (and real shared memory with the shm transport). Bounded: a rank that
//! panics or a world that does not finish in time fails the test instead of hanging it.
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tandem_comm::{init_with, InitMethod, InitOptions, ProcessGroup, TransportKind};

/// Test defaults: 10 s collective timeout, 20 s rendezvous, no desync check, and a job secret
/// (so every in-process world runs the authenticated handshakes).
pub fn test_options(kind: TransportKind) -> InitOptions {
    InitOptions {
        transport: Some(kind),
        timeout: Duration::from_secs(10),
        init_timeout: Duration::from_secs(20),
        run_id: "test-run".into(),
        desync_check: false,
        debug: tandem_comm::DebugLevel::Off,
        socket_ifname: None,
        hierarchical: None,
        secret: Some(
            tandem_comm::JobSecret::from_bytes(b"tandem test worlds' job secret")
                .expect("a valid secret"),
        ),
    }
}

/// Runs `f` on every rank of a fresh `n`-rank world (one thread per rank) and returns the
/// results by rank. Panics, naming the rank and its message, if a rank panics; panics if the
/// world takes longer than `limit`.
pub fn run_world<R: Send + 'static>(
    n: usize,
    opts: InitOptions,
    limit: Duration,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let url = format!("tcp://127.0.0.1:{}", crate::free_port());
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..n {
        let (tx, f, url, opts) = (tx.clone(), f.clone(), url.clone(), opts.clone());
        std::thread::spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let pg = init_with(&InitMethod::tcp(&url, rank, n), &opts)
                    .unwrap_or_else(|e| panic!("init of rank {rank}: {e}"));
                f(pg)
            }));
            let _ = tx.send((rank, result));
        });
    }
    drop(tx);
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let deadline = Instant::now() + limit;
    for _ in 0..n {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((rank, Ok(r))) => out[rank] = Some(r),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or(p.downcast_ref::<&str>().map(|s| s.to_string()));
                panic!("rank {rank} panicked: {}", msg.unwrap_or_default())
            }
            Err(_) => panic!("world of {n} did not finish within {limit:?}"),
        }
    }
    out.into_iter().map(|r| r.expect("every rank reported")).collect()
}

/// [`run_world`] over TCP with the test defaults, bounded at 60 s.
pub fn run_tcp_world<R: Send + 'static>(
    n: usize,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_world(n, test_options(TransportKind::Tcp), Duration::from_secs(60), f)
}
