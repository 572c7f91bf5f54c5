//! `torch.optim.SGD`: momentum, dampening, Nesterov and (coupled) weight decay, following
//! torch's single-tensor update order:
//! `d = g + wd*p; buf = d (first step) or momentum*buf + (1-dampening)*d;`
//! `d = d + momentum*buf (nesterov) or buf; p = p - lr*d`.
use candle_core::{Tensor, Var};
use tandem_ckpt::Value;

use crate::groups::{
    only_keys, refuse_true, saved_bool, saved_f64, torch_number, Groups, Hyper, ParamState,
};
use crate::{non_negative, OptimError, Part};

/// Hyperparameters of `torch.optim.SGD` (defaults as torch: lr 1e-3, everything else off).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl SgdConfig {
    /// torch's constructor checks, with the same conditions.
    fn validate(&self) -> Result<(), OptimError> {
        let bad = |name, value: f64, why| {
            Err(OptimError::InvalidConfig {
                of: Part::Optimizer,
                name,
                value: value.to_string(),
                why,
            })
        };
        if !non_negative(self.lr) {
            return bad("lr", self.lr, "must be >= 0");
        }
        if !non_negative(self.momentum) {
            return bad("momentum", self.momentum, "must be >= 0");
        }
        if !non_negative(self.weight_decay) {
            return bad("weight_decay", self.weight_decay, "must be >= 0");
        }
        if !self.dampening.is_finite() {
            return bad("dampening", self.dampening, "must be finite");
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad(
                "nesterov",
                1.0,
                "Nesterov momentum requires a momentum and zero dampening",
            );
        }
        Ok(())
    }
}

impl Hyper for SgdConfig {
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn entries(&self) -> Vec<(&'static str, Value)> {
        vec![
            ("lr", Value::Float(self.lr)),
            ("momentum", torch_number(self.momentum)),
            ("dampening", torch_number(self.dampening)),
            ("weight_decay", torch_number(self.weight_decay)),
            ("nesterov", Value::Bool(self.nesterov)),
            ("maximize", Value::Bool(false)),
            ("foreach", Value::None),
            ("differentiable", Value::Bool(false)),
            ("fused", Value::None),
        ]
    }
    fn merge_saved(&self, g: &Value, key: &str) -> Result<Self, OptimError> {
        refuse_true(g, "maximize", key)?;
        let cfg = SgdConfig {
            lr: saved_f64(g, "lr", self.lr, key)?,
            momentum: saved_f64(g, "momentum", self.momentum, key)?,
            dampening: saved_f64(g, "dampening", self.dampening, key)?,
            weight_decay: saved_f64(g, "weight_decay", self.weight_decay, key)?,
            nesterov: saved_bool(g, "nesterov", self.nesterov, key)?,
        };
        cfg.validate().map_err(|e| OptimError::state(key, e.to_string()))?;
        Ok(cfg)
    }
}

const SGD_KEYS: &[&str] = &[
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "nesterov",
    "maximize",
    "foreach",
    "differentiable",
    "fused",
];

/// `state[i]` of SGD: the momentum buffer, present once the parameter was stepped with
/// momentum on.
pub(crate) struct SgdState {
    momentum_buffer: Option<Tensor>,
}

impl ParamState for SgdState {
    fn to_value(&self, key: &str) -> Result<Value, OptimError> {
        let buf = match &self.momentum_buffer {
            Some(t) => Value::Tensor(crate::tensor::to_ckpt(t, &format!("{key}.momentum_buffer"))?),
            None => Value::None,
        };
        Ok(Value::dict_from([("momentum_buffer", buf)]))
    }
    fn from_value(saved: &Value, param: &Tensor, key: &str) -> Result<Self, OptimError> {
        only_keys(saved, &["momentum_buffer"], key)?;
        let momentum_buffer = match saved.get("momentum_buffer") {
            None | Some(Value::None) => None,
            Some(_) => Some(crate::groups::saved_tensor(saved, "momentum_buffer", param, key)?),
        };
        Ok(SgdState { momentum_buffer })
    }
}

