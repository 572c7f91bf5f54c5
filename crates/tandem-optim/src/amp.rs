//! Mixed-precision helpers: [`GradScaler`], PyTorch's `torch.amp.GradScaler` (dynamic loss
//! scaling for float16 training), and [`autocast_var_builder`], candle's way to run a model's
//! forward in bf16/f16 over float32 master weights.
//!
//! The recipe is torch's, call for call:
//!
//! ```ignore
//! let loss = model.forward(&x)?.loss(&y)?;
//! let mut grads = ddp.backward(&scaler.scale(&loss)?)?;  // or loss.backward()
//! scaler.unscale_(&opt, &mut grads)?;                    // optional, before clipping
//! clip_grad_norm(&opt.params(), &mut grads, 1.0)?;
//! scaler.step(&mut opt, &mut grads)?;                    // skipped on inf/NaN gradients
//! scaler.update()?;
//! ```
//!
//! Every number follows torch's CPU kernels: the scale is a float32, unscaling multiplies by the
//! float32 `1/scale` (computed in f64, as torch does), a gradient holding any inf or NaN skips
//! the step, and `update` backs off (`scale * backoff_factor`) after a skipped step or grows the
//! scale by `growth_factor` after `growth_interval` clean steps in a row unless that overflows.
//! Under Ddp every rank unscales the same averaged gradients, so all ranks skip together.
use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use tandem_ckpt::Value;

use crate::{OptimError, Part, TorchOptimizer};

/// `torch.amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval, enabled)`.
#[derive(Clone, Debug, PartialEq)]
pub struct GradScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: i64,
    /// A disabled scaler passes everything through: `scale` returns the loss, `step` always
    /// steps, `update` does nothing, and its state_dict is empty (as torch's).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    fn validate(&self) -> Result<(), OptimError> {
        let bad = |name, value: String, why| {
            Err(OptimError::InvalidConfig { of: Part::GradScaler, name, value, why })
        };
        if !valid_scale(self.init_scale) {
            return bad(
                "init_scale",
                self.init_scale.to_string(),
                "must be > 0 and finite in float32",
            );
        }
        if !(self.growth_factor > 1.0 && self.growth_factor.is_finite()) {
            return bad("growth_factor", self.growth_factor.to_string(), "must be > 1");
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad("backoff_factor", self.backoff_factor.to_string(), "must be in (0, 1)");
        }
        if self.growth_interval <= 0 {
            return bad("growth_interval", self.growth_interval.to_string(), "must be >= 1");
        }
        Ok(())
    }
}

/// Where one optimizer is in the current iteration (torch's `OptState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Unscaled { found_inf: bool },
    Stepped { found_inf: bool },
}

impl Stage {
    fn found_inf(self) -> bool {
        match self {
            Stage::Unscaled { found_inf } | Stage::Stepped { found_inf } => found_inf,
        }
    }
}

/// Dynamic loss scaling, as `torch.amp.GradScaler`. See the module docs for the recipe.
#[derive(Debug)]
pub struct GradScaler {
    cfg: GradScalerConfig,
    scale: f32,
    growth_tracker: i64,
    /// This iteration's stage of each optimizer, keyed by its parameters (torch keys by the
    /// optimizer object).
    stages: HashMap<Vec<TensorId>, Stage>,
}

