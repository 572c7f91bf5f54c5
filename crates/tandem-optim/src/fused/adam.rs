//! In-place `torch.optim.Adam` / `AdamW` step: one pass each over exp_avg, exp_avg_sq,
//! (max_exp_avg_sq,) and the parameter, mirroring `adam.rs`'s tensor form element by element.
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor, Var};

use super::{aff, operands, par_zip3};
use crate::adam::AdamHyper;

/// Per-step constants, rounded to f32 where candle's `affine` rounds them.
#[derive(Clone, Copy)]
pub(crate) struct AdamStep {
    /// Coupled weight decay added to the gradient (Adam), if any.
    coupled_wd: Option<f32>,
    /// Decoupled decay factor `1 - lr * wd` applied to the parameter (AdamW), if any.
    decay: Option<f32>,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    inv_bc2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

impl AdamStep {
    /// tandem-cuda's constants of this step.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn rule(&self) -> tandem_cuda::AdamRule {
        tandem_cuda::AdamRule {
            coupled_wd: self.coupled_wd.unwrap_or(0.0),
            decay: self.decay.unwrap_or(1.0),
            one_minus_beta1: self.one_minus_beta1,
            beta2: self.beta2,
            one_minus_beta2: self.one_minus_beta2,
            inv_bc2_sqrt: self.inv_bc2_sqrt,
            eps: self.eps,
            neg_step_size: self.neg_step_size,
            has_coupled_wd: self.coupled_wd.is_some() as i32,
            has_decay: self.decay.is_some() as i32,
        }
    }

    /// Constants for update number `step` (1-based), computed in f64 as the tensor form does.
    pub(crate) fn new(h: &AdamHyper, step: f64) -> Self {
        let c = &h.cfg;
        let (beta1, beta2) = c.betas;
        let with_wd = c.weight_decay != 0.0;
        let bias_correction1 = 1.0 - beta1.powf(step);
        let bias_correction2 = 1.0 - beta2.powf(step);
        AdamStep {
            coupled_wd: (with_wd && !h.decoupled).then_some(c.weight_decay as f32),
            decay: (with_wd && h.decoupled).then_some((1.0 - c.lr * c.weight_decay) as f32),
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            inv_bc2_sqrt: (1.0 / bias_correction2.sqrt()) as f32,
            eps: c.eps as f32,
            neg_step_size: (-(c.lr / bias_correction1)) as f32,
        }
    }
}

/// Updates both moments in place (on the first step they are the zero tensors the tensor
/// form starts from). Then the caller updates amsgrad's maximum ([`running_max`]) and the
/// parameter ([`update_param`]).
pub(crate) fn update_moments(
    k: AdamStep,
    var: &Var,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
) -> candle_core::Result<()> {
    let p = var.as_tensor();
    exp_avg.inplace_op3(grad, p, &FirstMoment(k))?;
    exp_avg_sq.inplace_op3(grad, p, &SecondMoment(k))
}

/// amsgrad: `max = maximum(max, exp_avg_sq)` in place.
pub(crate) fn running_max(max: &Tensor, exp_avg_sq: &Tensor) -> candle_core::Result<()> {
    max.inplace_op3(exp_avg_sq, exp_avg_sq, &RunningMax)
}

/// `p = decay(p) - step_size * exp_avg / (sqrt(second) / sqrt(bc2) + eps)`.
pub(crate) fn update_param(
    k: AdamStep,
    var: &Var,
    exp_avg: &Tensor,
    second: &Tensor,
) -> candle_core::Result<()> {
    var.as_tensor().inplace_op3(exp_avg, second, &ParamUpdate(k))
}

/// exp_avg = exp_avg + (d - exp_avg) * (1 - beta1)   (torch's `lerp_`).
struct FirstMoment(AdamStep);

impl InplaceOp3 for FirstMoment {
    fn name(&self) -> &'static str {
        "tandem-adam-exp-avg"
    }
    fn cpu_fwd(
        &self,
        m: &mut CpuStorage,
        ml: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        p: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        let k = self.0;
        let (m, g, p) = operands((m, ml, "exp_avg"), (g, gl, "gradient"), (p, pl, "parameter"))?;
        let w = k.one_minus_beta1;
        match k.coupled_wd {
            None => par_zip3(m, g, p, move |m, g, _p| m + aff(g - m, w)),
            Some(wd) => par_zip3(m, g, p, move |m, g, p| m + aff((g + aff(p, wd)) - m, w)),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        m: &mut candle_core::CudaStorage,
        ml: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        tandem_cuda::optim::adam_first_moment((m, ml), (g, gl), (p, pl), self.0.rule())
    }
}

/// exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d²
struct SecondMoment(AdamStep);

impl InplaceOp3 for SecondMoment {
    fn name(&self) -> &'static str {
        "tandem-adam-exp-avg-sq"
    }
    fn cpu_fwd(
        &self,
        v: &mut CpuStorage,
        vl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        p: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        let k = self.0;
        let (v, g, p) = operands((v, vl, "exp_avg_sq"), (g, gl, "gradient"), (p, pl, "parameter"))?;
        let (b2, w) = (k.beta2, k.one_minus_beta2);
        match k.coupled_wd {
            None => par_zip3(v, g, p, move |v, g, _p| aff(v, b2) + aff(g * g, w)),
            Some(wd) => par_zip3(v, g, p, move |v, g, p| {
                let d = g + aff(p, wd);
                aff(v, b2) + aff(d * d, w)
            }),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        v: &mut candle_core::CudaStorage,
        vl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        tandem_cuda::optim::adam_second_moment((v, vl), (g, gl), (p, pl), self.0.rule())
    }
}

struct RunningMax;

impl InplaceOp3 for RunningMax {
    fn name(&self) -> &'static str {
        "tandem-adam-max-exp-avg-sq"
    }
    fn cpu_fwd(
        &self,
        mx: &mut CpuStorage,
        ml: &Layout,
        v: &CpuStorage,
        vl: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        let (mx, v, _) =
            operands((mx, ml, "max_exp_avg_sq"), (v, vl, "exp_avg_sq"), (v, vl, "exp_avg_sq"))?;
        // candle's `maximum`: `if a < b { b } else { a }` (NaN in `a` is kept).
        par_zip3(mx, v, v, |mx, v, _| if mx < v { v } else { mx });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        mx: &mut candle_core::CudaStorage,
        ml: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        tandem_cuda::optim::adam_running_max((mx, ml), (v, vl))
    }
}

struct ParamUpdate(AdamStep);

impl InplaceOp3 for ParamUpdate {
    fn name(&self) -> &'static str {
        "tandem-adam-param"
    }
    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        pl: &Layout,
        m: &CpuStorage,
        ml: &Layout,
        s: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let k = self.0;
        let (p, m, s) = operands((p, pl, "parameter"), (m, ml, "exp_avg"), (s, sl, "exp_avg_sq"))?;
        let (inv, eps, step) = (k.inv_bc2_sqrt, k.eps, k.neg_step_size);
        let adam = move |base: f32, m: f32, s: f32| base + aff(m / (s.sqrt() * inv + eps), step);
        match k.decay {
            None => par_zip3(p, m, s, adam),
            Some(decay) => par_zip3(p, m, s, move |p, m, s| adam(aff(p, decay), m, s)),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &mut candle_core::CudaStorage,
        pl: &Layout,
        m: &candle_core::CudaStorage,
        ml: &Layout,
        s: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        tandem_cuda::optim::adam_param((p, pl), (m, ml), (s, sl), self.0.rule())
    }
}
