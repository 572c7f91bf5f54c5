//! A thread-local setting for the length of a call (autocast's dtype, recomputation, lending
//! tensors to a save).
use std::cell::Cell;
use std::thread::LocalKey;

/// Runs `f` with the thread-local `cell` set to `value`, then restores what it held before,
/// also when `f` panics.
pub(crate) fn with_cell<T: Copy + 'static, R>(
    cell: &'static LocalKey<Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static LocalKey<Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(cell, cell.with(|c| c.replace(value)));
    f()
}
