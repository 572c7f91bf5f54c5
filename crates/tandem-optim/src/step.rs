//! One optimizer step, the same for every recipe: torch's mixed-precision sequence
//! (`scaler.scale(loss).backward()`, `scaler.unscale_(opt)`, `clip_grad_norm_`,
//! `scaler.step(opt)`, `scaler.update()`, `scheduler.step()`), or without a GradScaler
//! backward, clip, step and the schedule.
//!
//! The backward itself is the caller's (`ddp.backward`, `ddp.backward_with_local` with a
//! model-parallel head, a plain `loss.backward()`): [`Step::run`] hands it the loss to
//! differentiate (already scaled under a GradScaler) and takes the gradients back.
//!
//! ```ignore
//! let mut step = Step::new().scaler(Some(GradScaler::new(GradScalerConfig::default())?))
//!     .clip_grad_norm(Some(5.0)).scheduler(sched);
//! let out = step.run(&loss, |l| ddp.backward(l), &mut opt, &ddp.params(), global_step)?;
//! ```
use std::time::Instant;

use std::fmt;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::lr_scheduler::schedule::Scheduler;
use crate::{clip_grad_norm, GradScaler, OptimError, TorchOptimizer};

/// Phase `phase` of optimizer step `step` failed because of `source`.
#[derive(Debug, thiserror::Error)]
#[error("{phase} at step {step}")]
pub struct StepError {
    pub step: u64,
    pub phase: StepPhase,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// The phase of an optimizer step that failed ([`StepError`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// The caller's backward (a collective inside Ddp, a kernel).
    Backward,
    /// Clipping found a non-finite gradient norm with no GradScaler to skip the step, or an
    /// invalid max norm.
    Clip,
    /// The GradScaler's scale, unscale or update.
    Scaler,
    /// The optimizer's update.
    Optimizer,
    /// The learning-rate schedule's step.
    Schedule,
}

impl fmt::Display for StepPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StepPhase::Backward => "backward",
            StepPhase::Clip => "clipping the gradient norm",
            StepPhase::Scaler => "loss scaling",
            StepPhase::Optimizer => "the optimizer's update",
            StepPhase::Schedule => "the learning-rate schedule",
        })
    }
}

type Result<T, E = StepError> = std::result::Result<T, E>;

/// Phase `phase` of step `step` failed because of the error it is given.
fn failed<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    step: u64,
    phase: StepPhase,
) -> impl Fn(E) -> StepError + Copy {
    move |e| StepError { step, phase, source: e.into() }
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// False when the GradScaler skipped the optimizer step (inf/NaN gradients).
    pub stepped: bool,
    /// Seconds in the caller's backward (its collectives included).
    pub backward_secs: f64,
    /// Seconds in unscale, clipping, the optimizer, the scale update and the schedule.
    pub optimizer_secs: f64,
}

/// The step's parts that outlive a step: the GradScaler, the clipping norm, the lr schedule
/// and the count of skipped steps. Float16 needs the scaler (its range is narrow); bfloat16 has
/// float32's range and trains without one.
#[derive(Default)]
pub struct Step {
    scaler: Option<GradScaler>,
    clip_grad_norm: Option<f64>,
    scheduler: Scheduler,
    skipped: u64,
    over_ranks: Option<SumOverRanks>,
}

/// Sums a number over the ranks that hold a sharded model's gradients (one all-reduce; every
/// rank calls it at the same point of the step).
pub type SumOverRanks = std::sync::Arc<
    dyn Fn(f64) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> + Send + Sync,
>;

impl Step {
    /// A plain step: no loss scaling, no clipping, a constant learning rate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scales the loss with `scaler` (float16 training).
    pub fn scaler(mut self, scaler: Option<GradScaler>) -> Self {
        self.scaler = scaler;
        self
    }

    /// Clips the total gradient norm of the parameters given to [`Step::run`] to `max_norm`.
    pub fn clip_grad_norm(mut self, max_norm: Option<f64>) -> Self {
        self.clip_grad_norm = max_norm;
        self
    }

    /// The gradients are shards (a sharded model's, FSDP's): clipping sums the squared norm
    /// over the ranks through `sum`, and the GradScaler skips a step on every rank when any
    /// rank's shard holds an inf or NaN (PyTorch's `ShardedGradScaler`).
    pub fn sharded(mut self, sum: SumOverRanks) -> Self {
        self.over_ranks = Some(sum);
        self
    }

    /// Steps `scheduler` after every optimizer step (skipped ones included, as torch does).
    pub fn scheduler(mut self, scheduler: Scheduler) -> Self {
        self.scheduler = scheduler;
        self
    }

    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    pub fn grad_scaler_mut(&mut self) -> Option<&mut GradScaler> {
        self.scaler.as_mut()
    }

    /// The loss scaler and the schedule together (both go into the training state).
    pub fn scaler_and_scheduler_mut(
        &mut self,
    ) -> (Option<&mut GradScaler>, Option<&mut dyn crate::lr_scheduler::LrScheduler>) {
        let scheduler =
            self.scheduler.as_deref_mut().map(|s| s as &mut dyn crate::lr_scheduler::LrScheduler);
        (self.scaler.as_mut(), scheduler)
    }

