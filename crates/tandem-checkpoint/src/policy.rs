//! When the training loop (tandem-train's `Trainer`) writes a checkpoint and how many it keeps:
//! a strategy object (what burn's `CheckpointingStrategy` is), so a run's saving schedule is one
//! value a user can replace rather than flags the loop reads.
use std::fmt::Debug;

/// Checkpoints kept when nothing says otherwise.
pub const KEEP_LAST: usize = 3;

/// When a run's checkpoints are written, how many are kept, and whether a thread writes them.
/// The training loop (tandem-train's `Trainer`) asks it at each moment a save could happen; a save it asks
/// for is a collective, so the answers must be the same on every rank.
pub trait CheckpointPolicy: Debug + Send + Sync {
    /// Whether to save after step `step` (1-based; the run's last step is [`at_end`]'s).
    ///
    /// [`at_end`]: CheckpointPolicy::at_end
    fn after_step(&self, step: u64) -> bool;

    /// Whether to save when epoch `epoch` (0-based) closes at step `step` (the run's last
    /// epoch is [`at_end`]'s; a step [`after_step`] just saved is not saved again).
    ///
    /// [`at_end`]: CheckpointPolicy::at_end
    /// [`after_step`]: CheckpointPolicy::after_step
    fn at_epoch_end(&self, _epoch: u64, _step: u64) -> bool {
        true
    }

    /// Whether to save when the run ends.
    fn at_end(&self) -> bool {
        true
    }

    /// Checkpoints kept: older ones are deleted once a newer one is complete and durable.
    fn keep_last(&self) -> usize {
        KEEP_LAST
    }

    /// Whether a thread writes the saves (training waits only for the staging copy).
    fn background(&self) -> bool {
        false
    }
}

/// The built-in policy: a checkpoint every `every` steps (0: none between epoch ends), at every
/// epoch end and at the end of the run; the last `keep_last` kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Periodic {
    pub every: u64,
    pub keep_last: usize,
    pub background: bool,
}

impl Periodic {
    /// Every `every` steps (0: at epoch ends only), [`KEEP_LAST`] kept, written synchronously.
    pub fn every(every: u64) -> Self {
        Periodic { every, keep_last: KEEP_LAST, background: false }
    }

    /// The last `n` checkpoints kept.
    pub fn keeping(mut self, n: usize) -> Self {
        self.keep_last = n;
        self
    }

    /// Saves written by a thread (or not).
    pub fn in_background(mut self, background: bool) -> Self {
        self.background = background;
        self
    }
}

impl Default for Periodic {
    fn default() -> Self {
        Periodic::every(0)
    }
}

impl CheckpointPolicy for Periodic {
    fn after_step(&self, step: u64) -> bool {
        self.every > 0 && step.is_multiple_of(self.every)
    }

    fn keep_last(&self) -> usize {
        self.keep_last
    }

    fn background(&self) -> bool {
        self.background
    }
}

/// No checkpoint at all (a benchmark, a run whose result is its metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Never;

impl CheckpointPolicy for Never {
    fn after_step(&self, _step: u64) -> bool {
        false
    }

    fn at_epoch_end(&self, _epoch: u64, _step: u64) -> bool {
        false
    }

    fn at_end(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periodic_saves_every_n_steps_and_never_saves_nothing() {
        let p = Periodic::every(3).keeping(2).in_background(true);
        let due: Vec<u64> = (1..=10).filter(|&s| p.after_step(s)).collect();
        assert_eq!(due, [3, 6, 9]);
        assert!(p.at_epoch_end(0, 4) && p.at_end());
        assert_eq!((p.keep_last(), p.background()), (2, true));
        assert!(!(1..=10).any(|s| Periodic::default().after_step(s)), "0: epoch ends only");
        assert!(!Never.after_step(5) && !Never.at_epoch_end(0, 5) && !Never.at_end());
    }
}
