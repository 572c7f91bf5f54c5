//! The communicator's watchdog: a thread that polls the oldest unfinished collective and, when
//! it is late or NCCL reports an asynchronous error, names the ranks that did not reach it and
//! aborts the communicator. Completion events live here too.
use super::library::{check_cuda, nccl_reason, Libraries, RawEvent, RawStream};
use super::{Handle, Shared};
use crate::error::CommError;
use crate::store::Store;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A CUDA event recorded after a collective; destroyed with its last holder.
pub(super) struct Event {
    libs: &'static Libraries,
    raw: Handle,
}

impl Event {
    pub(super) fn record(
        l: &'static Libraries,
        stream: RawStream,
    ) -> Result<Arc<Event>, CommError> {
        let ev = Event { libs: l, raw: Handle(l.new_event()?) };
        // SAFETY: a live event and the communicator's stream.
        check_cuda(l, "cudaEventRecord", unsafe { (l.event_record)(ev.raw.0, stream) })?;
        Ok(Arc::new(ev))
    }

    pub(super) fn raw(&self) -> RawEvent {
        self.raw.0
    }

    /// Whether the work before the event has finished; a CUDA error is returned as such.
    pub(super) fn is_done(&self, op: &'static str) -> Result<bool, CommError> {
        // SAFETY: a live event.
        match unsafe { (self.libs.event_query)(self.raw.0) } {
            super::library::CUDA_SUCCESS => Ok(true),
            super::library::CUDA_ERROR_NOT_READY => Ok(false),
            rc => check_cuda(self.libs, op, rc).map(|_| false),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: made by cudaEventCreateWithFlags; CUDA defers the release while it is pending.
        unsafe { (self.libs.event_destroy)(self.raw.0) };
    }
}

/// A collective the watchdog is watching.
pub(super) struct Pending {
    /// Recorded after the collective on the communicator's stream.
    pub event: Arc<Event>,
    /// Recorded on the caller's stream when the collective was queued: its inputs are ready
    /// once this completes.
    pub ready: Option<Arc<Event>>,
    pub op: &'static str,
    pub seq: u64,
    /// When the watchdog first saw the collective able to run (inputs ready, everything before
    /// it on the communicator done): the timeout counts from here, so time spent waiting for
    /// the caller's own kernels (a long backward queued ahead) is not held against the peers.
    pub since: Option<Instant>,
}

/// Asks the other ranks, through the store, which call they are stuck in.
pub(super) struct Reporter {
    store: Store,
    prefix: String,
}

impl Reporter {
    pub(super) fn new(store: Store, prefix: &str) -> Reporter {
        Reporter { store, prefix: format!("{prefix}/nccl/stuck") }
    }

    /// Publishes this rank's stuck call, waits up to `grace` for the others, and describes the
    /// ranks that did not report or are elsewhere.
    fn who_is_missing(&self, rank: usize, size: usize, seq: u64, grace: Duration) -> String {
        let key = |r: usize| format!("{}/{r}", self.prefix);
        if let Err(e) = self.store.set(&key(rank), seq.to_string().as_bytes()) {
            return format!("the store is unreachable ({e}), so rank 0 (its host) may be gone");
        }
        let keys: Vec<String> = (0..size).map(key).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let _ = self.store.wait_timeout(&refs, grace);
        let missing = self.store.missing(&refs).unwrap_or_default();
        let mut absent = Vec::new();
        let mut elsewhere = Vec::new();
        for (r, k) in keys.iter().enumerate() {
            if missing.contains(k) {
                absent.push(r.to_string());
            } else if let Ok(v) = self.store.get(k) {
                if v != seq.to_string().as_bytes() {
                    elsewhere.push(format!("rank {r} at call #{}", String::from_utf8_lossy(&v)));
                }
            }
        }
        let mut out = Vec::new();
        if !absent.is_empty() {
            out.push(format!(
                "rank(s) {} did not report within {grace:?} (dead, or not in a collective)",
                absent.join(", ")
            ));
        }
        if !elsewhere.is_empty() {
            out.push(format!("{} (collectives out of order)", elsewhere.join(", ")));
        }
        if out.is_empty() {
            "every rank is in this call (a slow device or network)".into()
        } else {
            out.join("; ")
        }
    }
}

/// Starts the watchdog of `shared`; it ends when the communicator is dropped.
pub(super) fn spawn(shared: &Arc<Shared>) -> Result<(), CommError> {
    let weak = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("tandem-nccl-watchdog".into())
        .spawn(move || run(weak))
        .map(|_| ())
        .map_err(|e| CommError::Internal {
            op: "nccl init",
            reason: format!("cannot start the watchdog thread: {e}"),
        })
}

fn run(weak: Weak<Shared>) {
    let mut device_set = false;
    loop {
        let Some(sh) = weak.upgrade() else { return };
        if !device_set {
            // SAFETY: plain runtime call; events are queried on the communicator's device.
            unsafe { (sh.libs.set_device)(sh.device) };
            device_set = true;
        }
        if sh.broken_reason().is_some() {
            return;
        }
        let front = {
            let mut q = sh.pending.lock().unwrap_or_else(|p| p.into_inner());
            q.front_mut().map(|p| {
                if p.since.is_none()
                    && p.ready.as_ref().is_none_or(|r| r.is_done(p.op).unwrap_or(true))
                {
                    p.since = Some(Instant::now());
                }
                (p.event.clone(), p.op, p.seq, p.since)
            })
        };
        let Some((event, op, seq, since)) = front else {
            drop(sh);
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        match event.is_done(op) {
            Ok(true) => {
                let mut q = sh.pending.lock().unwrap_or_else(|p| p.into_inner());
                if q.front().is_some_and(|p| p.seq == seq) {
                    q.pop_front();
                }
                continue;
            }
            Ok(false) => {}
            Err(e) => {
                sh.fail(&format!("{op} #{seq}: {e}; communicator aborted"));
                return;
            }
        }
        let mut state = 0;
        // SAFETY: NCCL allows querying a communicator's async error from another thread.
        unsafe { (sh.libs.comm_get_async_error)(sh.comm.0, &mut state) };
        let late = since.is_some_and(|t| t.elapsed() > sh.timeout);
        if state != super::library::NCCL_SUCCESS && state != super::library::NCCL_IN_PROGRESS {
            let reason = nccl_reason(sh.libs, state, sh.comm.0);
            let who = sh.report(seq);
            sh.fail(&format!("{op} #{seq} failed: {reason}; {who}; communicator aborted"));
            return;
        }
        if late {
            let who = sh.report(seq);
            sh.fail(&format!(
                "{op} #{seq} did not finish within {:?}; {who}; communicator aborted",
                sh.timeout
            ));
            return;
        }
        drop(sh);
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Shared {
    fn report(&self, seq: u64) -> String {
        match &self.reporter {
            Some(r) => r.who_is_missing(
                self.rank,
                self.size,
                seq,
                self.timeout.min(Duration::from_secs(3)),
            ),
            None => "a group of one rank".into(),
        }
    }
}
