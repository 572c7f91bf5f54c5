//! tandem-optim: what `torch.optim` and `torch.amp` give a PyTorch user, for candle models.
//! Optimizers with `torch.optim` update rules and `state_dict` layout ([`TorchSgd`], [`TorchAdam`],
//! [`TorchAdamW`]), learning-rate schedulers ([`lr_scheduler`]), the fp16 [`GradScaler`], gradient
//! clipping ([`clip_grad_norm`]) and, with the `zero` feature (on by default), ZeRO-1
//! ([`ZeroRedundancyOptimizer`]: state sharded over a process group). Every optimizer also
//! implements `candle_nn::Optimizer`, so it drops into candle code unchanged.
//!
//! Each optimizer owns an ordered list of candle candle `Var`s (the model's `named_parameters()`
//! order, optionally split into param groups as in torch) and steps from a `GradStore` holding
//! the already-averaged gradients. A parameter without a gradient in the store is skipped, as
//! torch skips `p.grad is None`. `state_dict()` / `load_state_dict()` use PyTorch's layout:
//! `{'state': {param_index: {...}}, 'param_groups': [{hyperparameters..., 'params': [indices]}]}`,
//! so optimizer state resumes across frameworks.
//!
//! Written here rather than taken from candle-nn: candle-nn's SGD has no momentum and its AdamW
//! has neither torch's state layout nor Adam's coupled weight decay.
/// The optimizer impls shared by the optimizers here: an inherent `step` (so a call never
/// depends on which optimizer trait is in scope), [`TorchOptimizer`] stepping every parameter
/// that has a gradient through the type's own `update` rule (everything else is the param
/// groups', `self.groups`), and `candle_nn::Optimizer`, so the type drops into candle code.
/// `$config` is the type's config; `$keys` are the hyperparameter names its state_dict groups carry.
macro_rules! impl_optimizer_via_groups {
    ($ty:ident, $config:ty, $keys:expr) => {
        impl $ty {
            /// One update of every parameter that has a gradient in `grads` (a parameter
            /// without one is skipped, as torch skips `p.grad is None`).
            pub fn step(
                &mut self,
                grads: &candle_core::backprop::GradStore,
            ) -> Result<(), $crate::OptimError> {
                for (i, g, var) in self.groups.indices() {
                    let rows = self.groups.rows.remove(&i);
                    let Some(grad) = grads.get(var.as_tensor()) else { continue };
                    $crate::sgd::check_grad_shape(i, &var, grad, rows.as_deref())?;
                    let h = &self.groups.groups[g].hyper;
                    let state = &mut self.groups.state[i];
                    match rows {
                        Some(rows) => Self::update_rows(h, state, &var, &rows, grad),
                        None => Self::update(h, state, &var, grad),
                    }
                    .map_err(|source| $crate::OptimError::Step { index: i, source })?;
                }
                Ok(())
            }
        }

        impl $crate::TorchOptimizer for $ty {
            fn step(
                &mut self,
                grads: &candle_core::backprop::GradStore,
            ) -> Result<(), $crate::OptimError> {
                $ty::step(self, grads)
            }
            fn lr(&self) -> f64 {
                self.groups.lr()
            }
            fn set_lr(&mut self, lr: f64) {
                self.groups.set_lr(lr)
            }
            fn group_lrs(&self) -> Vec<f64> {
                self.groups.group_lrs()
            }
            fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<(), $crate::OptimError> {
                self.groups.set_group_lrs(lrs)
            }
            fn params(&self) -> Vec<candle_core::Var> {
                self.groups.params()
            }
            fn state_dict(&self) -> Result<tandem_ckpt::Value, $crate::OptimError> {
                self.groups.state_dict()
            }
            fn param_state(&self, index: usize) -> Result<tandem_ckpt::Value, $crate::OptimError> {
                self.groups.param_state(index)
            }
            fn load_state_dict(
                &mut self,
                state_dict: &tandem_ckpt::Value,
            ) -> Result<(), $crate::OptimError> {
                self.groups.load_state_dict(state_dict, $keys)
            }
            fn set_grad_rows(
                &mut self,
                index: usize,
                rows: Vec<u32>,
            ) -> Result<(), $crate::OptimError> {
                self.groups.set_grad_rows(index, rows)
            }
            fn set_param(
                &mut self,
                index: usize,
                var: candle_core::Var,
            ) -> Result<(), $crate::OptimError> {
                self.groups.set_param(index, var)
            }
        }

        /// candle-nn's optimizer interface: errors come back as `candle_core::Error`s that
        /// keep the [`OptimError`](crate::OptimError)'s message.
        impl candle_nn::Optimizer for $ty {
            type Config = $config;
            fn new(vars: Vec<candle_core::Var>, config: $config) -> candle_core::Result<Self> {
                $ty::new(vars, config).map_err(candle_core::Error::wrap)
            }
            fn step(
                &mut self,
                grads: &candle_core::backprop::GradStore,
            ) -> candle_core::Result<()> {
                $ty::step(self, grads).map_err(candle_core::Error::wrap)
            }
            fn learning_rate(&self) -> f64 {
                self.groups.lr()
            }
            fn set_learning_rate(&mut self, lr: f64) {
                self.groups.set_lr(lr)
            }
        }
    };
}

mod adam;
pub mod amp;
mod checkpointable;
mod clip;
mod fused;
mod groups;
pub mod lr_scheduler;
mod optimizer;
mod sgd;
mod step;
mod tensor;
#[cfg(feature = "zero")]
pub mod zero;

pub use adam::{densify, AdamConfig, AdamWConfig, TorchAdam, TorchAdamW};
pub use amp::{GradScaler, GradScalerConfig};
pub use checkpointable::OptimizerState;
pub use clip::{clip_grad_norm, clip_grad_norm_over};
pub use lr_scheduler::LrScheduler;
pub(crate) use optimizer::non_negative;
pub use optimizer::{OptimError, OptimizerShard, Part, TorchOptimizer};
pub use sgd::{SgdConfig, TorchSgd};
pub use step::{phase_end, Step, StepError, StepOutcome, StepPhase, SumOverRanks};
#[cfg(feature = "zero")]
pub use zero::{ShardOptimizer, ZeroRedundancyOptimizer};
