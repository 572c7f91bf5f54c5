//! The bookkeeping every torch scheduler shares (`last_epoch`, `base_lrs`, `_last_lr`, the
//! step count and the state_dict keys), and state_dict field readers.
use tandem_ckpt::Value;

use crate::{OptimError, Part};

pub(super) fn bad_state(key: &str, why: impl Into<String>) -> OptimError {
    OptimError::state_dict(Part::Scheduler, key, why)
}

/// The bookkeeping every torch scheduler carries.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Core {
    pub(super) base_lrs: Vec<f64>,
    pub(super) last_lrs: Vec<f64>,
    pub(super) last_epoch: i64,
    pub(super) step_count: i64,
}

impl Core {
    pub(super) fn new(base_lrs: &[f64]) -> Result<Self, OptimError> {
        if base_lrs.is_empty() {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
                name: "base_lrs",
                value: "[]".into(),
                why: "needs one learning rate per param group",
            });
        }
        if let Some(&lr) = base_lrs.iter().find(|lr| !lr.is_finite()) {
            return Err(OptimError::InvalidConfig {
                of: Part::Scheduler,
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
    pub(super) fn advance(&mut self, get_lr: impl Fn(&Core, bool) -> Vec<f64>, is_initial: bool) {
        self.step_count += 1;
        self.last_epoch += 1;
        self.last_lrs = get_lr(self, is_initial);
    }

    /// Entries in torch's order: own fields first, then the base class's.
    pub(super) fn state_dict(&self, own: Vec<(&str, Value)>) -> Value {
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

    pub(super) fn load(&self, sd: &Value) -> Result<Core, OptimError> {
        if sd.as_dict().is_none() {
            return Err(bad_state("<root>", format!("expected a dict, found {}", sd.type_name())));
        }
        let lrs = |key: &str| -> Result<Vec<f64>, OptimError> {
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

pub(super) fn get_int(sd: &Value, key: &str) -> Result<i64, OptimError> {
    match sd.get(key) {
        Some(Value::Int(i)) => Ok(*i),
        Some(other) => Err(bad_state(key, format!("expected an int, found {}", other.type_name()))),
        None => Err(bad_state(key, "missing")),
    }
}

pub(super) fn get_float(sd: &Value, key: &str) -> Result<f64, OptimError> {
    match sd.get(key) {
        Some(Value::Int(i)) => Ok(*i as f64),
        Some(Value::Float(f)) => Ok(*f),
        Some(other) => {
            Err(bad_state(key, format!("expected a number, found {}", other.type_name())))
        }
        None => Err(bad_state(key, "missing")),
    }
}

pub(super) fn positive(name: &'static str, v: i64) -> Result<(), OptimError> {
    if v <= 0 {
        return Err(OptimError::InvalidConfig {
            of: Part::Scheduler,
            name,
            value: v.to_string(),
            why: "must be > 0",
        });
    }
    Ok(())
}
