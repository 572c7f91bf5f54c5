//! LinearLR.
use tandem_ckpt::Value;

use super::core::{bad_state, get_float, get_int, Core};
use super::LrScheduler;
use crate::{OptimError, Part};

/// `torch.optim.lr_scheduler.LinearLR`: the lr factor moves linearly from `start_factor` to
/// `end_factor` over `total_iters` steps, then stays (torch defaults: 1/3, 1.0, 5).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearLR {
    core: Core,
    start_factor: f64,
    end_factor: f64,
    total_iters: i64,
}

impl LinearLR {
    pub fn new(
        base_lrs: &[f64],
        start_factor: f64,
        end_factor: f64,
        total_iters: i64,
    ) -> Result<Self, OptimError> {
        Self::check(start_factor, end_factor)?;
        let mut s = LinearLR { core: Core::new(base_lrs)?, start_factor, end_factor, total_iters };
        s.advance(true);
        Ok(s)
    }

    /// torch's defaults: `start_factor = 1/3`, `end_factor = 1.0`, `total_iters = 5`.
    pub fn with_defaults(base_lrs: &[f64]) -> Result<Self, OptimError> {
        Self::new(base_lrs, 1.0 / 3.0, 1.0, 5)
    }

    fn check(start_factor: f64, end_factor: f64) -> Result<(), OptimError> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "start_factor",
                value: start_factor.to_string(),
                why: "must be in (0, 1]",
            });
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "end_factor",
                value: end_factor.to_string(),
                why: "must be in [0, 1]",
            });
        }
        Ok(())
    }

    fn advance(&mut self, initial: bool) {
        let (start, end, total) = (self.start_factor, self.end_factor, self.total_iters);
        self.core.advance(
            |c, is_initial| {
                let e = c.last_epoch;
                if e == 0 {
                    c.last_lrs.iter().map(|lr| lr * start).collect()
                } else if is_initial || e > total {
                    c.last_lrs.clone()
                } else {
                    let f = 1.0
                        + (end - start) / (total as f64 * start + (e - 1) as f64 * (end - start));
                    c.last_lrs.iter().map(|lr| lr * f).collect()
                }
            },
            initial,
        );
    }
}

impl LrScheduler for LinearLR {
    core_scheduler_methods!();
    fn state_dict(&self) -> Value {
        self.core.state_dict(vec![
            ("start_factor", Value::Float(self.start_factor)),
            ("end_factor", Value::Float(self.end_factor)),
            ("total_iters", Value::Int(self.total_iters)),
        ])
    }
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), OptimError> {
        let core = self.core.load(sd)?;
        let start_factor = get_float(sd, "start_factor")?;
        let end_factor = get_float(sd, "end_factor")?;
        Self::check(start_factor, end_factor)
            .map_err(|e| bad_state("start_factor/end_factor", e.to_string()))?;
        let total_iters = get_int(sd, "total_iters")?;
        *self = LinearLR { core, start_factor, end_factor, total_iters };
        Ok(())
    }
}
