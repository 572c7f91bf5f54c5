//! Termination signals sent to the launcher (Ctrl-C, `kill`, a batch system's SIGTERM). Workers
//! live in their own process groups, so a terminal's Ctrl-C does not reach them: the supervisor
//! forwards what is recorded here. The same handlers wake a supervisor that pauses between its
//! checks of the workers, as does a worker's exit (SIGCHLD): a dead rank is seen at once, not
//! up to a monitor interval later.
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGCHLD, SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::SigId;

use crate::error::LaunchError;

pub(crate) const FORWARDED: [i32; 4] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT];

/// Records the last termination signal received and how many arrived.
pub(crate) struct SignalWatch {
    ids: Vec<SigId>,
    last: Arc<AtomicUsize>,
    count: Arc<AtomicUsize>,
    /// A byte arrives here with every forwarded signal and every child's exit.
    wake: Option<UnixStream>,
}

impl SignalWatch {
    /// Installs the handlers (process-wide, until dropped).
    pub(crate) fn install() -> Result<Self, LaunchError> {
        let last = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(AtomicUsize::new(0));
        let mut ids = Vec::new();
        for sig in FORWARDED {
            let (l, c) = (last.clone(), count.clone());
            // SAFETY: the action only stores to atomics, which is async-signal-safe.
            let id = unsafe {
                signal_hook::low_level::register(sig, move || {
                    l.store(sig as usize, Ordering::SeqCst);
                    c.fetch_add(1, Ordering::SeqCst);
                })
            }
            .map_err(LaunchError::Signals)?;
            ids.push(id);
        }
        let (wake, waker) = UnixStream::pair().map_err(LaunchError::Signals)?;
        for sig in FORWARDED.into_iter().chain([SIGCHLD]) {
            let waker = waker.try_clone().map_err(LaunchError::Signals)?;
            ids.push(
                signal_hook::low_level::pipe::register(sig, waker).map_err(LaunchError::Signals)?,
            );
        }
        Ok(SignalWatch { ids, last, count, wake: Some(wake) })
    }

    /// A watch that never fires (the caller handles signals itself).
    pub(crate) fn disabled() -> Self {
        SignalWatch {
            ids: Vec::new(),
            last: Arc::new(AtomicUsize::new(0)),
            count: Arc::new(AtomicUsize::new(0)),
            wake: None,
        }
    }

    /// Waits `interval`, or less: until a termination signal arrives or (with the handlers
    /// installed) a child exits. A disabled watch sleeps in short slices.
    pub(crate) fn pause(&self, interval: Duration) {
        let until = Instant::now() + interval;
        while self.received().is_none() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let Some(mut wake) = self.wake.as_ref() else {
                std::thread::sleep(left.min(Duration::from_millis(50)));
                continue;
            };
            // (A zero timeout would mean none: `left` is not zero here.)
            if wake.set_read_timeout(Some(left)).is_err() {
                std::thread::sleep(left.min(Duration::from_millis(50)));
                continue;
            }
            // Any byte, or a read a signal interrupted, is a wake; the rest of a burst of bytes
            // wakes the next pause early, which only checks the workers once more.
            let mut bytes = [0u8; 64];
            match wake.read(&mut bytes) {
                Ok(_) => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return,
                Err(_) => {}
            }
        }
    }

    /// The last signal received and how many have arrived, if any.
    pub(crate) fn received(&self) -> Option<(i32, usize)> {
        match self.count.load(Ordering::SeqCst) {
            0 => None,
            n => Some((self.last.load(Ordering::SeqCst) as i32, n)),
        }
    }
}

impl Drop for SignalWatch {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}
