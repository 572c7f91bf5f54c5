//! `Work`: the handle of an asynchronous collective (PyTorch's `Work`).
use crate::error::CommError;
use std::thread::JoinHandle;

/// A collective running in the background; `wait()` returns its buffer or its error.
pub struct Work<T> {
    op: &'static str,
    handle: JoinHandle<Result<T, CommError>>,
}

impl<T: Send + 'static> Work<T> {
    pub(crate) fn spawn(
        op: &'static str,
        f: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let handle =
            std::thread::Builder::new().name(format!("tandem-{op}")).spawn(f).unwrap_or_else(|e| {
                // Could not start a thread: report through wait() rather than panicking here.
                let reason = e.to_string();
                std::thread::spawn(move || {
                    Err(CommError::Internal {
                        op,
                        reason: format!("cannot spawn thread: {reason}"),
                    })
                })
            });
        Work { op, handle }
    }

    /// Blocks until the operation finished; returns the buffer.
    pub fn wait(self) -> Result<T, CommError> {
        let op = self.op;
        self.handle.join().unwrap_or_else(|_| {
            Err(CommError::Internal { op, reason: "the background operation panicked".into() })
        })
    }

    /// Whether `wait()` would return without blocking.
    pub fn is_completed(&self) -> bool {
        self.handle.is_finished()
    }
}
