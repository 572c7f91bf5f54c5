//! `torch.optim.Adam` and `torch.optim.AdamW` (torch 2.x: AdamW is Adam with decoupled weight
//! decay), following torch's single-tensor update:
//! `step += 1; p *= 1 - lr*wd (AdamW) or g += wd*p (Adam);`
//! `m = lerp(m, g, 1-beta1); v = beta2*v + (1-beta2)*g*g; vmax = max(vmax, v) (amsgrad);`
//! `p -= lr/(1-beta1^step) * m / (sqrt(v or vmax)/sqrt(1-beta2^step) + eps)`.
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use tandem_ckpt::Value;

use crate::groups::{
    only_keys, refuse_true, saved_bool, saved_f64, saved_tensor, torch_number, Groups, Hyper,
    ParamState,
};
use crate::{non_negative, OptimError, Part, TorchOptimizer};

/// Hyperparameters of `torch.optim.Adam` (torch's defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, amsgrad: false }
    }
}

/// Hyperparameters of `torch.optim.AdamW`: Adam's, with torch's AdamW default weight decay 0.01.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub amsgrad: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 1e-2, amsgrad: false }
    }
}

impl From<AdamWConfig> for AdamConfig {
    fn from(c: AdamWConfig) -> Self {
        AdamConfig {
            lr: c.lr,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            amsgrad: c.amsgrad,
        }
    }
}

/// One group's settings: the config plus torch's `decoupled_weight_decay` flag.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AdamHyper {
    pub(crate) cfg: AdamConfig,
    pub(crate) decoupled: bool,
}