    pub fn lr_scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn lr_scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.scheduler
    }

    /// Optimizer steps the GradScaler skipped so far.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// One step: backward of `loss` (scaled under a GradScaler) through `backward`, unscale,
    /// clip `clip_params`' gradients, the optimizer step (skipped on inf/NaN under a
    /// GradScaler), the scale update and the schedule. `step` numbers the step in errors.
    pub fn run<B, E>(
        &mut self,
        loss: &Tensor,
        backward: B,
        opt: &mut dyn TorchOptimizer,
        clip_params: &[Var],
        step: u64,
    ) -> Result<StepOutcome>
    where
        B: FnOnce(&Tensor) -> Result<GradStore, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let clock = Instant::now();
        let scaler_err = failed(step, StepPhase::Scaler);
        let backward_err = failed(step, StepPhase::Backward);
        let stepped = match self.scaler.as_mut() {
            Some(s) => {
                let mut grads =
                    backward(&s.scale(loss).map_err(scaler_err)?).map_err(backward_err)?;
                phase_end(loss.device()).map_err(failed(step, StepPhase::Backward))?;
                let backward_secs = clock.elapsed().as_secs_f64();
                // Unscaled before clipping so the norm is the true one; a non-finite norm is
                // the scaler's to handle (it skips the step and lowers the scale).
                match &self.over_ranks {
                    Some(sum) => s.unscale_over(opt, &mut grads, |x| sum(x)),
                    None => s.unscale_(opt, &mut grads),
                }
                .map_err(scaler_err)?;
                let over_ranks = self.over_ranks.as_ref();
                clip(self.clip_grad_norm, over_ranks, clip_params, &mut grads, true, step)?;
                let stepped = s.step(opt, &mut grads).map_err(scaler_err)?;
                s.update().map_err(scaler_err)?;
                (stepped, backward_secs)
            }
            None => {
                let mut grads = backward(loss).map_err(backward_err)?;
                phase_end(loss.device()).map_err(failed(step, StepPhase::Backward))?;
                let backward_secs = clock.elapsed().as_secs_f64();
                let over_ranks = self.over_ranks.as_ref();
                clip(self.clip_grad_norm, over_ranks, clip_params, &mut grads, false, step)?;
                opt.step(&grads).map_err(failed(step, StepPhase::Optimizer))?;
                (true, backward_secs)
            }
        };
        let (stepped, backward_secs) = stepped;
        if !stepped {
            self.skipped += 1;
        }
        if let Some(sched) = self.scheduler.as_mut() {
            sched.step_optimizer(opt).map_err(failed(step, StepPhase::Schedule))?;
        }
        phase_end(loss.device()).map_err(failed(step, StepPhase::Backward))?;
        let optimizer_secs = clock.elapsed().as_secs_f64() - backward_secs;
        Ok(StepOutcome { stepped, backward_secs, optimizer_secs })
    }
}

impl Step {
    /// A batch inside a gradient-accumulation window: backward of `loss` (scaled as
    /// [`Step::run`] scales it, with the scale the window's step will unscale by) through
    /// `backward`, no optimizer step, and the schedule moved on, as arcface_torch moves it every
    /// batch. Returns the gradients for the caller to keep (a `Ddp` inside `no_sync` keeps its
    /// own) and the backward's seconds.
    pub fn accumulate<B, E>(
        &mut self,
        loss: &Tensor,
        backward: B,
        opt: &mut dyn TorchOptimizer,
        step: u64,
    ) -> Result<(GradStore, StepOutcome)>
    where
        B: FnOnce(&Tensor) -> Result<GradStore, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let clock = Instant::now();
        let scaled = match self.scaler.as_ref() {
            Some(s) => s.scale(loss).map_err(failed(step, StepPhase::Scaler))?,
            None => loss.clone(),
        };
        let grads = backward(&scaled).map_err(failed(step, StepPhase::Backward))?;
        phase_end(loss.device()).map_err(failed(step, StepPhase::Backward))?;
        let backward_secs = clock.elapsed().as_secs_f64();
        if let Some(sched) = self.scheduler.as_mut() {
            sched.step_optimizer(opt).map_err(failed(step, StepPhase::Schedule))?;
        }
        let optimizer_secs = clock.elapsed().as_secs_f64() - backward_secs;
        Ok((grads, StepOutcome { stepped: false, backward_secs, optimizer_secs }))
    }
}

/// Waits for `device`'s queued work when `TANDEM_PROFILE=phases` (or `ops`) asks for phase
/// times that are the device's: kernels run asynchronously, so without the wait a phase's host
/// clock measures its queueing and the GPU time lands in whichever later phase waits.
pub fn phase_end(device: &candle_core::Device) -> candle_core::Result<()> {
    use tandem_cuda::profile::{mode, Profile};
    if !device.is_cpu() && mode() >= Profile::Phases {
        device.synchronize()?;
    }
    Ok(())
}