/// Stochastic gradient descent with torch's semantics and state_dict layout.
pub struct TorchSgd {
    groups: Groups<SgdConfig, SgdState>,
}

impl TorchSgd {
    /// One param group holding `params` (index i in the state_dict = `params[i]`).
    pub fn new(params: Vec<Var>, config: SgdConfig) -> Result<Self, OptimError> {
        Self::with_groups(vec![(params, config)])
    }

    /// Several param groups, each with its own hyperparameters (torch's
    /// `SGD([{'params': ..., 'lr': ...}, ...])`); parameters are numbered across groups in order.
    pub fn with_groups(groups: Vec<(Vec<Var>, SgdConfig)>) -> Result<Self, OptimError> {
        for (_, c) in &groups {
            c.validate()?;
        }
        Ok(TorchSgd { groups: Groups::new(groups)? })
    }

    /// The hyperparameters of each group.
    pub fn configs(&self) -> Vec<SgdConfig> {
        self.groups.groups.iter().map(|g| g.hyper.clone()).collect()
    }

    /// The step with a gradient of rows `rows` only: in place row by row on the fused path,
    /// else with the gradient made dense.
    fn update_rows(
        h: &SgdConfig,
        state: &mut Option<SgdState>,
        var: &Var,
        rows: &[u32],
        grad_rows: &Tensor,
    ) -> candle_core::Result<()> {
        let prev = state.as_ref().and_then(|s| s.momentum_buffer.as_ref());
        if !crate::fused::applies(var, grad_rows, prev) {
            let dense = crate::adam::densify(var, rows, grad_rows)?;
            return update_tensor_form(h, state, var, &dense);
        }
        let prev = state.take().and_then(|s| s.momentum_buffer);
        let buf = crate::fused::sgd::step_rows(h, var, rows, grad_rows, prev)?;
        if h.momentum != 0.0 {
            *state = Some(SgdState { momentum_buffer: buf });
        }
        Ok(())
    }

    fn update(
        h: &SgdConfig,
        state: &mut Option<SgdState>,
        var: &Var,
        grad: &Tensor,
    ) -> candle_core::Result<()> {
        let prev = state.as_ref().and_then(|s| s.momentum_buffer.as_ref());
        if crate::fused::applies(var, grad, prev) {
            if h.momentum == 0.0 {
                crate::fused::sgd::step(h, var, grad, None)?;
            } else {
                let prev = state.take().and_then(|s| s.momentum_buffer);
                *state = Some(SgdState {
                    momentum_buffer: crate::fused::sgd::step(h, var, grad, prev)?,
                });
            }
            return Ok(());
        }
        update_tensor_form(h, state, var, grad)
    }
}

/// The update as candle tensor expressions: any dtype and device (the reference the fused CPU
/// path reproduces bit for bit).
pub(crate) fn update_tensor_form(
    h: &SgdConfig,
    state: &mut Option<SgdState>,
    var: &Var,
    grad: &Tensor,
) -> candle_core::Result<()> {
    let p = var.as_tensor().detach();
    let mut d = grad.detach().to_dtype(p.dtype())?;
    if h.weight_decay != 0.0 {
        d = (d + p.affine(h.weight_decay, 0.0)?)?;
    }
    if h.momentum != 0.0 {
        let prev = state.as_ref().and_then(|s| s.momentum_buffer.clone());
        let buf = match prev {
            None => crate::tensor::fresh_copy(&d)?,
            // `1 - dampening == 1` is the common case: skip an exact but costly pass.
            Some(b) if h.dampening == 0.0 => (b.affine(h.momentum, 0.0)? + &d)?,
            Some(b) => (b.affine(h.momentum, 0.0)? + d.affine(1.0 - h.dampening, 0.0)?)?,
        };
        d = if h.nesterov { (d + buf.affine(h.momentum, 0.0)?)? } else { buf.clone() };
        *state = Some(SgdState { momentum_buffer: Some(buf) });
    }
    var.set(&(p + d.affine(-h.lr, 0.0)?)?)
}

