//! In-place `torch.optim.SGD` step: each parameter is read and written once (twice with
//! momentum: the buffer, then the weight).
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor, Var};

use super::{aff, operands};
use crate::sgd::SgdConfig;

/// One SGD step of `var` with `grad`, updating `buf` (the momentum buffer) in place when
/// momentum is on. `buf` is `None` on the first momentum step; the new buffer is returned.
pub(crate) fn step(
    h: &SgdConfig,
    var: &Var,
    grad: &Tensor,
    buf: Option<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    let p = var.as_tensor();
    let g = grad.detach().contiguous()?;
    let k = Kernel::new(h);
    let buf = if h.momentum == 0.0 {
        None
    } else {
        match buf {
            Some(b) => {
                let b = b.contiguous()?;
                b.inplace_op3(&g, p, &MomentumUpdate(k))?;
                Some(b)
            }
            // First step: buf = d = g + wd * p, a fresh tensor (candle's `d.copy()`).
            None => {
                let d = if h.weight_decay != 0.0 {
                    (&g + p.detach().affine(h.weight_decay, 0.0)?)?
                } else {
                    g.copy()?
                };
                Some(d)
            }
        }
    };
    // With momentum off the "buffer" argument is unused; pass the gradient to fill the slot.
    let b = buf.as_ref().unwrap_or(&g);
    p.inplace_op3(&g, b, &ParamUpdate(k))?;
    Ok(buf)
}

#[derive(Clone, Copy)]
struct Kernel {
    neg_lr: f32,
    wd: Option<f32>,
    momentum: f32,
    /// `1 - dampening`, or None when dampening is 0 (the tensor form skips that product).
    keep: Option<f32>,
    nesterov: bool,
    use_buf: bool,
}

impl Kernel {
    fn new(h: &SgdConfig) -> Self {
        Kernel {
            neg_lr: -h.lr as f32,
            wd: (h.weight_decay != 0.0).then_some(h.weight_decay as f32),
            momentum: h.momentum as f32,
            keep: (h.dampening != 0.0).then_some((1.0 - h.dampening) as f32),
            nesterov: h.nesterov,
            use_buf: h.momentum != 0.0,
        }
    }
    #[inline(always)]
    fn d(&self, g: f32, p: f32) -> f32 {
        match self.wd {
            Some(wd) => g + aff(p, wd),
            None => g,
        }
    }
}

/// buf = momentum * buf + (1 - dampening) * d, with d = g + wd * p.
struct MomentumUpdate(Kernel);

impl InplaceOp3 for MomentumUpdate {
    fn name(&self) -> &'static str {
        "tandem-sgd-momentum"
    }
    fn cpu_fwd(
        &self,
        b: &mut CpuStorage,
        bl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        p: &CpuStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        let k = self.0;
        let (b, g, p) =
            operands((b, bl, "momentum buffer"), (g, gl, "gradient"), (p, pl, "parameter"))?;
        for ((b, &g), &p) in b.iter_mut().zip(g).zip(p) {
            let d = k.d(g, p);
            *b = match k.keep {
                None => aff(*b, k.momentum) + d,
                Some(keep) => aff(*b, k.momentum) + aff(d, keep),
            };
        }
        Ok(())
    }
}

/// p = p - lr * (nesterov ? d + momentum * buf : buf), or p - lr * d without momentum.
struct ParamUpdate(Kernel);

impl InplaceOp3 for ParamUpdate {
    fn name(&self) -> &'static str {
        "tandem-sgd-param"
    }
    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        pl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<()> {
        let k = self.0;
        let (p, g, b) =
            operands((p, pl, "parameter"), (g, gl, "gradient"), (b, bl, "momentum buffer"))?;
        for ((p, &g), &b) in p.iter_mut().zip(g).zip(b) {
            let step = match (k.use_buf, k.nesterov) {
                (false, _) => k.d(g, *p),
                (true, false) => b,
                (true, true) => k.d(g, *p) + aff(b, k.momentum),
            };
            *p += aff(step, k.neg_lr);
        }
        Ok(())
    }
}