/// Clips `params`' gradients in `grads` to `max_norm` (torch's `clip_grad_norm_`; over the
/// ranks' shards with `over_ranks`). A non-finite norm is left to the GradScaler when the loss
/// was scaled; without one it is an error naming the step.
fn clip(
    max_norm: Option<f64>,
    over_ranks: Option<&SumOverRanks>,
    params: &[Var],
    grads: &mut GradStore,
    scaled: bool,
    step: u64,
) -> Result<()> {
    let Some(max_norm) = max_norm else { return Ok(()) };
    let clipped = match over_ranks {
        Some(sum) => crate::clip_grad_norm_over(params, grads, max_norm, |x| sum(x)),
        None => clip_grad_norm(params, grads, max_norm),
    };
    match clipped {
        Ok(_) => Ok(()),
        Err(OptimError::NonFiniteNorm { .. }) if scaled => Ok(()),
        Err(source) => Err(failed(step, StepPhase::Clip)(source)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GradScalerConfig, SgdConfig, TorchSgd};
    use candle_core::{DType, Device};

    fn sgd(w: &Var) -> TorchSgd {
        let cfg = SgdConfig {
            lr: 0.5,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        TorchSgd::new(vec![w.clone()], cfg).unwrap()
    }

    /// loss = Σ w·x with x = [3, 4]: the gradient is x, its norm 5.
    fn loss_of(w: &Var) -> Tensor {
        let x = Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap();
        (w.as_tensor() * x).unwrap().sum_all().unwrap()
    }

    #[test]
    fn clipping_sees_the_unscaled_gradient_with_and_without_a_scaler() {
        for scaler in [None, Some(GradScaler::new(GradScalerConfig::default()).unwrap())] {
            let w = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
            let mut opt = sgd(&w);
            let mut step = Step::new().scaler(scaler).clip_grad_norm(Some(1.0));
            let out = step
                .run(&loss_of(&w), |l| l.backward(), &mut opt, std::slice::from_ref(&w), 1)
                .unwrap();
            assert!(out.stepped);
            // Clipped to norm 1: the step is lr · x / 5.
            let got: Vec<f32> = w.as_tensor().to_vec1().unwrap();
            assert!((got[0] + 0.3).abs() < 1e-6 && (got[1] + 0.4).abs() < 1e-6, "{got:?}");
        }
    }

    #[test]
    fn an_infinite_gradient_is_skipped_under_a_scaler_and_an_error_without() {
        let w = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let inf = |w: &Var| (w.as_tensor() * f64::INFINITY).unwrap().sum_all().unwrap();
        let scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let mut step = Step::new().scaler(Some(scaler)).clip_grad_norm(Some(1.0));
        let out = step
            .run(&inf(&w), |l| l.backward(), &mut sgd(&w), std::slice::from_ref(&w), 7)
            .unwrap();
        assert!(!out.stepped);
        assert_eq!(step.skipped_steps(), 1);
        assert!(step.grad_scaler().unwrap().get_scale() < GradScalerConfig::default().init_scale);
        let mut plain = Step::new().clip_grad_norm(Some(1.0));
        let err = plain
            .run(&inf(&w), |l| l.backward(), &mut sgd(&w), std::slice::from_ref(&w), 7)
            .unwrap_err();
        assert!(matches!(err, StepError { step: 7, phase: StepPhase::Clip, .. }), "{err}");
    }

    /// A sharded step: the norm is the ranks' together (here another rank's squared norm of 11
    /// beside this one's 25: 6), and an inf on another rank skips the step here too.
    #[test]
    fn a_sharded_step_clips_by_every_rank_and_skips_with_every_rank() {
        let w = Var::zeros(2, DType::F32, &Device::Cpu).unwrap();
        let others = |theirs: f64| -> SumOverRanks { std::sync::Arc::new(move |x| Ok(x + theirs)) };
        let mut step = Step::new().clip_grad_norm(Some(1.0)).sharded(others(11.0));
        step.run(&loss_of(&w), |l| l.backward(), &mut sgd(&w), std::slice::from_ref(&w), 1)
            .unwrap();
        let got: Vec<f32> = w.as_tensor().to_vec1().unwrap();
        let (x, y) = (-0.5 * 3.0 / 6.0, -0.5 * 4.0 / 6.0);
        assert!((got[0] - x).abs() < 1e-6 && (got[1] - y).abs() < 1e-6, "{got:?}");
        let scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let before = w.as_tensor().to_vec1::<f32>().unwrap();
        let mut step = Step::new().scaler(Some(scaler)).sharded(others(1.0));
        let out = step
            .run(&loss_of(&w), |l| l.backward(), &mut sgd(&w), std::slice::from_ref(&w), 2)
            .unwrap();
        assert!(!out.stepped, "another rank's inf must skip this rank's step");
        assert_eq!(w.as_tensor().to_vec1::<f32>().unwrap(), before);
    }
}
