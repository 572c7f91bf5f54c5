//! Param groups and per-parameter state shared by all optimizers, and the torch
//! `state_dict` layout around them (index numbering, group checks, hyperparameter reading).
use candle_core::{Tensor, Var};
use tandem_ckpt::Value;

use crate::{OptimError, Part};

/// The hyperparameters of one param group.
pub(crate) trait Hyper: Clone {
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
    /// torch's keys and values for this group, in torch's order, `params` excluded.
    fn entries(&self) -> Vec<(&'static str, Value)>;
    /// The hyperparameters of a saved group; a key the saved group lacks keeps `self`'s value
    /// (older torch versions wrote fewer keys). `key` names the group for errors.
    fn merge_saved(&self, saved: &Value, key: &str) -> Result<Self, OptimError>;
}

/// The optimizer state of one parameter (`state[i]` in the state_dict).
pub(crate) trait ParamState: Sized {
    fn to_value(&self, key: &str) -> Result<Value, OptimError>;
    /// Reads saved state, cast to the dtype and device of `param` as torch does on load.
    fn from_value(saved: &Value, param: &Tensor, key: &str) -> Result<Self, OptimError>;
}

pub(crate) struct Group<H> {
    pub params: Vec<Var>,
    pub hyper: H,
    /// Keys this optimizer does not interpret (e.g. a torch scheduler's `initial_lr`), kept so
    /// that a loaded state_dict is written back unchanged.
    pub extra: Vec<(Value, Value)>,
}

/// All param groups of one optimizer and the state of every parameter, indexed as in torch:
/// parameters are numbered consecutively across groups in group order.
pub(crate) struct Groups<H, S> {
    pub groups: Vec<Group<H>>,
    pub state: Vec<Option<S>>,
    /// Parameters whose next gradient holds only these rows (see
    /// `TorchOptimizer::set_grad_rows`), taken by the next step.
    pub rows: std::collections::HashMap<usize, Vec<u32>>,
}

impl<H: Hyper, S: ParamState> Groups<H, S> {
    pub fn new(groups: Vec<(Vec<Var>, H)>) -> Result<Self, OptimError> {
        let mut seen = std::collections::HashSet::new();
        let mut index = 0usize;
        for (params, _) in &groups {
            for p in params {
                if !p.dtype().is_float() {
                    return Err(OptimError::InvalidParam {
                        index,
                        why: format!(
                            "optimizers need floating-point parameters, found {:?}",
                            p.dtype()
                        ),
                    });
                }
                if !seen.insert(p.as_tensor().id()) {
                    return Err(OptimError::InvalidParam {
                        index,
                        why: "the same parameter appears twice (torch refuses this too)".into(),
                    });
                }
                index += 1;
            }
        }
        if index == 0 {
            return Err(OptimError::InvalidConfig {
                of: Part::Optimizer,
                name: "params",
                value: "[]".into(),
                why: "optimizer got an empty parameter list (torch refuses this too)",
            });
        }
        let groups: Vec<Group<H>> = groups
            .into_iter()
            .map(|(params, hyper)| Group { params, hyper, extra: Vec::new() })
            .collect();
        Ok(Groups {
            groups,
            state: (0..index).map(|_| None).collect(),
            rows: std::collections::HashMap::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// `(state_dict index, group index, parameter)` for every parameter, in index order.
    /// Parameter `index`'s next gradient holds only rows `rows` (ascending, unique, each
    /// below the parameter's first dimension), stacked.
    pub fn set_grad_rows(&mut self, index: usize, rows: Vec<u32>) -> Result<(), OptimError> {
        let var = self.indices().into_iter().find(|(i, _, _)| *i == index).map(|(_, _, v)| v);
        let Some(var) = var else {
            return Err(OptimError::InvalidParam {
                index,
                why: format!("no such parameter ({} in all)", self.len()),
            });
        };
        let n = var.dims().first().copied().unwrap_or(0);
        if !rows.windows(2).all(|w| w[0] < w[1]) || rows.last().is_some_and(|&r| r as usize >= n) {
            return Err(OptimError::InvalidParam {
                index,
                why: format!("gradient rows must ascend, each once, below {n}"),
            });
        }
        self.rows.insert(index, rows);
        Ok(())
    }

    pub fn indices(&self) -> Vec<(usize, usize, Var)> {
        let mut out = Vec::with_capacity(self.len());
        for (g, group) in self.groups.iter().enumerate() {
            for p in &group.params {
                out.push((out.len(), g, p.clone()));
            }
        }
        out
    }

    pub fn params(&self) -> Vec<Var> {
        self.groups.iter().flat_map(|g| g.params.iter().cloned()).collect()
    }

    pub fn lr(&self) -> f64 {
        self.groups.first().map(|g| g.hyper.lr()).unwrap_or(0.0)
    }

    pub fn set_lr(&mut self, lr: f64) {
        for g in &mut self.groups {
            g.hyper.set_lr(lr);
        }
    }

    pub fn group_lrs(&self) -> Vec<f64> {
        self.groups.iter().map(|g| g.hyper.lr()).collect()
    }

    pub fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<(), OptimError> {
        if lrs.len() != self.groups.len() {
            return Err(OptimError::InvalidConfig {
                of: Part::Optimizer,
                name: "lrs",
                value: format!("{lrs:?}"),
                why: "needs one learning rate per param group",
            });
        }
        for (g, &lr) in self.groups.iter_mut().zip(lrs) {
            g.hyper.set_lr(lr);
        }
        Ok(())
    }

    /// Parameter `index` becomes `var` (of any shape), with no state until it is loaded or
    /// stepped.
    pub fn set_param(&mut self, index: usize, var: Var) -> Result<(), OptimError> {
        if !var.dtype().is_float() {
            return Err(OptimError::InvalidParam {
                index,
                why: format!("optimizers need floating-point parameters, found {:?}", var.dtype()),
            });
        }
        let mut at = index;
        for g in &mut self.groups {
            if at < g.params.len() {
                g.params[at] = var;
                self.state[index] = None;
                self.rows.remove(&index);
                return Ok(());
            }
            at -= g.params.len();
        }
        Err(OptimError::InvalidParam {
            index,
            why: format!("no such parameter ({} in all)", self.len()),
        })
    }

    /// Parameter `i`'s state entry alone (`Value::None` when it has none yet).
    pub fn param_state(&self, i: usize) -> Result<Value, OptimError> {
        match self.state.get(i) {
            Some(Some(s)) => s.to_value(&format!("state.{i}")),
            _ => Ok(Value::None),
        }
    }

    pub fn state_dict(&self) -> Result<Value, OptimError> {
        let mut state = Vec::new();
        for (i, s) in self.state.iter().enumerate() {
            if let Some(s) = s {
                state.push((Value::Int(i as i64), s.to_value(&format!("state.{i}"))?));
            }
        }
        let mut groups = Vec::with_capacity(self.groups.len());
        let mut next = 0i64;
        for g in &self.groups {
            let mut items: Vec<(Value, Value)> =
                g.hyper.entries().into_iter().map(|(k, v)| (Value::Str(k.into()), v)).collect();
            let ids: Vec<Value> = (next..next + g.params.len() as i64).map(Value::Int).collect();
            next += g.params.len() as i64;
            items.push((Value::Str("params".into()), Value::List(ids)));
            items.extend(g.extra.iter().cloned());
            groups.push(Value::Dict(items));
        }
        Ok(Value::dict_from([("state", Value::Dict(state)), ("param_groups", Value::List(groups))]))
    }

    /// torch's `Optimizer.load_state_dict`: groups must match in number and size; saved
    /// parameter ids map to ours by position across the groups; state is cast to each
    /// parameter's dtype and device. Builds everything first, so an error changes nothing.
    pub fn load_state_dict(&mut self, sd: &Value, known_keys: &[&str]) -> Result<(), OptimError> {
        let saved_groups = sd
            .get("param_groups")
            .ok_or_else(|| OptimError::state("param_groups", "missing"))?
            .as_list()
            .ok_or_else(|| OptimError::state("param_groups", "expected a list"))?;
        let saved_state = sd
            .get("state")
            .ok_or_else(|| OptimError::state("state", "missing"))?
            .as_dict()
            .ok_or_else(|| OptimError::state("state", "expected a dict"))?;
        if saved_groups.len() != self.groups.len() {
            return Err(OptimError::state(
                "param_groups",
                format!(
                    "has {} groups, this optimizer has {}",
                    saved_groups.len(),
                    self.groups.len()
                ),
            ));
        }
        let mut id_map = std::collections::HashMap::new();
        let mut new_hypers = Vec::with_capacity(self.groups.len());
        let mut new_extras = Vec::with_capacity(self.groups.len());
        let mut next = 0usize;
        for (gi, (saved, ours)) in saved_groups.iter().zip(&self.groups).enumerate() {
            let key = format!("param_groups.{gi}");
            let items =
                saved.as_dict().ok_or_else(|| OptimError::state(&key, "expected a dict"))?;
            let ids = saved.get("params").and_then(Value::as_list).ok_or_else(|| {
                OptimError::state(format!("{key}.params"), "missing or not a list")
            })?;
            if ids.len() != ours.params.len() {
                return Err(OptimError::state(
                    format!("{key}.params"),
                    format!(
                        "lists {} parameters, this optimizer's group has {}",
                        ids.len(),
                        ours.params.len()
                    ),
                ));
            }
            for id in ids {
                let id =
                    id.as_int().filter(|_| !matches!(id, Value::Bool(_))).ok_or_else(|| {
                        OptimError::state(format!("{key}.params"), format!("non-integer id {id:?}"))
                    })?;
                if id_map.insert(id, next).is_some() {
                    return Err(OptimError::state(
                        format!("{key}.params"),
                        format!("id {id} appears twice"),
                    ));
                }
                next += 1;
            }
            new_hypers.push(ours.hyper.merge_saved(saved, &key)?);
            let extra: Vec<(Value, Value)> = items
                .iter()
                .filter(|(k, _)| !matches!(k, Value::Str(s) if s == "params" || known_keys.contains(&s.as_str())))
                .cloned()
                .collect();
            new_extras.push(extra);
        }
        let params = self.params();
        let mut new_state: Vec<Option<S>> = (0..self.len()).map(|_| None).collect();
        for (k, v) in saved_state {
            let id = match k {
                Value::Int(i) => *i,
                other => {
                    return Err(OptimError::state(
                        "state",
                        format!("key {other:?} is not a parameter index"),
                    ))
                }
            };
            let key = format!("state.{id}");
            let &index = id_map.get(&id).ok_or_else(|| {
                OptimError::state(&key, "names no parameter listed in param_groups")
            })?;
            new_state[index] = Some(S::from_value(v, params[index].as_tensor(), &key)?);
        }
        for ((g, h), extra) in self.groups.iter_mut().zip(new_hypers).zip(new_extras) {
            g.hyper = h;
            g.extra = extra;
        }
        self.state = new_state;
        Ok(())
    }
}

/// A number under `name` in a saved group (int or float, as torch writes either); the current
/// value when absent.
pub(crate) fn saved_f64(
    group: &Value,
    name: &str,
    current: f64,
    key: &str,
) -> Result<f64, OptimError> {
    match group.get(name) {
        None => Ok(current),
        Some(Value::Int(i)) => Ok(*i as f64),
        Some(Value::Float(f)) => Ok(*f),
        Some(other) => Err(OptimError::state(
            format!("{key}.{name}"),
            format!("expected a number, found {}", other.type_name()),
        )),
    }
}

pub(crate) fn saved_bool(
    group: &Value,
    name: &str,
    current: bool,
    key: &str,
) -> Result<bool, OptimError> {
    match group.get(name) {
        None => Ok(current),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(OptimError::state(
            format!("{key}.{name}"),
            format!("expected a bool, found {}", other.type_name()),
        )),
    }
}

/// Refuses torch features this crate does not implement (`maximize=True`), naming the key.
pub(crate) fn refuse_true(group: &Value, name: &str, key: &str) -> Result<(), OptimError> {
    if saved_bool(group, name, false, key)? {
        return Err(OptimError::state(
            format!("{key}.{name}"),
            "True is not supported by tandem's optimizers",
        ));
    }
    Ok(())
}

/// torch writes an int for hyperparameters left at their int default (`momentum=0`); mirror
/// that for zeros so default-built state_dicts are identical, floats otherwise.
pub(crate) fn torch_number(v: f64) -> Value {
    if v == 0.0 {
        Value::Int(0)
    } else {
        Value::Float(v)
    }
}

/// Refuses a saved per-parameter state with keys this optimizer does not write: loading
/// another optimizer's state (Adam's into SGD) must fail loudly, not half-load.
pub(crate) fn only_keys(saved: &Value, allowed: &[&str], key: &str) -> Result<(), OptimError> {
    let items = saved.as_dict().ok_or_else(|| {
        OptimError::state(key, format!("expected a dict, found {}", saved.type_name()))
    })?;
    for (k, _) in items {
        match k {
            Value::Str(s) if allowed.contains(&s.as_str()) => {}
            other => {
                return Err(OptimError::state(
                    key,
                    format!("unexpected entry {other:?} (expected only {allowed:?}; state of another optimizer?)"),
                ))
            }
        }
    }
    Ok(())
}

/// Reads a state tensor under `name` from a parameter's saved state dict.
pub(crate) fn saved_tensor(
    saved: &Value,
    name: &str,
    param: &Tensor,
    key: &str,
) -> Result<Tensor, OptimError> {
    let key = format!("{key}.{name}");
    let t = saved
        .get(name)
        .ok_or_else(|| OptimError::state(&key, "missing"))?
        .as_tensor()
        .ok_or_else(|| OptimError::state(&key, "expected a tensor"))?;
    crate::tensor::from_ckpt(t, param, &key)
}