impl AdamHyper {
    fn validate(&self) -> Result<(), OptimError> {
        let c = &self.cfg;
        let bad = |name, value: f64, why| {
            Err(OptimError::InvalidConfig {
                of: Part::Optimizer,
                name,
                value: value.to_string(),
                why,
            })
        };
        if !non_negative(c.lr) {
            return bad("lr", c.lr, "must be >= 0");
        }
        if !non_negative(c.eps) {
            return bad("eps", c.eps, "must be >= 0");
        }
        if !(0.0..1.0).contains(&c.betas.0) {
            return bad("betas[0]", c.betas.0, "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&c.betas.1) {
            return bad("betas[1]", c.betas.1, "must be in [0, 1)");
        }
        if !non_negative(c.weight_decay) {
            return bad("weight_decay", c.weight_decay, "must be >= 0");
        }
        Ok(())
    }
}

impl Hyper for AdamHyper {
    fn lr(&self) -> f64 {
        self.cfg.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }
    fn entries(&self) -> Vec<(&'static str, Value)> {
        let c = &self.cfg;
        vec![
            ("lr", Value::Float(c.lr)),
            ("betas", Value::Tuple(vec![Value::Float(c.betas.0), Value::Float(c.betas.1)])),
            ("eps", Value::Float(c.eps)),
            ("weight_decay", torch_number(c.weight_decay)),
            ("amsgrad", Value::Bool(c.amsgrad)),
            ("maximize", Value::Bool(false)),
            ("foreach", Value::None),
            ("capturable", Value::Bool(false)),
            ("differentiable", Value::Bool(false)),
            ("fused", Value::None),
            ("decoupled_weight_decay", Value::Bool(self.decoupled)),
        ]
    }
    fn merge_saved(&self, g: &Value, key: &str) -> Result<Self, OptimError> {
        refuse_true(g, "maximize", key)?;
        let betas = match g.get("betas") {
            None => self.cfg.betas,
            Some(b) => match b.as_list() {
                Some([b1, b2]) => match (b1.as_float(), b2.as_float()) {
                    (Some(b1), Some(b2)) => (b1, b2),
                    _ => {
                        return Err(OptimError::state(
                            format!("{key}.betas"),
                            "expected two numbers",
                        ))
                    }
                },
                _ => {
                    return Err(OptimError::state(
                        format!("{key}.betas"),
                        "expected a pair (beta1, beta2)",
                    ))
                }
            },
        };
        let h = AdamHyper {
            cfg: AdamConfig {
                lr: saved_f64(g, "lr", self.cfg.lr, key)?,
                betas,
                eps: saved_f64(g, "eps", self.cfg.eps, key)?,
                weight_decay: saved_f64(g, "weight_decay", self.cfg.weight_decay, key)?,
                amsgrad: saved_bool(g, "amsgrad", self.cfg.amsgrad, key)?,
            },
            decoupled: saved_bool(g, "decoupled_weight_decay", self.decoupled, key)?,
        };
        h.validate().map_err(|e| OptimError::state(key, e.to_string()))?;
        Ok(h)
    }
}

const ADAM_KEYS: &[&str] = &[
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
];

/// `state[i]` of Adam/AdamW. `step` is kept as f64 and written as torch 2.x writes it: a 0-d
/// float32 tensor.
pub(crate) struct AdamState {
    step: f64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Option<Tensor>,
}

impl ParamState for AdamState {
    fn to_value(&self, key: &str) -> Result<Value, OptimError> {
        let t = |name: &str, t: &Tensor| -> Result<Value, OptimError> {
            Ok(Value::Tensor(crate::tensor::to_ckpt(t, &format!("{key}.{name}"))?))
        };
        let mut items = vec![
            ("step", Value::Tensor(tandem_ckpt::TensorData::scalar_f32(self.step as f32))),
            ("exp_avg", t("exp_avg", &self.exp_avg)?),
            ("exp_avg_sq", t("exp_avg_sq", &self.exp_avg_sq)?),
        ];
        if let Some(m) = &self.max_exp_avg_sq {
            items.push(("max_exp_avg_sq", t("max_exp_avg_sq", m)?));
        }
        Ok(Value::dict_from(items))
    }
    fn from_value(saved: &Value, param: &Tensor, key: &str) -> Result<Self, OptimError> {
        only_keys(saved, &["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"], key)?;
        // torch 2.x saves a 0-d tensor; torch 1.x saved a plain number.
        let step = match saved.get("step") {
            Some(Value::Tensor(t)) if t.numel() == 1 => t.to_f64_vec()[0],
            Some(Value::Int(i)) => *i as f64,
            Some(Value::Float(f)) => *f,
            Some(other) => {
                return Err(OptimError::state(
                    format!("{key}.step"),
                    format!("expected a scalar, found {other:?}"),
                ))
            }
            None => return Err(OptimError::state(format!("{key}.step"), "missing")),
        };
        if !(step >= 0.0 && step.fract() == 0.0) {
            return Err(OptimError::state(
                format!("{key}.step"),
                format!("{step} is not a step count"),
            ));
        }
        let max_exp_avg_sq = match saved.get("max_exp_avg_sq") {
            None | Some(Value::None) => None,
            Some(_) => Some(saved_tensor(saved, "max_exp_avg_sq", param, key)?),
        };
        Ok(AdamState {
            step,
            exp_avg: saved_tensor(saved, "exp_avg", param, key)?,
            exp_avg_sq: saved_tensor(saved, "exp_avg_sq", param, key)?,
            max_exp_avg_sq,
        })
    }
}

/// Adam with torch's semantics and state_dict layout (weight decay added to the gradient).
pub struct TorchAdam {
    groups: Groups<AdamHyper, AdamState>,
}

impl TorchAdam {
    /// One param group holding `params` (index i in the state_dict = `params[i]`).
    pub fn new(params: Vec<Var>, config: AdamConfig) -> Result<Self, OptimError> {
        Self::with_groups(vec![(params, config)])
    }

    /// Several param groups with their own hyperparameters, numbered across groups in order.
    pub fn with_groups(groups: Vec<(Vec<Var>, AdamConfig)>) -> Result<Self, OptimError> {
        Self::build(groups, false)
    }

    fn build(groups: Vec<(Vec<Var>, AdamConfig)>, decoupled: bool) -> Result<Self, OptimError> {
        let groups: Vec<(Vec<Var>, AdamHyper)> =
            groups.into_iter().map(|(p, cfg)| (p, AdamHyper { cfg, decoupled })).collect();
        for (_, h) in &groups {
            h.validate()?;
        }
        Ok(TorchAdam { groups: Groups::new(groups)? })
    }

    /// The hyperparameters of each group.
    pub fn configs(&self) -> Vec<AdamConfig> {
        self.groups.groups.iter().map(|g| g.hyper.cfg.clone()).collect()
    }

