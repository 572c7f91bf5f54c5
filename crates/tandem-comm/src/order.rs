//! Call order within one rank: every call on a group (sync, async or p2p) takes a ticket when it
//! is issued and runs when its ticket is served, so the ranks' transports see calls in the order
//! each rank issued them, whatever threads they ran on.
//!
//! Two guarantees that a plain counter lacks: a ticket dropped without running (its arguments
//! were bad, its thread could not start, its caller gave up) gives its place up instead of
//! blocking every later call forever; and waiting for a turn is bounded, so a stuck earlier call
//! surfaces as an error naming the waiting op rather than a hang.
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::CommError;

#[derive(Default)]
pub(crate) struct CallOrder {
    next: AtomicU64,
    queue: Mutex<Queue>,
    turn: Condvar,
}

#[derive(Default)]
struct Queue {
    serving: u64,
    /// Tickets dropped before their turn; skipped when the turn reaches them.
    abandoned: BTreeSet<u64>,
    /// The group's first failure: later calls fail at once.
    broken: Option<String>,
}

impl Queue {
    fn advance(&mut self) {
        self.serving += 1;
        while self.abandoned.remove(&self.serving) {
            self.serving += 1;
        }
    }
}

impl CallOrder {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Plain counters and a set: a panic elsewhere cannot leave them inconsistent.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place at the end of the queue. Take it only once the call's arguments are valid.
    pub(crate) fn ticket(self: &Arc<Self>) -> Ticket {
        Ticket { order: Some(self.clone()), n: self.next.fetch_add(1, Ordering::AcqRel) }
    }

    /// The group's first failure, if any.
    pub(crate) fn broken(&self) -> Option<String> {
        self.lock().broken.clone()
    }

    /// Records the group's first failure (later ones keep the first).
    pub(crate) fn set_broken(&self, reason: String) {
        self.lock().broken.get_or_insert(reason);
    }
}

/// A place in a group's call order. Dropping it unused gives the place up.
pub(crate) struct Ticket {
    order: Option<Arc<CallOrder>>,
    n: u64,
}

impl Ticket {
    /// Waits until every call issued before this one on this rank has finished. Fails when none
    /// of them finishes for `timeout` (each one that finishes restarts the clock: a long queue of
    /// progressing calls is fine, a stuck one is not); the group is then broken, since this rank
    /// skips a call the other ranks may run.
    pub(crate) fn wait(mut self, op: &'static str, timeout: Duration) -> Result<Turn, CommError> {
        let order = self.order.take().expect("a ticket waits once");
        let mut queue = order.lock();
        let mut last_progress = Instant::now();
        while queue.serving != self.n {
            let before = queue.serving;
            let left = timeout.saturating_sub(last_progress.elapsed());
            if left.is_zero() {
                let ahead = self.n - queue.serving;
                queue.broken.get_or_insert_with(|| {
                    format!("{op} gave up waiting for this rank's earlier calls after {timeout:?}")
                });
                drop(queue);
                self.order = Some(order); // dropped below: gives the place up
                return Err(CommError::QueueTimeout { op, waited: timeout, ahead });
            }
            queue = order.turn.wait_timeout(queue, left).unwrap_or_else(|p| p.into_inner()).0;
            if queue.serving != before {
                last_progress = Instant::now();
            }
        }
        drop(queue);
        Ok(Turn { order })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(order) = self.order.take() else { return };
        let mut queue = order.lock();
        if queue.serving == self.n {
            queue.advance();
            order.turn.notify_all();
        } else {
            queue.abandoned.insert(self.n);
        }
    }
}

/// The right to run now. Dropping it (also by panic) lets the next call run.
pub(crate) struct Turn {
    order: Arc<CallOrder>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.order.lock().advance();
        self.order.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn a_dropped_ticket_does_not_block_the_calls_behind_it() {
        let order = Arc::new(CallOrder::default());
        let first = order.ticket();
        let skipped = order.ticket();
        let third = order.ticket();
        drop(skipped);
        drop(first.wait("first", T).unwrap());
        let started = Instant::now();
        drop(third.wait("third", T).expect("third runs"));
        assert!(started.elapsed() < Duration::from_secs(1));
        // And a ticket dropped while it is being served passes the turn on at once.
        let now = order.ticket();
        let after = order.ticket();
        drop(now);
        drop(after.wait("after", T).expect("after runs"));
    }

    #[test]
    fn waiting_behind_a_stuck_call_is_bounded_and_names_the_op() {
        let order = Arc::new(CallOrder::default());
        let stuck = order.ticket().wait("all_reduce", T).unwrap();
        let queued = order.ticket();
        let started = Instant::now();
        let err = match queued.wait("broadcast", Duration::from_millis(200)) {
            Ok(_) => panic!("a call behind a stuck one must not run"),
            Err(e) => e,
        };
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(started.elapsed() < Duration::from_secs(3));
        let msg = err.to_string();
        assert!(msg.starts_with("broadcast:"), "{msg}");
        assert!(order.broken().is_some_and(|b| b.contains("broadcast")));
        // Once the stuck call ends, the order moves on past the abandoned place.
        drop(stuck);
        drop(order.ticket().wait("barrier", T).expect("later calls still get a turn"));
    }

    #[test]
    fn progress_ahead_restarts_the_clock() {
        let order = Arc::new(CallOrder::default());
        let turns: Vec<Ticket> = (0..4).map(|_| order.ticket()).collect();
        let last = order.ticket();
        let o = order.clone();
        let worker = std::thread::spawn(move || {
            for t in turns {
                let turn = t.wait("step", T).unwrap();
                std::thread::sleep(Duration::from_millis(150));
                drop(turn);
            }
            drop(o);
        });
        // 4 × 150 ms ahead, but never 400 ms without progress.
        drop(last.wait("last", Duration::from_millis(400)).expect("progress ahead keeps it alive"));
        worker.join().unwrap();
    }
}
