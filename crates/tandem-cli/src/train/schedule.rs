//! `--lr-scheduler`, its warm-up and `--clip-grad-norm`: what the classifier and the face loops
//! do around every optimizer step, in arcface_torch's order (clip, step, then the scheduler).
use anyhow::{bail, Context};
use candle_core::backprop::GradStore;
use candle_core::Var;
use tandem_ckpt::Value;
use tandem_optim::lr_scheduler::{CosineAnnealingLR, PolyScheduler, StepLR};
use tandem_optim::{ClipError, LrScheduler, TorchOptimizer};

use super::config::{SchedulerKind, TrainConfig};

/// The run's scheduler (`None` for a constant lr).
pub type Scheduler = Option<Box<dyn LrScheduler + Send>>;

/// The run's length in optimizer steps, as the scheduler sees it.
#[derive(Clone, Copy, Debug)]
pub struct RunLength {
    /// Steps in one epoch (arcface_torch: images / global batch).
    pub steps_per_epoch: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
}

/// The scheduler `cfg` asks for over `base_lrs` (one per param group), already applied to
/// `opt` (poly's warm-up starts at lr 0).
pub fn build(
    cfg: &TrainConfig,
    opt: &mut dyn TorchOptimizer,
    run: RunLength,
) -> anyhow::Result<Scheduler> {
    let base_lrs = opt.group_lrs();
    let RunLength { steps_per_epoch, total_steps } = run;
    let sched: Box<dyn LrScheduler + Send> = match cfg.lr_scheduler {
        SchedulerKind::None => return Ok(None),
        SchedulerKind::Poly => {
            let warmup = match (cfg.warmup_steps, cfg.warmup_epochs) {
                (Some(s), _) => s,
                (None, Some(e)) => e * steps_per_epoch,
                (None, None) => 0,
            };
            if total_steps <= warmup {
                bail!(
                    "--lr-scheduler poly: the run has {total_steps} steps, not more than the \
                     {warmup} warm-up steps (lower --warmup-steps/--warmup-epochs or train longer)"
                );
            }
            Box::new(
                PolyScheduler::new(&base_lrs, cfg.lr, total_steps as i64, warmup as i64)
                    .context("--lr-scheduler poly")?,
            )
        }
        SchedulerKind::Cosine => Box::new(
            CosineAnnealingLR::new(&base_lrs, total_steps.max(1) as i64, 0.0)
                .context("--lr-scheduler cosine")?,
        ),
        SchedulerKind::Step => Box::new(
            StepLR::new(&base_lrs, (cfg.lr_step_epochs * steps_per_epoch).max(1) as i64, 0.1)
                .context("--lr-scheduler step")?,
        ),
    };
    sched.apply(opt).context("--lr-scheduler")?;
    Ok(Some(sched))
}

/// The scheduler's state for a checkpoint (`Value::None` without one).
pub fn state(sched: &Scheduler) -> Value {
    sched.as_ref().map_or(Value::None, |s| s.state_dict())
}

/// Loads a checkpoint's scheduler state and applies its learning rates to `opt`. A checkpoint
/// written with another schedule (or none) is an error naming the flag. `max_steps` replaces a
/// poly schedule's saved length: resumed on another world size a run has another number of
/// steps left.
pub fn load(
    sched: &mut Scheduler,
    saved: &Value,
    opt: &mut dyn TorchOptimizer,
    max_steps: Option<u64>,
    what: &str,
) -> anyhow::Result<()> {
    match (sched.as_mut(), saved) {
        (None, Value::None) => Ok(()),
        (None, _) => {
            bail!("{what} was written with an --lr-scheduler; resume with the same --lr-scheduler")
        }
        (Some(_), Value::None) => {
            bail!("{what} has no scheduler state (written without --lr-scheduler)")
        }
        (Some(s), state) => {
            let mut state = state.clone();
            if let (Some(steps), Some(slot)) = (max_steps, state.get_mut("max_steps")) {
                *slot = Value::Int(steps as i64);
            }
            s.load_state_dict(&state)
                .with_context(|| format!("{what}: scheduler state (--lr-scheduler)"))?;
            s.apply(opt).context("--lr-scheduler")?;
            Ok(())
        }
    }
}

/// `--clip-grad-norm`: clips the gradients of `params` in `grads` (torch's `clip_grad_norm_`).
/// A non-finite norm is left to the GradScaler when there is one (it skips the step); without
/// one it is an error naming the step.
pub fn clip(
    max_norm: Option<f64>,
    params: &[Var],
    grads: &mut GradStore,
    scaled: bool,
    step: u64,
) -> anyhow::Result<()> {
    let Some(max_norm) = max_norm else { return Ok(()) };
    match tandem_optim::clip_grad_norm(params, grads, max_norm) {
        Ok(_) => Ok(()),
        Err(ClipError::NonFiniteNorm { .. }) if scaled => Ok(()),
        Err(e) => Err(e).with_context(|| format!("--clip-grad-norm at step {step}")),
    }
}
