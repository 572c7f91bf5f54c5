//! In-place `torch.optim.SGD` step: each parameter is read and written once (twice with
//! momentum: the buffer, then the weight).
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor, Var};
use rayon::prelude::*;

use super::{aff, operands, par_zip3, zip3};
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
            // First step: buf = d = g + wd * p, a fresh tensor of the gradient's elements only
            // (not `g.copy()`: under a Ddp bucket view that clones the whole bucket).
            None => {
                let d = if h.weight_decay != 0.0 {
                    (&g + p.detach().affine(h.weight_decay, 0.0)?)?
                } else {
                    crate::tensor::fresh_copy(&g)?
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
pub(crate) struct Kernel {
    neg_lr: f32,
    wd: Option<f32>,
    momentum: f32,
    /// `1 - dampening`, or None when dampening is 0 (the tensor form skips that product).
    keep: Option<f32>,
    nesterov: bool,
    use_buf: bool,
}

impl Kernel {
    /// tandem-cuda's constants of this rule.
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn rule(&self) -> tandem_cuda::SgdRule {
        tandem_cuda::SgdRule {
            neg_lr: self.neg_lr,
            wd: self.wd.unwrap_or(0.0),
            momentum: self.momentum,
            keep: self.keep.unwrap_or(1.0),
            has_wd: self.wd.is_some() as i32,
            has_keep: self.keep.is_some() as i32,
            nesterov: self.nesterov as i32,
            use_buf: self.use_buf as i32,
        }
    }

    pub(crate) fn new(h: &SgdConfig) -> Self {
        Kernel {
            neg_lr: -h.lr as f32,
            wd: (h.weight_decay != 0.0).then_some(h.weight_decay as f32),
            momentum: h.momentum as f32,
            keep: (h.dampening != 0.0).then_some((1.0 - h.dampening) as f32),
            nesterov: h.nesterov,
            use_buf: h.momentum != 0.0,
        }
    }
}

// The rules below are chosen once per tensor, outside the element loops: each arm binds its own
// closure (a type of its own), so every loop is compiled for one rule, without a branch per
// element, and vectorises. Decided per element, the rule kept the loops scalar (the bench MLP's
// plain SGD step took 12% of its training step).

/// Runs `$body` with `$f(p, g, b)` bound to the new parameter element: `p - lr * step`, step
/// being `d = g + wd * p` without momentum, the (new) buffer `b` with it, `d + momentum * b`
/// with Nesterov.
macro_rules! with_param_rule {
    ($k:expr, |$f:ident| $body:expr) => {{
        let k: Kernel = $k;
        let (lr, m) = (k.neg_lr, k.momentum);
        match (k.use_buf, k.nesterov, k.wd) {
            (false, _, None) => {
                let $f = move |p: f32, g: f32, _b: f32| p + aff(g, lr);
                $body
            }
            (false, _, Some(wd)) => {
                let $f = move |p: f32, g: f32, _b: f32| p + aff(g + aff(p, wd), lr);
                $body
            }
            (true, false, _) => {
                let $f = move |p: f32, _g: f32, b: f32| p + aff(b, lr);
                $body
            }
            (true, true, None) => {
                let $f = move |p: f32, g: f32, b: f32| p + aff(g + aff(b, m), lr);
                $body
            }
            (true, true, Some(wd)) => {
                let $f = move |p: f32, g: f32, b: f32| p + aff(g + aff(p, wd) + aff(b, m), lr);
                $body
            }
        }
    }};
}

/// Runs `$body` with `$f(b, g, p)` bound to the new momentum buffer element:
/// `momentum * b + (1 - dampening) * d` with `d = g + wd * p`, or `d` itself on the first step.
macro_rules! with_momentum_rule {
    ($k:expr, $first:expr, |$f:ident| $body:expr) => {{
        let k: Kernel = $k;
        let m = k.momentum;
        match ($first, k.wd, k.keep) {
            (true, None, _) => {
                let $f = move |_b: f32, g: f32, _p: f32| g;
                $body
            }
            (true, Some(wd), _) => {
                let $f = move |_b: f32, g: f32, p: f32| g + aff(p, wd);
                $body
            }
            (false, None, None) => {
                let $f = move |b: f32, g: f32, _p: f32| aff(b, m) + g;
                $body
            }
            (false, Some(wd), None) => {
                let $f = move |b: f32, g: f32, p: f32| aff(b, m) + (g + aff(p, wd));
                $body
            }
            (false, None, Some(keep)) => {
                let $f = move |b: f32, g: f32, _p: f32| aff(b, m) + aff(g, keep);
                $body
            }
            (false, Some(wd), Some(keep)) => {
                let $f = move |b: f32, g: f32, p: f32| aff(b, m) + aff(g + aff(p, wd), keep);
                $body
            }
        }
    }};
}

/// [`zip3`] of a row whose gradient (`x`) or other operand (`y`) may be absent: an absent
/// operand reads as zeros (the row-sparse steps' unsampled rows, and the unused buffer of a
/// step without momentum), each case its own loop.
#[inline(always)]
fn zip3_sparse(
    dst: &mut [f32],
    x: Option<&[f32]>,
    y: Option<&[f32]>,
    f: impl Fn(f32, f32, f32) -> f32,
) {
    match (x, y) {
        (Some(x), Some(y)) => zip3(dst, x, y, f),
        (Some(x), None) => dst.iter_mut().zip(x).for_each(|(d, &x)| *d = f(*d, x, 0.0)),
        (None, Some(y)) => dst.iter_mut().zip(y).for_each(|(d, &y)| *d = f(*d, 0.0, y)),
        (None, None) => dst.iter_mut().for_each(|d| *d = f(*d, 0.0, 0.0)),
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
        with_momentum_rule!(k, false, |f| par_zip3(b, g, p, f));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        b: &mut candle_core::CudaStorage,
        bl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        tandem_cuda::optim::sgd_momentum((b, bl), (g, gl), (p, pl), self.0.rule(), false)
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
        with_param_rule!(k, |f| par_zip3(p, g, b, f));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &mut candle_core::CudaStorage,
        pl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<()> {
        let k = self.0;
        let b = k.use_buf.then_some((b, bl));
        tandem_cuda::optim::sgd_param((p, pl), (g, gl), b, k.rule())
    }
}

/// One SGD step of `var` (`[R, C]`) whose gradient is zero but for rows `rows` (ascending,
/// unique), which `grad_rows` (`[rows.len(), C]`) holds: what [`step`] does with that dense
/// gradient, bit for bit, without materialising it (PartialFC's sampled head: a tenth of the
/// rows have a gradient; every row's momentum and weight decay still move, as in torch).
pub(crate) fn step_rows(
    h: &SgdConfig,
    var: &Var,
    rows: &[u32],
    grad_rows: &Tensor,
    buf: Option<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    let p = var.as_tensor();
    let g = grad_rows.detach().contiguous()?;
    let k = Kernel::new(h);
    let map = row_map(p, rows)?;
    let rows: std::sync::Arc<[u32]> = rows.into();
    let buf = if h.momentum == 0.0 {
        None
    } else {
        let (b, first) = match buf {
            Some(b) => (b.contiguous()?, false),
            // First step: buf = d, every row (a fresh tensor, as the dense step's `d.copy()`).
            None => (p.zeros_like()?, true),
        };
        b.inplace_op3(&g, p, &MomentumRows { k, rows: rows.clone(), first, map: map.clone() })?;
        Some(b)
    };
    let b = buf.clone().unwrap_or_else(|| g.clone());
    p.inplace_op3(&g, &b, &ParamRows { k, rows, map })?;
    Ok(buf)
}

/// On a GPU, the row map of `rows` (which gradient row each of `p`'s rows has) that both
/// row-sparse kernels read; nothing on the CPU.
#[cfg(feature = "cuda")]
fn row_map(p: &Tensor, rows: &[u32]) -> candle_core::Result<Option<Tensor>> {
    if !p.device().is_cuda() {
        return Ok(None);
    }
    let n_rows = p.dims().first().copied().unwrap_or(0);
    tandem_cuda::optim::rows_map(rows, n_rows, p.device()).map(Some)
}

#[cfg(not(feature = "cuda"))]
fn row_map(_: &Tensor, _: &[u32]) -> candle_core::Result<Option<Tensor>> {
    Ok(None)
}

/// The row map of a row-sparse op running on a GPU.
#[cfg(feature = "cuda")]
fn device_map(map: &Option<Tensor>) -> candle_core::Result<&Tensor> {
    map.as_ref().ok_or_else(|| {
        candle_core::Error::Msg("row-sparse SGD on a GPU without its row map".into())
    })
}

/// Rows per parallel block of a row-sparse step.
const ROWS_PER_BLOCK: usize = 256;

/// Calls `f(row r of dst, r, gradient of the row or None)` for every row of `dst`
/// (`[n_rows, cols]`) whose gradient rows `rows` (ascending) are stacked in `g`; blocks of rows
/// run in parallel (each row's update is independent of the others).
fn each_row(
    dst: &mut [f32],
    cols: usize,
    rows: &[u32],
    g: &[f32],
    f: impl Fn(&mut [f32], usize, Option<&[f32]>) + Sync,
) {
    if cols == 0 {
        return;
    }
    dst.par_chunks_mut(cols * ROWS_PER_BLOCK).enumerate().for_each(|(block, d)| {
        let r0 = block * ROWS_PER_BLOCK;
        let mut j = rows.partition_point(|&x| (x as usize) < r0);
        for (i, row) in d.chunks_exact_mut(cols).enumerate() {
            let r = r0 + i;
            if rows.get(j).is_some_and(|&x| x as usize == r) {
                f(row, r, Some(&g[j * cols..(j + 1) * cols]));
                j += 1;
            } else {
                f(row, r, None);
            }
        }
    });
}

/// (updated tensor, gradient rows, the other full tensor or empty, row length).
type RowOperands<'a> = (&'a mut [f32], &'a [f32], &'a [f32], usize);

/// The operands of a row-sparse in-place op: the updated tensor, the gradient rows and
/// (optionally) another full tensor, with their sizes checked against `rows`. Returns the row
/// length too.
fn row_operands<'a>(
    dst: (&'a mut CpuStorage, &Layout, &str),
    g: (&'a CpuStorage, &Layout),
    other: Option<(&'a CpuStorage, &Layout, &str)>,
    rows: &[u32],
) -> candle_core::Result<RowOperands<'a>> {
    let (n_rows, cols) = match dst.1.dims() {
        [r, rest @ ..] => (*r, rest.iter().product::<usize>()),
        [] => candle_core::bail!("fused optimizer step: a row-sparse {} has no rows", dst.2),
    };
    let gs = super::slice(g.0, g.1, "gradient rows")?;
    let os = match other {
        Some((s, l, what)) => super::slice(s, l, what)?,
        None => &[],
    };
    let d = super::slice_mut(dst.0, dst.1, dst.2)?;
    let ordered = rows.windows(2).all(|w| w[0] < w[1]);
    if (other.is_some() && d.len() != os.len())
        || gs.len() != rows.len() * cols
        || !ordered
        || rows.last().is_some_and(|&r| r as usize >= n_rows)
    {
        candle_core::bail!(
            "fused optimizer step: {} of {n_rows} rows, {} values of gradient rows for {} \
             listed rows (ascending and below {n_rows}: {ordered})",
            dst.2,
            gs.len(),
            rows.len()
        )
    }
    Ok((d, gs, os, cols))
}

/// buf = momentum * buf + (1 - dampening) * d row by row (d = g + wd * p, g = 0 off the
/// listed rows); on the first step buf = d.
struct MomentumRows {
    k: Kernel,
    rows: std::sync::Arc<[u32]>,
    first: bool,
    /// On a GPU: which gradient row each row has (tandem-cuda's `rows_map`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    map: Option<Tensor>,
}

impl InplaceOp3 for MomentumRows {
    fn name(&self) -> &'static str {
        "tandem-sgd-momentum-rows"
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
        let (k, first) = (self.k, self.first);
        let (b, g, p, cols) = row_operands(
            (b, bl, "momentum buffer"),
            (g, gl),
            Some((p, pl, "parameter")),
            &self.rows,
        )?;
        with_momentum_rule!(k, first, |f| {
            each_row(b, cols, &self.rows, g, |b, r, grad| {
                zip3_sparse(b, grad, Some(&p[r * cols..(r + 1) * cols]), f)
            })
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        b: &mut candle_core::CudaStorage,
        bl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        p: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        let map = device_map(&self.map)?;
        tandem_cuda::optim::sgd_momentum_rows(
            (b, bl),
            (g, gl),
            (p, pl),
            map,
            self.k.rule(),
            self.first,
        )
    }
}

/// p = p - lr * step row by row, as [`ParamUpdate`] with g = 0 off the listed rows.
struct ParamRows {
    k: Kernel,
    rows: std::sync::Arc<[u32]>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    map: Option<Tensor>,
}

impl InplaceOp3 for ParamRows {
    fn name(&self) -> &'static str {
        "tandem-sgd-param-rows"
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
        let k = self.k;
        let other = k.use_buf.then_some((b, bl, "momentum buffer"));
        let (p, g, b, cols) = row_operands((p, pl, "parameter"), (g, gl), other, &self.rows)?;
        with_param_rule!(k, |f| {
            each_row(p, cols, &self.rows, g, |p, r, grad| {
                zip3_sparse(p, grad, k.use_buf.then(|| &b[r * cols..(r + 1) * cols]), f)
            })
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &mut candle_core::CudaStorage,
        pl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<()> {
        let map = device_map(&self.map)?;
        let b = self.k.use_buf.then_some((b, bl));
        tandem_cuda::optim::sgd_param_rows((p, pl), (g, gl), b, map, self.k.rule())
    }
}
