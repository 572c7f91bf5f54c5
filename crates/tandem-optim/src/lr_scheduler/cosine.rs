//! CosineAnnealingLR.
use tandem_ckpt::Value;

use super::core::{bad_state, get_float, get_int, positive, Core};
use super::LrScheduler;
use crate::OptimError;

/// `torch.optim.lr_scheduler.CosineAnnealingLR` (without restarts; past `t_max` the lr rises
/// again along the cosine, exactly as torch's recursion does).
#[derive(Clone, Debug, PartialEq)]
pub struct CosineAnnealingLR {
    core: Core,
    t_max: i64,
    eta_min: f64,
}

impl CosineAnnealingLR {
    pub fn new(base_lrs: &[f64], t_max: i64, eta_min: f64) -> Result<Self, OptimError> {
        positive("T_max", t_max)?;
        let mut s = CosineAnnealingLR { core: Core::new(base_lrs)?, t_max, eta_min };
        s.advance(true);
        Ok(s)
    }

    fn advance(&mut self, initial: bool) {
        let (t_max, eta_min) = (self.t_max as f64, self.eta_min);
        let t_max_i = self.t_max;
        self.core.advance(
            |c, is_initial| {
                let pi = std::f64::consts::PI;
                let e = c.last_epoch;
                if is_initial {
                    c.last_lrs.clone()
                } else if c.step_count == 1 && e > 0 {
                    c.base_lrs
                        .iter()
                        .map(|base| {
                            eta_min
                                + (base - eta_min) * (1.0 + ((e as f64) * pi / t_max).cos()) / 2.0
                        })
                        .collect()
                } else if (e - 1 - t_max_i).rem_euclid(2 * t_max_i) == 0 {
                    c.base_lrs
                        .iter()
                        .zip(&c.last_lrs)
                        .map(|(base, lr)| lr + (base - eta_min) * (1.0 - (pi / t_max).cos()) / 2.0)
                        .collect()
                } else {
                    let ratio = (1.0 + (pi * e as f64 / t_max).cos())
                        / (1.0 + (pi * (e - 1) as f64 / t_max).cos());
                    c.last_lrs.iter().map(|lr| ratio * (lr - eta_min) + eta_min).collect()
                }
            },
            initial,
        );
    }
}

impl LrScheduler for CosineAnnealingLR {
    core_scheduler_methods!();
    fn state_dict(&self) -> Value {
        self.core.state_dict(vec![
            ("T_max", Value::Int(self.t_max)),
            ("eta_min", Value::Float(self.eta_min)),
        ])
    }
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), OptimError> {
        let core = self.core.load(sd)?;
        let t_max = get_int(sd, "T_max")?;
        positive("T_max", t_max).map_err(|e| bad_state("T_max", e.to_string()))?;
        let eta_min = get_float(sd, "eta_min")?;
        *self = CosineAnnealingLR { core, t_max, eta_min };
        Ok(())
    }
}