    /// Adam moves every row's moments whatever its gradient: the rows are made dense.
    fn update_rows(
        h: &AdamHyper,
        state: &mut Option<AdamState>,
        var: &Var,
        rows: &[u32],
        grad_rows: &Tensor,
    ) -> candle_core::Result<()> {
        Self::update(h, state, var, &densify(var, rows, grad_rows)?)
    }

    fn update(
        h: &AdamHyper,
        state: &mut Option<AdamState>,
        var: &Var,
        grad: &Tensor,
    ) -> candle_core::Result<()> {
        let held = state
            .iter()
            .flat_map(|s| [Some(&s.exp_avg), Some(&s.exp_avg_sq), s.max_exp_avg_sq.as_ref()])
            .flatten();
        if crate::fused::applies(var, grad, held) {
            return update_fused(h, state, var, grad);
        }
        update_tensor_form(h, state, var, grad)
    }
}

/// A gradient of rows `rows` only (see `TorchOptimizer::set_grad_rows`) as the dense one: the
/// rows added into zeros of `var`'s shape.
pub fn densify(var: &Var, rows: &[u32], grad_rows: &Tensor) -> candle_core::Result<Tensor> {
    let ids = Tensor::from_vec(rows.to_vec(), rows.len(), grad_rows.device())?;
    var.as_tensor().zeros_like()?.index_add(&ids, &grad_rows.to_dtype(var.dtype())?, 0)
}

/// The in-place CPU f32 update (`fused::adam`), bit-identical to [`update_tensor_form`].
fn update_fused(
    h: &AdamHyper,
    state: &mut Option<AdamState>,
    var: &Var,
    grad: &Tensor,
) -> candle_core::Result<()> {
    use crate::fused::adam::{running_max, update_moments, update_param, AdamStep};
    let p = var.as_tensor();
    let grad = grad.detach().contiguous()?;
    let mut st = match state.take() {
        Some(s) => AdamState {
            step: s.step,
            exp_avg: s.exp_avg.contiguous()?,
            exp_avg_sq: s.exp_avg_sq.contiguous()?,
            max_exp_avg_sq: s.max_exp_avg_sq.map(|m| m.contiguous()).transpose()?,
        },
        // The tensor form's starting point: zeros (and a zero maximum under amsgrad).
        None => AdamState {
            step: 0.0,
            exp_avg: p.zeros_like()?,
            exp_avg_sq: p.zeros_like()?,
            max_exp_avg_sq: if h.cfg.amsgrad { Some(p.zeros_like()?) } else { None },
        },
    };
    st.step += 1.0;
    let k = AdamStep::new(h, st.step);
    update_moments(k, var, &grad, &st.exp_avg, &st.exp_avg_sq)?;
    if h.cfg.amsgrad {
        match &st.max_exp_avg_sq {
            Some(m) => running_max(m, &st.exp_avg_sq)?,
            // amsgrad switched on for state saved without it: start from this step's value
            // (a copy: both are updated in place from now on).
            None => st.max_exp_avg_sq = Some(st.exp_avg_sq.copy()?),
        }
    }
    let second = match (&st.max_exp_avg_sq, h.cfg.amsgrad) {
        (Some(m), true) => m,
        _ => &st.exp_avg_sq,
    };
    update_param(k, var, &st.exp_avg, second)?;
    *state = Some(st);
    Ok(())
}

/// The update as candle tensor expressions: any dtype and device.
fn update_tensor_form(
    h: &AdamHyper,
    state: &mut Option<AdamState>,
    var: &Var,
    grad: &Tensor,
) -> candle_core::Result<()> {
    let c = &h.cfg;
    let (beta1, beta2) = c.betas;
    let mut p = var.as_tensor().detach();
    let mut d = grad.detach().to_dtype(p.dtype())?;
    let st = match state.take() {
        Some(s) => s,
        None => AdamState {
            step: 0.0,
            exp_avg: p.zeros_like()?,
            exp_avg_sq: p.zeros_like()?,
            max_exp_avg_sq: if c.amsgrad { Some(p.zeros_like()?) } else { None },
        },
    };
    let step = st.step + 1.0;
    if c.weight_decay != 0.0 {
        if h.decoupled {
            p = p.affine(1.0 - c.lr * c.weight_decay, 0.0)?;
        } else {
            d = (d + p.affine(c.weight_decay, 0.0)?)?;
        }
    }
    // exp_avg.lerp_(grad, 1 - beta1)
    let exp_avg = (&st.exp_avg + (&d - &st.exp_avg)?.affine(1.0 - beta1, 0.0)?)?;
    let exp_avg_sq = (st.exp_avg_sq.affine(beta2, 0.0)? + d.sqr()?.affine(1.0 - beta2, 0.0)?)?;
    let bias_correction1 = 1.0 - beta1.powf(step);
    let bias_correction2 = 1.0 - beta2.powf(step);
    let step_size = c.lr / bias_correction1;
    let bias_correction2_sqrt = bias_correction2.sqrt();
    let max_exp_avg_sq = match (c.amsgrad, st.max_exp_avg_sq) {
        (true, Some(m)) => Some(m.maximum(&exp_avg_sq)?),
        (true, None) => Some(exp_avg_sq.clone()),
        (false, kept) => kept,
    };
    let second =
        if c.amsgrad { max_exp_avg_sq.as_ref().unwrap_or(&exp_avg_sq) } else { &exp_avg_sq };
    let denom = second.sqrt()?.affine(1.0 / bias_correction2_sqrt, c.eps)?;
    let new_p = (p + (&exp_avg / &denom)?.affine(-step_size, 0.0)?)?;
    var.set(&new_p)?;
    *state = Some(AdamState { step, exp_avg, exp_avg_sq, max_exp_avg_sq });
    Ok(())
}

impl_optimizer_via_groups!(TorchAdam, AdamConfig, ADAM_KEYS);

/// AdamW: Adam with decoupled weight decay (`p *= 1 - lr*weight_decay` before the update),
/// state_dict identical to torch's `AdamW` (`decoupled_weight_decay: True`).
pub struct TorchAdamW {
    inner: TorchAdam,
}

impl TorchAdamW {
    pub fn new(params: Vec<Var>, config: AdamWConfig) -> Result<Self, OptimError> {
        Self::with_groups(vec![(params, config)])
    }

