//! In-place SGD update for f32 parameters on the CPU.
//!
//! The tensor-op form of `torch.optim.SGD` (see `sgd.rs`) allocates a new tensor per
//! expression and then copies the result into the parameter: about six passes over every
//! weight per step, which on the bench MLP cost as much as the backward's weight-gradient
//! accumulation. Here each parameter is read and written once (twice with momentum: the buffer,
//! then the weight), in place through candle's `InplaceOp3`. Every element is computed with the
//! same f32 operations in the same order as the tensor form — `affine(x, m)` is `x * m + 0` as
//! candle computes it — so results are bit-identical; other dtypes and devices use the tensor
//! form.
use candle_core::{CpuStorage, DType, InplaceOp3, Layout, Tensor, Var};

use super::sgd::SgdConfig;

/// candle's `affine(mul, 0)` on one f32.
#[inline(always)]
fn aff(x: f32, mul: f32) -> f32 {
    x * mul + 0.0
}

/// Whether the fused path applies: f32 parameter, gradient and buffer, all on the CPU.
pub(crate) fn applies(var: &Var, grad: &Tensor, buf: Option<&Tensor>) -> bool {
    let cpu_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    cpu_f32(var.as_tensor()) && cpu_f32(grad) && buf.is_none_or(cpu_f32)
}

/// One SGD step of `var` with `grad`, updating `buf` (the momentum buffer) in place when
/// momentum is on. `buf` is `None` on the first momentum step; the new buffer is returned.
pub(crate) fn sgd_step(
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

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("fused sgd: {what} is not a contiguous f32 tensor"),
    }
}

fn slice_mut<'a>(
    s: &'a mut CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("fused sgd: {what} is not a contiguous f32 tensor"),
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
        let (g, p) = (slice(g, gl, "gradient")?, slice(p, pl, "parameter")?);
        let b = slice_mut(b, bl, "momentum buffer")?;
        if b.len() != g.len() || p.len() != g.len() {
            candle_core::bail!(
                "fused sgd: buffer, gradient and parameter sizes differ ({}, {}, {})",
                b.len(),
                g.len(),
                p.len()
            )
        }
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
        let (g, b) = (slice(g, gl, "gradient")?, slice(b, bl, "momentum buffer")?);
        let p = slice_mut(p, pl, "parameter")?;
        if b.len() != g.len() || p.len() != g.len() {
            candle_core::bail!(
                "fused sgd: buffer, gradient and parameter sizes differ ({}, {}, {})",
                b.len(),
                g.len(),
                p.len()
            )
        }
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
