//! Learning-rate schedulers with state, matching `torch.optim.lr_scheduler` (StepLR,
//! CosineAnnealingLR, LinearLR) and insightface's arcface_torch `PolyScheduler`.
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

use crate::optim::{OptimError, TorchOptimizer};

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error("invalid scheduler setting {name}={value}: {why}")]
    InvalidConfig { name: &'static str, value: String, why: &'static str },
    /// A state_dict that does not fit this scheduler; `key` names the entry at fault.
    #[error("scheduler state_dict: {key}: {why}")]
    StateDict { key: String, why: String },
    #[error(transparent)]
    Optim(#[from] OptimError),
}

fn bad_state(key: &str, why: impl Into<String>) -> SchedError {
    SchedError::StateDict { key: key.to_string(), why: why.into() }
}

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
    fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), SchedError>;

    /// Sets the optimizer's group learning rates to the scheduler's current ones.
    fn apply(&self, opt: &mut dyn TorchOptimizer) -> Result<(), SchedError> {
        Ok(opt.set_group_lrs(self.last_lrs())?)
    }
    /// `step()` then [`LrScheduler::apply`]: torch's `scheduler.step()` after `optimizer.step()`.
    fn step_optimizer(&mut self, opt: &mut dyn TorchOptimizer) -> Result<(), SchedError> {
        self.step();
        self.apply(opt)
    }
}

/// The bookkeeping every torch scheduler carries.
#[derive(Clone, Debug, PartialEq)]
struct Core {
    base_lrs: Vec<f64>,
    last_lrs: Vec<f64>,
    last_epoch: i64,
    step_count: i64,
}

impl Core {
    fn new(base_lrs: &[f64]) -> Result<Self, SchedError> {
        if base_lrs.is_empty() {
            return Err(SchedError::InvalidConfig {
                name: "base_lrs",
                value: "[]".into(),
                why: "needs one learning rate per param group",
            });
        }
        if let Some(&lr) = base_lrs.iter().find(|lr| !lr.is_finite()) {
            return Err(SchedError::InvalidConfig {
                name: "base_lrs",
                value: lr.to_string(),
                why: "must be finite",
            });
        }
        Ok(Core {
            base_lrs: base_lrs.to_vec(),
            last_lrs: base_lrs.to_vec(),
            last_epoch: -1,
            step_count: 0,
        })
    }

    /// torch's `LRScheduler.step()` without an epoch argument.
    fn advance(&mut self, get_lr: impl Fn(&Core, bool) -> Vec<f64>, is_initial: bool) {
        self.step_count += 1;
        self.last_epoch += 1;
        self.last_lrs = get_lr(self, is_initial);
    }

    /// Entries in torch's order: own fields first, then the base class's.
    fn state_dict(&self, own: Vec<(&str, Value)>) -> Value {
        let floats = |v: &[f64]| Value::List(v.iter().map(|&x| Value::Float(x)).collect());
        let mut items = own;
        items.extend([
            ("base_lrs", floats(&self.base_lrs)),
            ("last_epoch", Value::Int(self.last_epoch)),
            ("_step_count", Value::Int(self.step_count)),
            ("_is_initial", Value::Bool(false)),
            ("_get_lr_called_within_step", Value::Bool(false)),
            ("_last_lr", floats(&self.last_lrs)),
        ]);
        Value::dict_from(items)
    }

    fn load(&self, sd: &Value) -> Result<Core, SchedError> {
        if sd.as_dict().is_none() {
            return Err(bad_state("<root>", format!("expected a dict, found {}", sd.type_name())));
        }
        let lrs = |key: &str| -> Result<Vec<f64>, SchedError> {
            let list = sd
                .get(key)
                .ok_or_else(|| bad_state(key, "missing"))?
                .as_list()
                .ok_or_else(|| bad_state(key, "expected a list"))?;
            let v: Vec<f64> = list
                .iter()
                .map(|x| x.as_float().ok_or_else(|| bad_state(key, "expected numbers")))
                .collect::<Result<_, _>>()?;
            if v.len() != self.base_lrs.len() {
                return Err(bad_state(
                    key,
                    format!(
                        "has {} entries, this scheduler has {} param groups",
                        v.len(),
                        self.base_lrs.len()
                    ),
                ));
            }
            Ok(v)
        };
        Ok(Core {
            base_lrs: lrs("base_lrs")?,
            last_lrs: lrs("_last_lr")?,
            last_epoch: get_int(sd, "last_epoch")?,
            step_count: get_int(sd, "_step_count")?,
        })
    }
}