impl GradScaler {
    pub fn new(cfg: GradScalerConfig) -> Result<Self, OptimError> {
        cfg.validate()?;
        Ok(GradScaler {
            scale: cfg.init_scale as f32,
            growth_tracker: 0,
            stages: HashMap::new(),
            cfg,
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// The current scale (1.0 when disabled, as torch).
    pub fn get_scale(&self) -> f64 {
        if self.cfg.enabled {
            self.scale as f64
        } else {
            1.0
        }
    }

    /// Clean steps since the last growth or backoff.
    pub fn growth_tracker(&self) -> i64 {
        self.growth_tracker
    }

    /// `loss * scale`. As in torch, a half-precision loss comes back as float32 (the scale is a
    /// float32 scalar and type promotion keeps the wider type).
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor, OptimError> {
        if !self.cfg.enabled {
            return Ok(loss.clone());
        }
        let dtype = match loss.dtype() {
            DType::F16 | DType::BF16 => DType::F32,
            other => other,
        };
        let scale = Tensor::new(self.scale, loss.device())
            .and_then(|s| s.to_dtype(dtype))
            .map_err(OptimError::Scale)?;
        loss.to_dtype(dtype).and_then(|l| l.broadcast_mul(&scale)).map_err(OptimError::Scale)
    }

    /// Divides the gradients of `optimizer`'s parameters by the scale, in place in `grads`, and
    /// records whether any holds an inf or NaN. At most once per optimizer per iteration.
    pub fn unscale_<O: TorchOptimizer + ?Sized>(
        &mut self,
        optimizer: &O,
        grads: &mut GradStore,
    ) -> Result<(), OptimError> {
        if !self.cfg.enabled {
            return Ok(());
        }
        let params = optimizer.params();
        if let Some(stage) = self.stages.get(&key_of(&params)) {
            return Err(match stage {
                Stage::Unscaled { .. } => OptimError::AlreadyUnscaled,
                Stage::Stepped { .. } => OptimError::AlreadyStepped,
            });
        }
        self.unscale_params(&params, grads)?;
        Ok(())
    }

    /// [`GradScaler::unscale_`] for gradients sharded over ranks (PyTorch's
    /// `ShardedGradScaler`): an inf or NaN in any rank's shard counts on every rank, so all of
    /// them skip the step together. `sum_over_ranks` sums a number over those ranks (a
    /// collective: every rank calls this).
    pub fn unscale_over<O: TorchOptimizer + ?Sized>(
        &mut self,
        optimizer: &O,
        grads: &mut GradStore,
        sum_over_ranks: impl FnOnce(f64) -> Result<f64, Box<dyn std::error::Error + Send + Sync>>,
    ) -> Result<(), OptimError> {
        if !self.cfg.enabled {
            return Ok(());
        }
        self.unscale_(optimizer, grads)?;
        let key = key_of(&optimizer.params());
        let mine = self.stages.get(&key).is_some_and(|s| s.found_inf());
        let anywhere = sum_over_ranks(if mine { 1.0 } else { 0.0 }).map_err(|source| {
            OptimError::OverRanks { what: "the GradScaler's inf check", source }
        })? > 0.0;
        self.stages.insert(key, Stage::Unscaled { found_inf: anywhere });
        Ok(())
    }

    /// Unscales the gradients of `params` and records the stage under their key; returns whether
    /// any held an inf or NaN.
    fn unscale_params(
        &mut self,
        params: &[Var],
        grads: &mut GradStore,
    ) -> Result<bool, OptimError> {
        // The reciprocal in f64, rounded to f32, as torch's `_scale.double().reciprocal().float()`.
        let inv_scale = (1.0 / self.scale as f64) as f32;
        let found_inf = unscale_grads(params, grads, inv_scale)?;
        self.stages.insert(key_of(params), Stage::Unscaled { found_inf });
        Ok(found_inf)
    }

    /// Unscales (unless [`GradScaler::unscale_`] already did) and steps `optimizer` when no
    /// gradient holds an inf or NaN. Returns whether it stepped.
    pub fn step<O: TorchOptimizer + ?Sized>(
        &mut self,
        optimizer: &mut O,
        grads: &mut GradStore,
    ) -> Result<bool, OptimError> {
        if !self.cfg.enabled {
            optimizer.step(grads)?;
            return Ok(true);
        }
        let params = optimizer.params();
        let key = key_of(&params);
        let found_inf = match self.stages.get(&key) {
            None => self.unscale_params(&params, grads)?,
            Some(Stage::Unscaled { found_inf }) => *found_inf,
            Some(Stage::Stepped { .. }) => return Err(OptimError::AlreadyStepped),
        };
        if !found_inf {
            optimizer.step(grads)?;
        }
        self.stages.insert(key, Stage::Stepped { found_inf });
        Ok(!found_inf)
    }

    /// Ends the iteration: backs the scale off if any optimizer found an inf or NaN, else counts
    /// a clean step and grows the scale after `growth_interval` of them (unless the grown scale
    /// overflows float32).
    pub fn update(&mut self) -> Result<(), OptimError> {
        if !self.cfg.enabled {
            return Ok(());
        }
        if self.stages.is_empty() {
            return Err(OptimError::NoInfChecks);
        }
        let found_inf = self.stages.values().any(|s| s.found_inf());
        self.stages.clear();
        // torch's `_amp_update_scale_` (CPU): float scale times double factor, stored as float.
        if found_inf {
            self.scale = (self.scale as f64 * self.cfg.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            let successful = self.growth_tracker + 1;
            if successful == self.cfg.growth_interval {
                let grown = (self.scale as f64 * self.cfg.growth_factor) as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
        Ok(())
    }

    /// Sets the scale by hand (`update(new_scale)` in torch) and ends the iteration.
    pub fn update_to(&mut self, new_scale: f64) -> Result<(), OptimError> {
        if !self.cfg.enabled {
            return Ok(());
        }
        if !valid_scale(new_scale) {
            return Err(OptimError::InvalidConfig {
                of: Part::GradScaler,
                name: "new_scale",
                value: new_scale.to_string(),
                why: "must be > 0 and finite in float32",
            });
        }
        self.scale = new_scale as f32;
        self.stages.clear();
        Ok(())
    }

    /// torch's layout: `{scale, growth_factor, backoff_factor, growth_interval, _growth_tracker}`
    /// (empty when disabled), so `torch.amp.GradScaler().load_state_dict` takes it.
    pub fn state_dict(&self) -> Value {
        if !self.cfg.enabled {
            return Value::Dict(vec![]);
        }
        Value::dict_from([
            ("scale", Value::Float(self.scale as f64)),
            ("growth_factor", Value::Float(self.cfg.growth_factor)),
            ("backoff_factor", Value::Float(self.cfg.backoff_factor)),
            ("growth_interval", Value::Int(self.cfg.growth_interval)),
            ("_growth_tracker", Value::Int(self.growth_tracker)),
        ])
    }

    /// Loads a state made by [`GradScaler::state_dict`] or by torch. A no-op when disabled (as
    /// torch); nothing changes when an error is returned.
    pub fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), OptimError> {
        if !self.cfg.enabled {
            return Ok(());
        }
        let Value::Dict(items) = state_dict else {
            return Err(scaler_state("(root)", "not a dict"));
        };
        if items.is_empty() {
            return Err(OptimError::EmptyStateDict);
        }
        let get =
            |key: &'static str| state_dict.get(key).ok_or_else(|| scaler_state(key, "missing"));
        let number = |key: &'static str| -> Result<f64, OptimError> {
            match get(key)? {
                Value::Float(f) => Ok(*f),
                Value::Int(i) => Ok(*i as f64),
                other => {
                    Err(scaler_state(key, format!("expected a number, got {}", other.type_name())))
                }
            }
        };
        let int = |key: &'static str| -> Result<i64, OptimError> {
            match get(key)? {
                Value::Int(i) => Ok(*i),
                other => {
                    Err(scaler_state(key, format!("expected an int, got {}", other.type_name())))
                }
            }
        };
        let cfg = GradScalerConfig {
            init_scale: number("scale")?,
            growth_factor: number("growth_factor")?,
            backoff_factor: number("backoff_factor")?,
            growth_interval: int("growth_interval")?,
            enabled: true,
        };
        cfg.validate().map_err(|e| match e {
            OptimError::InvalidConfig { name, why, .. } => {
                scaler_state(if name == "init_scale" { "scale" } else { name }, why)
            }
            other => other,
        })?;
        let tracker = int("_growth_tracker")?;
        if tracker < 0 {
            return Err(scaler_state("_growth_tracker", "must be >= 0"));
        }
        self.scale = cfg.init_scale as f32;
        self.growth_tracker = tracker;
        self.cfg = cfg;
        self.stages.clear();
        Ok(())
    }
}

/// The GradScaler's state_dict entry `key` does not fit: `why`.
fn scaler_state(key: &str, why: impl Into<String>) -> OptimError {
    OptimError::state_dict(Part::GradScaler, key, why)
}

/// A loss scale GradScaler can hold: positive and finite as a float32.
fn valid_scale(v: f64) -> bool {
    v > 0.0 && (v as f32).is_finite()
}

fn key_of(params: &[Var]) -> Vec<TensorId> {
    params.iter().map(|v| v.as_tensor().id()).collect()
}

/// Multiplies every gradient of `params` by `inv_scale` (torch's
/// `_amp_foreach_non_finite_check_and_unscale_`: in float32 for float32 and bf16 gradients, f64
/// for f64) and returns whether any held an inf or NaN. One host read for all of them.
fn unscale_grads(
    params: &[Var],
    grads: &mut GradStore,
    inv_scale: f32,
) -> Result<bool, OptimError> {
    let mut non_finite: Option<Tensor> = None;
    for (index, p) in params.iter().enumerate() {
        let Some(g) = grads.get(p.as_tensor()) else { continue };
        let candle = |source| OptimError::Gradient { of: Part::GradScaler, index, source };
        let (compute, back) = match g.dtype() {
            DType::F16 => return Err(OptimError::Fp16Gradient { index }),
            DType::BF16 => (DType::F32, Some(DType::BF16)),
            DType::F64 => (DType::F64, None),
            _ => (DType::F32, None),
        };
        let g = g.to_dtype(compute).map_err(candle)?;
        // x - x is 0 for every finite x and NaN for inf and NaN; its sum cannot overflow.
        let check = g.sub(&g).and_then(|d| d.sum_all()).and_then(|s| s.to_dtype(DType::F64));
        let check = check.map_err(candle)?;
        non_finite = Some(match non_finite {
            None => check,
            Some(acc) => acc.add(&check).map_err(candle)?,
        });
        let inv = Tensor::new(inv_scale, g.device()).and_then(|s| s.to_dtype(compute));
        let mut unscaled = inv.and_then(|s| g.broadcast_mul(&s)).map_err(candle)?;
        if let Some(back) = back {
            unscaled = unscaled.to_dtype(back).map_err(candle)?;
        }
        grads.insert(p.as_tensor(), unscaled);
    }
    match non_finite {
        None => Ok(false),
        Some(t) => {
            let v = t.to_scalar::<f64>().map_err(|source| OptimError::Gradient {
                of: Part::GradScaler,
                index: 0,
                source,
            })?;
            Ok(!v.is_finite())
        }
    }
}

/// A [`VarBuilder`] over float32 master variables that hands the model each weight cast to
/// `dtype` (bf16 or f16): the forward and backward compute in `dtype`, the gradients arrive at
/// the float32 [`Var`]s (the cast is differentiable), and the optimizer updates float32 — what
/// `torch.autocast` gives for the weights of matmuls and convolutions.
///
/// The casts are taken when the model is built, so build the model from this builder again at
/// every step (candle models are cheap to build: they only hold tensor handles), after the
/// optimizer has updated the master weights. Variables missing from `vars` are refused, not
/// created: they would be created in `dtype` and never reach the optimizer's float32 list.
pub fn autocast_var_builder(
    vars: &candle_nn::VarMap,
    dtype: DType,
    device: &candle_core::Device,
) -> VarBuilder<'static> {
    let backend = AutocastBackend { vars: vars.clone(), dtype };
    VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
}

struct AutocastBackend {
    vars: candle_nn::VarMap,
    dtype: DType,
}

impl AutocastBackend {
    /// The master variable `name` on `dev`, cast to the compute dtype; its shape checked against
    /// `shape` when the model states one.
    fn cast_master(
        &self,
        name: &str,
        shape: Option<&candle_core::Shape>,
        dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        let data = self.vars.data().lock().map_err(|_| {
            candle_core::Error::Msg("autocast: the VarMap's lock is poisoned".into())
        })?;
        let Some(var) = data.get(name) else {
            candle_core::bail!("autocast: no master variable `{name}` (build the model once from a VarBuilder over the VarMap first)")
        };
        if let Some(s) = shape.filter(|s| *s != var.shape()) {
            candle_core::bail!(
                "autocast: variable `{name}` has shape {:?}, the model asks for {s:?}",
                var.shape()
            )
        }
        var.as_tensor().to_device(dev)?.to_dtype(self.dtype)
    }
}

impl SimpleBackend for AutocastBackend {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _h: candle_nn::Init,
        _dtype: DType,
        dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        self.cast_master(name, Some(&s), dev)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        self.cast_master(name, None, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars.data().lock().map(|d| d.contains_key(name)).unwrap_or(false)
    }
}
