//! Termination signals sent to the launcher (Ctrl-C, `kill`, a batch system's SIGTERM). Workers
//! live in their own process groups, so a terminal's Ctrl-C does not reach them: the supervisor
//! forwards what is recorded here.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::SigId;

use crate::error::LaunchError;

pub(crate) const FORWARDED: [i32; 4] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT];

/// Records the last termination signal received and how many arrived.
pub(crate) struct SignalWatch {
    ids: Vec<SigId>,
    last: Arc<AtomicUsize>,
    count: Arc<AtomicUsize>,
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
        Ok(SignalWatch { ids, last, count })
    }

    /// A watch that never fires (the caller handles signals itself).
    pub(crate) fn disabled() -> Self {
        SignalWatch {
            ids: Vec::new(),
            last: Arc::new(AtomicUsize::new(0)),
            count: Arc::new(AtomicUsize::new(0)),
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
