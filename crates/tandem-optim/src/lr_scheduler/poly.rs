//! insightface's PolyScheduler.
use tandem_ckpt::Value;

use super::core::{bad_state, get_float, get_int, Core};
use super::LrScheduler;
use crate::{OptimError, Part};

/// insightface arcface_torch's `PolyScheduler` (per-iteration; not part of torch):
///
/// - `t < warmup_steps`: `lr = base_lr * t / warmup_steps` (linear warmup from 0),
/// - otherwise: `lr = base_lr * (1 - (t - warmup_steps) / (max_steps - warmup_steps))^2`,
///
/// where `t` is `last_epoch`. Like the original, every param group gets `base_lr`'s curve
/// (`base_lrs` only sets the group count), and construction leaves `last_epoch = -1` with the
/// lr already at the `t = 0` value (0 with warmup), so the first `step()` yields `t = 0` again.
/// Past `max_steps` the formula is applied as is (the squared term rises again); arcface_torch
/// stops training at `max_steps`.
#[derive(Clone, Debug, PartialEq)]
pub struct PolyScheduler {
    core: Core,
    base_lr: f64,
    max_steps: i64,
    warmup_steps: i64,
}

/// The original's fixed exponent and its (never returned through `step`) initial warmup lr,
/// kept for the state_dict.
const POLY_POWER: i64 = 2;
const POLY_WARMUP_LR_INIT: f64 = 0.0001;

impl PolyScheduler {
    pub fn new(
        base_lrs: &[f64],
        base_lr: f64,
        max_steps: i64,
        warmup_steps: i64,
    ) -> Result<Self, OptimError> {
        Self::check(base_lr, max_steps, warmup_steps)?;
        let mut s = PolyScheduler { core: Core::new(base_lrs)?, base_lr, max_steps, warmup_steps };
        s.advance(true);
        s.core.last_epoch = -1;
        Ok(s)
    }

    fn check(base_lr: f64, max_steps: i64, warmup_steps: i64) -> Result<(), OptimError> {
        if !base_lr.is_finite() {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "base_lr",
                value: base_lr.to_string(),
                why: "must be finite",
            });
        }
        if warmup_steps < 0 {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "warmup_steps",
                value: warmup_steps.to_string(),
                why: "must be >= 0",
            });
        }
        if max_steps <= warmup_steps {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "max_steps",
                value: max_steps.to_string(),
                why: "must be greater than warmup_steps",
            });
        }
        Ok(())
    }

    /// The lr at iteration `t` (the formula above).
    pub fn lr_at(&self, t: i64) -> f64 {
        if t == -1 {
            return POLY_WARMUP_LR_INIT;
        }
        if t < self.warmup_steps {
            return self.base_lr * (t as f64 / self.warmup_steps as f64);
        }
        let frac = (t - self.warmup_steps) as f64 / (self.max_steps - self.warmup_steps) as f64;
        self.base_lr * (1.0 - frac).powi(POLY_POWER as i32)
    }

    fn advance(&mut self, initial: bool) {
        let this = self.clone();
        self.core.advance(|c, _| vec![this.lr_at(c.last_epoch); c.base_lrs.len()], initial);
    }
}

impl LrScheduler for PolyScheduler {
    core_scheduler_methods!();
    fn state_dict(&self) -> Value {
        self.core.state_dict(vec![
            ("base_lr", Value::Float(self.base_lr)),
            ("warmup_lr_init", Value::Float(POLY_WARMUP_LR_INIT)),
            ("max_steps", Value::Int(self.max_steps)),
            ("warmup_steps", Value::Int(self.warmup_steps)),
            ("power", Value::Int(POLY_POWER)),
        ])
    }
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), OptimError> {
        let core = self.core.load(sd)?;
        let base_lr = get_float(sd, "base_lr")?;
        let max_steps = get_int(sd, "max_steps")?;
        let warmup_steps = get_int(sd, "warmup_steps")?;
        Self::check(base_lr, max_steps, warmup_steps)
            .map_err(|e| bad_state("base_lr/max_steps/warmup_steps", e.to_string()))?;
        if let Some(p) = sd.get("power") {
            if p.as_float() != Some(POLY_POWER as f64) {
                return Err(bad_state(
                    "power",
                    format!("{p:?} is not supported (insightface's PolyScheduler uses 2)"),
                ));
            }
        }
        *self = PolyScheduler { core, base_lr, max_steps, warmup_steps };
        Ok(())
    }
}
