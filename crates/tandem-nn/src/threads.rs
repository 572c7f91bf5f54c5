//! Makes the training thread one of the kernels' compute threads (rayon's global pool).
//!
//! candle's CPU ops and tandem's kernels run their loops on rayon's global pool. Called from a
//! thread outside the pool, each parallel loop is handed to a pool thread while the caller
//! blocks on a latch: two thread switches per op, even when the pool has one thread — which is
//! what every rank of a job with one core per rank has. Built with the calling thread as one
//! of its workers (`use_current_thread`), the pool runs the loops that thread starts in place,
//! and the other workers join in as before.
//!
//! candle 0.11's binary elementwise ops run on a second pool of candle's own, whose threads spin
//! 25,000 iterations for more work after each op before they park: with rayon's threads on
//! every core, that spinning thread takes a core from them (on 2 cores, 13% of a bench MLP
//! step's CPU time went to it; backward took 6.0 ms instead of 4.8). The same call sets
//! `CANDLE_BARRIER_POOL_SPIN_LIMIT` (read when candle's pool starts) to a short spin unless the
//! process already sets it.
use std::sync::OnceLock;

static JOINED: OnceLock<bool> = OnceLock::new();

/// candle's elementwise pool's spin before parking (iterations), as the launcher sets it too.
const CANDLE_SPIN: (&str, &str) = ("CANDLE_BARRIER_POOL_SPIN_LIMIT", "1000");

/// Builds rayon's global pool (`RAYON_NUM_THREADS` threads, or one per core) with the calling
/// thread as one of its workers, once per process (later calls return the first answer).
/// Returns whether it did: false when the pool was already built (by an earlier parallel loop
/// or another call), in which case everything works as before, only with the handoffs. Call it
/// first thing, from the thread that will train, and keep that thread for the process's life
/// (the `tandem` binary calls it from `main`; `tandem::init()` does not: a library should not
/// take over its host's thread pool unasked).
pub fn join_compute_pool() -> bool {
    if std::env::var_os(CANDLE_SPIN.0).is_none() {
        // Called first thing in `main` (see above), before other threads read the environment.
        std::env::set_var(CANDLE_SPIN.0, CANDLE_SPIN.1);
    }
    *JOINED
        .get_or_init(|| rayon::ThreadPoolBuilder::new().use_current_thread().build_global().is_ok())
}

/// Whether [`join_compute_pool`] made this process's global pool.
pub fn compute_pool_joined() -> bool {
    JOINED.get().copied().unwrap_or(false)
}