    pub fn with_groups(groups: Vec<(Vec<Var>, AdamWConfig)>) -> Result<Self, OptimError> {
        let groups = groups.into_iter().map(|(p, c)| (p, AdamConfig::from(c))).collect();
        Ok(TorchAdamW { inner: TorchAdam::build(groups, true)? })
    }

    /// The hyperparameters of each group.
    pub fn configs(&self) -> Vec<AdamConfig> {
        self.inner.configs()
    }

    /// One update of every parameter that has a gradient in `grads`.
    pub fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        self.inner.step(grads)
    }
}

/// candle-nn's optimizer interface (see [`TorchSgd`](crate::TorchSgd)'s).
impl candle_nn::Optimizer for TorchAdamW {
    type Config = AdamWConfig;
    fn new(vars: Vec<Var>, config: AdamWConfig) -> candle_core::Result<Self> {
        TorchAdamW::new(vars, config).map_err(candle_core::Error::wrap)
    }
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.inner.step(grads).map_err(candle_core::Error::wrap)
    }
    fn learning_rate(&self) -> f64 {
        self.inner.lr()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }
}

impl TorchOptimizer for TorchAdamW {
    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        self.inner.step(grads)
    }
    fn lr(&self) -> f64 {
        self.inner.lr()
    }
    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }
    fn group_lrs(&self) -> Vec<f64> {
        self.inner.group_lrs()
    }
    fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<(), OptimError> {
        self.inner.set_group_lrs(lrs)
    }
    fn params(&self) -> Vec<Var> {
        self.inner.params()
    }
    fn state_dict(&self) -> Result<Value, OptimError> {
        self.inner.state_dict()
    }
    fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), OptimError> {
        self.inner.load_state_dict(state_dict)
    }
    fn param_state(&self, index: usize) -> Result<Value, OptimError> {
        self.inner.param_state(index)
    }
    fn set_grad_rows(&mut self, index: usize, rows: Vec<u32>) -> Result<(), OptimError> {
        self.inner.set_grad_rows(index, rows)
    }
    fn set_param(&mut self, index: usize, var: Var) -> Result<(), OptimError> {
        self.inner.set_param(index, var)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::{update_fused, update_tensor_form, AdamConfig, AdamHyper, AdamState};

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// (step, exp_avg, exp_avg_sq, max_exp_avg_sq) as bits.
    type StateBits = (u64, Vec<u32>, Vec<u32>, Option<Vec<u32>>);

    fn state_bits(s: &Option<AdamState>) -> Option<StateBits> {
        s.as_ref().map(|s| {
            (
                s.step.to_bits(),
                bits(&s.exp_avg),
                bits(&s.exp_avg_sq),
                s.max_exp_avg_sq.as_ref().map(bits),
            )
        })
    }

    /// The fused in-place CPU path gives the very bits of the tensor-expression form: Adam and
    /// AdamW, with and without weight decay and amsgrad, over several steps, state included.
    #[test]
    fn fused_cpu_update_is_bit_identical_to_the_tensor_form() {
        let cases = [
            (AdamConfig::default(), false),
            (AdamConfig { lr: 3e-3, weight_decay: 1e-2, ..Default::default() }, false),
            (AdamConfig { lr: 1e-2, weight_decay: 1e-2, ..Default::default() }, true),
            (
                AdamConfig {
                    lr: 1e-2,
                    betas: (0.8, 0.95),
                    eps: 1e-6,
                    amsgrad: true,
                    ..Default::default()
                },
                false,
            ),
            (AdamConfig { lr: 5e-3, weight_decay: 0.1, amsgrad: true, ..Default::default() }, true),
        ];
        let dev = Device::Cpu;
        for (cfg, decoupled) in cases {
            let h = AdamHyper { cfg: cfg.clone(), decoupled };
            let init = Tensor::randn(0f32, 1.0, (23, 7), &dev).unwrap();
            let (fused, reference) = (
                Var::from_tensor(&init).unwrap(),
                Var::from_tensor(&init.copy().unwrap()).unwrap(),
            );
            let (mut sf, mut sr) = (None, None);
            for step in 0..5 {
                // Gradients shrink over the steps so amsgrad's maximum both keeps and replaces.
                let g = (Tensor::randn(0f32, 1.0, (23, 7), &dev).unwrap()
                    * (1.0 / (step + 1) as f64))
                    .unwrap();
                update_fused(&h, &mut sf, &fused, &g).unwrap();
                update_tensor_form(&h, &mut sr, &reference, &g).unwrap();
                let ctx = format!("{cfg:?} decoupled={decoupled} step {step}");
                assert_eq!(
                    bits(fused.as_tensor()),
                    bits(reference.as_tensor()),
                    "{ctx}: parameter"
                );
                assert_eq!(state_bits(&sf), state_bits(&sr), "{ctx}: state");
            }
        }
    }

    /// amsgrad switched on for state saved without a maximum: both forms start it from this
    /// step's exp_avg_sq, and the fused one's copy is not aliased to exp_avg_sq afterwards.
    #[test]
    fn amsgrad_turned_on_later_matches_and_does_not_alias() {
        let dev = Device::Cpu;
        let plain = AdamHyper { cfg: AdamConfig::default(), decoupled: false };
        let ams =
            AdamHyper { cfg: AdamConfig { amsgrad: true, ..Default::default() }, decoupled: false };
        let init = Tensor::randn(0f32, 1.0, 31, &dev).unwrap();
        let (fused, reference) =
            (Var::from_tensor(&init).unwrap(), Var::from_tensor(&init.copy().unwrap()).unwrap());
        let (mut sf, mut sr) = (None, None);
        for (step, h) in [&plain, &ams, &ams, &ams].into_iter().enumerate() {
            let g = (Tensor::randn(0f32, 1.0, 31, &dev).unwrap()
                * if step == 1 { 3.0 } else { 0.1 })
            .unwrap();
            update_fused(h, &mut sf, &fused, &g).unwrap();
            update_tensor_form(h, &mut sr, &reference, &g).unwrap();
            assert_eq!(bits(fused.as_tensor()), bits(reference.as_tensor()), "step {step}");
            assert_eq!(state_bits(&sf), state_bits(&sr), "step {step}");
        }
    }
}