impl_optimizer_via_groups!(TorchSgd, SgdConfig, SGD_KEYS);

/// The gradient has the parameter's shape, or with `rows` that shape with `rows.len()` rows.
pub(crate) fn check_grad_shape(
    index: usize,
    var: &Var,
    grad: &Tensor,
    rows: Option<&[u32]>,
) -> Result<(), OptimError> {
    let mut want = var.dims().to_vec();
    if let (Some(rows), Some(first)) = (rows, want.first_mut()) {
        *first = rows.len();
    }
    if grad.dims() != want {
        return Err(OptimError::InvalidParam {
            index,
            why: format!(
                "gradient shape {:?} differs from {want:?} (parameter shape {:?}{})",
                grad.dims(),
                var.dims(),
                if rows.is_some() { ", gradient rows only" } else { "" }
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::{update_tensor_form, SgdConfig, SgdState};

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// The fused in-place CPU path gives the very bits of the tensor-expression form, for every
    /// hyperparameter combination, over several steps (momentum buffers included).
    #[test]
    fn fused_cpu_update_is_bit_identical_to_the_tensor_form() {
        let configs = [
            SgdConfig { lr: 0.1, ..Default::default() },
            SgdConfig { lr: 0.05, weight_decay: 1e-2, ..Default::default() },
            SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() },
            SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                dampening: 0.3,
                weight_decay: 5e-4,
                ..Default::default()
            },
            SgdConfig {
                lr: 0.02,
                momentum: 0.8,
                nesterov: true,
                weight_decay: 1e-3,
                ..Default::default()
            },
            // Each rule of the fused kernels (one loop per combination) is covered.
            SgdConfig { lr: 0.02, momentum: 0.8, nesterov: true, ..Default::default() },
            SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.3, ..Default::default() },
        ];
        let dev = Device::Cpu;
        for cfg in configs {
            let init = Tensor::randn(0f32, 1.0, (37, 5), &dev).unwrap();
            let (fused, reference) = (
                Var::from_tensor(&init).unwrap(),
                Var::from_tensor(&init.copy().unwrap()).unwrap(),
            );
            let (mut sf, mut sr): (Option<SgdState>, Option<SgdState>) = (None, None);
            for step in 0..4 {
                let g = Tensor::randn(0f32, 1.0, (37, 5), &dev).unwrap();
                assert!(crate::fused::applies(&fused, &g, None));
                super::TorchSgd::update(&cfg, &mut sf, &fused, &g).unwrap();
                update_tensor_form(&cfg, &mut sr, &reference, &g).unwrap();
                assert_eq!(
                    bits(fused.as_tensor()),
                    bits(reference.as_tensor()),
                    "{cfg:?} step {step}: parameter"
                );
                let buf = |s: &Option<SgdState>| {
                    s.as_ref().and_then(|s| s.momentum_buffer.as_ref()).map(bits)
                };
                assert_eq!(buf(&sf), buf(&sr), "{cfg:?} step {step}: momentum buffer");
            }
        }
    }

    /// f64 parameters take the tensor form (the fused kernel is f32-only) and still update.
    #[test]
    fn other_dtypes_take_the_tensor_form() {
        let v = Var::from_tensor(&Tensor::new(&[1.0f64, 2.0], &Device::Cpu).unwrap()).unwrap();
        let g = Tensor::new(&[0.5f64, -1.0], &Device::Cpu).unwrap();
        assert!(!crate::fused::applies(&v, &g, None));
        let mut s = None;
        super::TorchSgd::update(
            &SgdConfig { lr: 0.1, momentum: 0.5, ..Default::default() },
            &mut s,
            &v,
            &g,
        )
        .unwrap();
        assert_eq!(v.as_tensor().to_vec1::<f64>().unwrap(), vec![0.95, 2.1]);
        assert_eq!(v.dtype(), DType::F64);
    }
}