fn get_int(sd: &Value, key: &str) -> Result<i64, SchedError> {
    match sd.get(key) {
        Some(Value::Int(i)) => Ok(*i),
        Some(other) => Err(bad_state(key, format!("expected an int, found {}", other.type_name()))),
        None => Err(bad_state(key, "missing")),
    }
}

fn get_float(sd: &Value, key: &str) -> Result<f64, SchedError> {
    match sd.get(key) {
        Some(Value::Int(i)) => Ok(*i as f64),
        Some(Value::Float(f)) => Ok(*f),
        Some(other) => {
            Err(bad_state(key, format!("expected a number, found {}", other.type_name())))
        }
        None => Err(bad_state(key, "missing")),
    }
}

fn positive(name: &'static str, v: i64) -> Result<(), SchedError> {
    if v <= 0 {
        return Err(SchedError::InvalidConfig { name, value: v.to_string(), why: "must be > 0" });
    }
    Ok(())
}

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

/// `torch.optim.lr_scheduler.StepLR`: multiplies the lr by `gamma` every `step_size` steps.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLR {
    core: Core,
    step_size: i64,
    gamma: f64,
}

impl StepLR {
    pub fn new(base_lrs: &[f64], step_size: i64, gamma: f64) -> Result<Self, SchedError> {
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
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), SchedError> {
        let core = self.core.load(sd)?;
        let step_size = get_int(sd, "step_size")?;
        positive("step_size", step_size).map_err(|e| bad_state("step_size", e.to_string()))?;
        let gamma = get_float(sd, "gamma")?;
        *self = StepLR { core, step_size, gamma };
        Ok(())
    }
}

/// `torch.optim.lr_scheduler.CosineAnnealingLR` (without restarts; past `t_max` the lr rises
/// again along the cosine, exactly as torch's recursion does).
#[derive(Clone, Debug, PartialEq)]
pub struct CosineAnnealingLR {
    core: Core,
    t_max: i64,
    eta_min: f64,
}

impl CosineAnnealingLR {
    pub fn new(base_lrs: &[f64], t_max: i64, eta_min: f64) -> Result<Self, SchedError> {
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
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), SchedError> {
        let core = self.core.load(sd)?;
        let t_max = get_int(sd, "T_max")?;
        positive("T_max", t_max).map_err(|e| bad_state("T_max", e.to_string()))?;
        let eta_min = get_float(sd, "eta_min")?;
        *self = CosineAnnealingLR { core, t_max, eta_min };
        Ok(())
    }
}

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
    ) -> Result<Self, SchedError> {
        Self::check(start_factor, end_factor)?;
        let mut s = LinearLR { core: Core::new(base_lrs)?, start_factor, end_factor, total_iters };
        s.advance(true);
        Ok(s)
    }

    /// torch's defaults: `start_factor = 1/3`, `end_factor = 1.0`, `total_iters = 5`.
    pub fn with_defaults(base_lrs: &[f64]) -> Result<Self, SchedError> {
        Self::new(base_lrs, 1.0 / 3.0, 1.0, 5)
    }

    fn check(start_factor: f64, end_factor: f64) -> Result<(), SchedError> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(SchedError::InvalidConfig {
                name: "start_factor",
                value: start_factor.to_string(),
                why: "must be in (0, 1]",
            });
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(SchedError::InvalidConfig {
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
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), SchedError> {
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
    ) -> Result<Self, SchedError> {
        Self::check(base_lr, max_steps, warmup_steps)?;
        let mut s = PolyScheduler { core: Core::new(base_lrs)?, base_lr, max_steps, warmup_steps };
        s.advance(true);
        s.core.last_epoch = -1;
        Ok(s)
    }

    fn check(base_lr: f64, max_steps: i64, warmup_steps: i64) -> Result<(), SchedError> {
        if !base_lr.is_finite() {
            return Err(SchedError::InvalidConfig {
                name: "base_lr",
                value: base_lr.to_string(),
                why: "must be finite",
            });
        }
        if warmup_steps < 0 {
            return Err(SchedError::InvalidConfig {
                name: "warmup_steps",
                value: warmup_steps.to_string(),
                why: "must be >= 0",
            });
        }
        if max_steps <= warmup_steps {
            return Err(SchedError::InvalidConfig {
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
    fn load_state_dict(&mut self, sd: &Value) -> Result<(), SchedError> {
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
