//! PolynomialLRWarmup.
use tandem_ckpt::Value;

use super::core::{bad_state, get_float, get_int, Core};
use super::LrScheduler;
use crate::{OptimError, Part};

/// insightface arcface_torch's `PolynomialLRWarmup` (`lr_scheduler.py`, the scheduler its
/// `train_v2.py` steps every iteration today): at step 0 the optimizer's own lr; steps
/// `1..=warmup_iters` the linear warm-up `base · t / warmup_iters`; then each step multiplies
/// the current lr by `((1 − (t − w)/(T − w)) / (1 − (t − 1 − w)/(T − w)))^power`, torch's
/// recursive form of `base · (1 − (t − w)/(T − w))^power`, reaching 0 at `total_iters`; after
/// that the lr stays. arcface_torch's power is 1.
#[derive(Clone, Debug, PartialEq)]
pub struct PolynomialLRWarmup {
    core: Core,
    warmup_iters: i64,
    total_iters: i64,
    power: f64,
}

impl PolynomialLRWarmup {
    pub fn new(
        base_lrs: &[f64],
        warmup_iters: i64,
        total_iters: i64,
        power: f64,
    ) -> Result<Self, OptimError> {
        Self::check(warmup_iters, total_iters, power)?;
        let mut s =
            PolynomialLRWarmup { core: Core::new(base_lrs)?, warmup_iters, total_iters, power };
        s.advance(true);
        Ok(s)
    }

    fn check(warmup_iters: i64, total_iters: i64, power: f64) -> Result<(), OptimError> {
        if warmup_iters < 0 {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "warmup_iters",
                value: warmup_iters.to_string(),
                why: "must be >= 0",
            });
        }
        if total_iters <= warmup_iters {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "total_iters",
                value: total_iters.to_string(),
                why: "must be greater than warmup_iters",
            });
        }
        if !(power.is_finite() && power > 0.0) {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "power",
                value: power.to_string(),
                why: "must be a finite number > 0",
            });
        }
        Ok(())
    }

    fn advance(&mut self, initial: bool) {
        let (w, t, power) = (self.warmup_iters, self.total_iters, self.power);
        self.core.advance(
            |c, _| {
                let l = c.last_epoch;
                if l == 0 || l > t {
                    c.last_lrs.clone()
                } else if l <= w {
                    c.base_lrs.iter().map(|b| b * l as f64 / w as f64).collect()
                } else {
                    let span = (t - w) as f64;
                    let now = 1.0 - (l - w) as f64 / span;
                    let before = 1.0 - (l - 1 - w) as f64 / span;
                    let decay = (now / before).powf(power);
                    c.last_lrs.iter().map(|lr| lr * decay).collect()
                }
            },
            initial,
        );
    }
}

impl LrScheduler for PolynomialLRWarmup {
    core_scheduler_methods!();
    fn state_dict(&self) -> Value {
        self.core.state_dict(vec![
            ("total_iters", Value::Int(self.total_iters)),
            ("power", Value::Float(self.power)),
            ("warmup_iters", Value::Int(self.warmup_iters)),
        ])
    }
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), OptimError> {
        let core = self.core.load(sd)?;
        let total_iters = get_int(sd, "total_iters")?;
        let warmup_iters = get_int(sd, "warmup_iters")?;
        let power = get_float(sd, "power")?;
        Self::check(warmup_iters, total_iters, power)
            .map_err(|e| bad_state("warmup_iters/total_iters/power", e.to_string()))?;
        *self = PolynomialLRWarmup { core, warmup_iters, total_iters, power };
        Ok(())
    }
}
