//! Learning-rate schedulers with state, matching `torch.optim.lr_scheduler` (StepLR,
//! CosineAnnealingLR, LinearLR) and insightface's arcface_torch `PolyScheduler` and
//! `PolynomialLRWarmup`.
//!
//! A scheduler tracks one learning rate per optimizer param group (`base_lrs`, typically
//! `opt.group_lrs()` at construction) without holding the optimizer; after each `step()` hand
//! the new rates to the optimizer with [`LrScheduler::apply`] (or call
//! [`LrScheduler::step_optimizer`], which does both). As in torch, construction already takes
//! the step to epoch 0, so apply once right after building the scheduler.
//!
//! torch's schedulers are recursive (each lr is computed from the previous one), which drifts
//! from the closed form by a few ulps; these follow the same recursion in the same operation
//! order, so the rates equal torch's bit for bit (tests check 1e-12 relative).
//!
//! Hand-written: no crate reproduces torch's recursive forms or state layout, and each
//! scheduler is a few lines of arithmetic.
//!
//! `state_dict()` has torch's keys (`last_epoch`, `base_lrs`, `_last_lr`, `_step_count`,
//! `_is_initial`, `_get_lr_called_within_step` and each scheduler's own fields); a torch-made
//! state_dict loads and continues the same sequence.
use tandem_ckpt::Value;

use crate::{OptimError, TorchOptimizer};

/// The learning-rate scheduler interface (as torch's `LRScheduler`).
pub trait LrScheduler {
    /// Advances one epoch/iteration and computes the new learning rates.
    fn step(&mut self);
    /// The current learning rate of the first param group.
    fn get_last_lr(&self) -> f64 {
        self.last_lrs()[0]
    }
    /// The current learning rate of every param group (torch's `get_last_lr()`).
    fn last_lrs(&self) -> &[f64];
    /// Index of the last step taken (`last_epoch` in torch; 0 right after construction).
    fn last_epoch(&self) -> i64;
    fn state_dict(&self) -> Value;
    /// Loads a state made by [`LrScheduler::state_dict`] or by torch for the same scheduler
    /// type and group count. Nothing changes when an error is returned.
    fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), OptimError>;

    /// Sets the optimizer's group learning rates to the scheduler's current ones.
    fn apply(&self, opt: &mut dyn TorchOptimizer) -> Result<(), OptimError> {
        opt.set_group_lrs(self.last_lrs())
    }
    /// `step()` then [`LrScheduler::apply`]: torch's `scheduler.step()` after `optimizer.step()`.
    fn step_optimizer(&mut self, opt: &mut dyn TorchOptimizer) -> Result<(), OptimError> {
        self.step();
        self.apply(opt)
    }
}

#[macro_use]
mod macros {
    /// `step`, `last_lrs` and `last_epoch` of a scheduler built on `Core` with its own
    /// `advance(initial)`: the same for every scheduler here.
    macro_rules! core_scheduler_methods {
        () => {
            fn step(&mut self) {
                self.advance(false)
            }
            fn last_lrs(&self) -> &[f64] {
                &self.core.last_lrs
            }
            fn last_epoch(&self) -> i64 {
                self.core.last_epoch
            }
        };
    }
}

mod core;
mod cosine;
mod linear;
mod poly;
mod poly_warmup;
pub mod schedule;
mod step;

pub use cosine::CosineAnnealingLR;
pub use linear::LinearLR;
pub use poly::PolyScheduler;
pub use poly_warmup::PolynomialLRWarmup;
pub use step::StepLR;
