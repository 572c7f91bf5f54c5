//! Whether this thread is recomputing a forward for its backward (activation checkpointing, a
//! sharded model's unit): layers with side effects in training mode — BatchNorm's running
//! statistics — skip them then, so a block computed twice in a step updates its statistics once
//! (PyTorch's `checkpoint` updates them twice).
use std::cell::Cell;

thread_local! {
    static RECOMPUTING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` as a recomputation (see the module docs), then restores the enclosing setting,
/// also when `f` panics.
pub fn recompute<R>(f: impl FnOnce() -> R) -> R {
    crate::scoped::with_cell(&RECOMPUTING, true, f)
}

/// Whether this thread is inside [`recompute`].
pub fn recomputing() -> bool {
    RECOMPUTING.with(Cell::get)
}
