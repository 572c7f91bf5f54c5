//! `Work`: the handle of an asynchronous collective (PyTorch's `Work`).
use crate::error::CommError;
use std::thread::JoinHandle;

/// A collective running in the background; `wait()` returns its buffer or its error.
pub struct Work<T> {
    op: &'static str,
    state: State<T>,
}

enum State<T> {
    Running(JoinHandle<Result<T, CommError>>),
    /// Failed before it could start (bad arguments, no thread): nothing runs, nothing waits.
    Failed(CommError),
}

impl<T: Send + 'static> Work<T> {
    pub(crate) fn spawn(
        op: &'static str,
        f: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        Self::spawn_with(std::thread::Builder::new(), op, f)
    }

    /// Starts `f` on a thread from `builder`. When the thread cannot start, `f` is dropped
    /// unrun (and with it the call's ticket) and the error is reported through `wait()`.
    fn spawn_with(
        builder: std::thread::Builder,
        op: &'static str,
        f: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        match builder.name(format!("tandem-{op}")).spawn(f) {
            Ok(handle) => Work { op, state: State::Running(handle) },
            Err(e) => Work::failed(
                op,
                CommError::Internal { op, reason: format!("cannot start its thread: {e}") },
            ),
        }
    }

    /// A `Work` that already failed with `err`.
    pub(crate) fn failed(op: &'static str, err: CommError) -> Work<T> {
        Work { op, state: State::Failed(err) }
    }

    /// Blocks until the operation finished; returns the buffer.
    pub fn wait(self) -> Result<T, CommError> {
        let op = self.op;
        match self.state {
            State::Failed(e) => Err(e),
            State::Running(handle) => handle.join().unwrap_or_else(|_| {
                Err(CommError::Internal { op, reason: "the background operation panicked".into() })
            }),
        }
    }

    /// Whether `wait()` would return without blocking.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Failed(_) => true,
            State::Running(handle) => handle.is_finished(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::CallOrder;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_thread_that_cannot_start_fails_the_work_and_gives_its_place_up() {
        let order = Arc::new(CallOrder::default());
        let ticket = order.ticket();
        // No thread can have a stack this large: the spawn fails.
        let impossible = std::thread::Builder::new().stack_size(usize::MAX / 2);
        let work: Work<()> = Work::spawn_with(impossible, "broadcast", move || {
            drop(ticket.wait("broadcast", Duration::from_secs(1))?);
            Ok(())
        });
        assert!(work.is_completed());
        let err = work.wait().expect_err("the work cannot have run");
        assert!(err.to_string().contains("broadcast: internal error: cannot start its thread"));
        // The unrun call's ticket was dropped with it: the next call runs at once.
        let next = order.ticket().wait("barrier", Duration::from_secs(1));
        assert!(next.is_ok(), "the next call waited on a ticket that was never served");
    }
}
