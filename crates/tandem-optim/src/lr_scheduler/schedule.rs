//! Learning-rate schedules by name, as a run asks for them (arcface_torch's poly with warm-up,
//! cosine annealing, step decay, or none), built over the optimizer's parameter groups, and
//! their checkpoint state.
use tandem_ckpt::Value;

use super::{CosineAnnealingLR, LrScheduler, PolyScheduler, PolynomialLRWarmup, StepLR};
use crate::{OptimError, TorchOptimizer};

/// A schedule that cannot be built or resumed.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error(
        "the run has {total_steps} steps, not more than the {warmup} warm-up steps (lower the \
         warm-up or train longer)"
    )]
    WarmupTooLong { total_steps: u64, warmup: u64 },
    /// A checkpoint's schedule that does not fit this run's (`what`: the checkpoint).
    #[error("{what} {why}")]
    Mismatch { what: String, why: &'static str },
    /// A checkpoint's scheduler state that does not load (`what`: the checkpoint).
    #[error("{what}: scheduler state")]
    State {
        what: String,
        #[source]
        source: OptimError,
    },
    #[error(transparent)]
    Optim(#[from] OptimError),
}

type Result<T> = std::result::Result<T, ScheduleError>;

/// The run's scheduler (`None` for a constant lr).
pub type Scheduler = Option<Box<dyn LrScheduler + Send>>;

/// The warm-up of a poly schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Warmup {
    #[default]
    None,
    Steps(u64),
    /// arcface_torch's `warmup_epoch`: this many epochs of steps.
    Epochs(u64),
}

/// Which schedule a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum LrSchedule {
    /// A constant learning rate.
    #[default]
    Constant,
    /// arcface_torch's PolyScheduler: linear warm-up from 0, then `base · (1 − t/T)²` to 0.
    Poly { warmup: Warmup },
    /// arcface_torch's PolynomialLRWarmup (its `train_v2.py`'s today): linear warm-up to the
    /// base lr, then `base · (1 − t/T)` to 0 (power 1), in torch's recursive form.
    PolynomialWarmup { warmup: Warmup },
    /// Cosine annealing to 0 over the run.
    Cosine,
    /// × 0.1 every `every_epochs` epochs.
    Step { every_epochs: u64 },
}

/// The run's length in optimizer steps, as the scheduler sees it.
#[derive(Clone, Copy, Debug)]
pub struct RunLength {
    /// Steps in one epoch (arcface_torch: images / global batch).
    pub steps_per_epoch: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
}

impl RunLength {
    /// `epochs` epochs of `steps_per_epoch` steps.
    pub fn epochs(steps_per_epoch: usize, epochs: u64) -> RunLength {
        let steps_per_epoch = steps_per_epoch as u64;
        RunLength { steps_per_epoch, total_steps: epochs * steps_per_epoch }
    }
}

impl LrSchedule {
    /// The scheduler over `opt`'s groups (their current lrs are the base lrs), already applied
    /// to `opt` (poly's warm-up starts at lr 0). `peak_lr` is poly's peak.
    pub fn build(
        self,
        opt: &mut dyn TorchOptimizer,
        peak_lr: f64,
        run: RunLength,
    ) -> Result<Scheduler> {
        let base_lrs = opt.group_lrs();
        let RunLength { steps_per_epoch, total_steps } = run;
        let sched: Box<dyn LrScheduler + Send> = match self {
            LrSchedule::Constant => return Ok(None),
            LrSchedule::Poly { warmup } | LrSchedule::PolynomialWarmup { warmup } => {
                let warmup = match warmup {
                    Warmup::None => 0,
                    Warmup::Steps(s) => s,
                    Warmup::Epochs(e) => e * steps_per_epoch,
                };
                if total_steps <= warmup {
                    return Err(ScheduleError::WarmupTooLong { total_steps, warmup });
                }
                let (total, warmup) = (total_steps as i64, warmup as i64);
                match self {
                    LrSchedule::Poly { .. } => {
                        Box::new(PolyScheduler::new(&base_lrs, peak_lr, total, warmup)?)
                    }
                    _ => Box::new(PolynomialLRWarmup::new(&base_lrs, warmup, total, 1.0)?),
                }
            }
            LrSchedule::Cosine => {
                Box::new(CosineAnnealingLR::new(&base_lrs, total_steps.max(1) as i64, 0.0)?)
            }
            LrSchedule::Step { every_epochs } => Box::new(StepLR::new(
                &base_lrs,
                (every_epochs * steps_per_epoch).max(1) as i64,
                0.1,
            )?),
        };
        sched.apply(opt)?;
        Ok(Some(sched))
    }
}

/// The scheduler's state for a checkpoint (`Value::None` without one).
pub fn state(sched: &Scheduler) -> Value {
    sched.as_ref().map_or(Value::None, |s| s.state_dict())
}

/// Loads a checkpoint's scheduler state and applies its learning rates to `opt`. A checkpoint
/// written with another schedule (or none) is an error naming `what` (the checkpoint).
/// `max_steps` replaces a poly schedule's saved length: resumed on another world size a run has
/// another number of steps left.
pub fn load(
    sched: &mut Scheduler,
    saved: &Value,
    opt: &mut dyn TorchOptimizer,
    max_steps: Option<u64>,
    what: &str,
) -> Result<()> {
    match (sched.as_mut(), saved) {
        (None, Value::None) => Ok(()),
        (None, _) => Err(ScheduleError::Mismatch {
            what: what.into(),
            why: "was written with a learning-rate schedule; resume with the same schedule",
        }),
        (Some(_), Value::None) => Err(ScheduleError::Mismatch {
            what: what.into(),
            why: "has no scheduler state (written without a learning-rate schedule)",
        }),
        (Some(s), state) => {
            let mut state = state.clone();
            // (PolyScheduler's length is `max_steps`, PolynomialLRWarmup's `total_iters`.)
            for key in ["max_steps", "total_iters"] {
                if let (Some(steps), Some(slot)) = (max_steps, state.get_mut(key)) {
                    *slot = Value::Int(steps as i64);
                }
            }
            s.load_state_dict(&state)
                .map_err(|source| ScheduleError::State { what: what.into(), source })?;
            s.apply(opt)?;
            Ok(())
        }
    }
}
