//! StepLR.
use tandem_ckpt::Value;

use super::core::{bad_state, get_float, get_int, positive, Core};
use super::LrScheduler;
use crate::OptimError;

/// `torch.optim.lr_scheduler.StepLR`: multiplies the lr by `gamma` every `step_size` steps.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLR {
    core: Core,
    step_size: i64,
    gamma: f64,
}

impl StepLR {
    pub fn new(base_lrs: &[f64], step_size: i64, gamma: f64) -> Result<Self, OptimError> {
        positive("step_size", step_size)?;
        let mut s = StepLR { core: Core::new(base_lrs)?, step_size, gamma };
        s.advance(true);
        Ok(s)
    }

    fn advance(&mut self, initial: bool) {
        let (step_size, gamma) = (self.step_size, self.gamma);
        self.core.advance(
            |c, _| {
                if c.last_epoch == 0 || c.last_epoch % step_size != 0 {
                    c.last_lrs.clone()
                } else {
                    c.last_lrs.iter().map(|lr| lr * gamma).collect()
                }
            },
            initial,
        );
    }
}

impl LrScheduler for StepLR {
    core_scheduler_methods!();
    fn state_dict(&self) -> Value {
        self.core.state_dict(vec![
            ("step_size", Value::Int(self.step_size)),
            ("gamma", Value::Float(self.gamma)),
        ])
    }
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), OptimError> {
        let core = self.core.load(sd)?;
        let step_size = get_int(sd, "step_size")?;
        positive("step_size", step_size).map_err(|e| bad_state("step_size", e.to_string()))?;
        let gamma = get_float(sd, "gamma")?;
        *self = StepLR { core, step_size, gamma };
        Ok(())
    }
}
