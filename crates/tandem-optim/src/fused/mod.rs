//! In-place optimizer updates for f32 parameters on the CPU.
//!
//! The tensor-op form of the `torch.optim` rules (`sgd.rs`, `adam.rs`) allocates a new tensor
//! per expression and then copies the result into the parameter: about six passes over every
//! weight per SGD step and fifteen per Adam step, which on the bench MLP cost as much as the
//! backward's weight-gradient accumulation. Here each state tensor is updated in place through
//! candle's `InplaceOp3`, one pass each. Every element is computed with the same f32 operations
//! in the same order as the tensor form — `affine(x, m, a)` is `x * m + a` with `m` and `a`
//! rounded to f32, as candle computes it — so results are bit-identical (tests in `sgd.rs` and
//! `adam.rs` check that); other dtypes and devices use the tensor form.
use candle_core::{CpuStorage, DType, Layout, Tensor, Var};
use rayon::prelude::*;

pub(crate) mod adam;
#[cfg(test)]
mod host_rules;
pub(crate) mod sgd;

/// candle's `affine(mul, 0)` on one f32.
#[inline(always)]
pub(super) fn aff(x: f32, mul: f32) -> f32 {
    x * mul + 0.0
}

/// Whether the fused path applies: f32 parameter, gradient and state, all on the CPU, or all
/// on one GPU in a `cuda` build (tandem-cuda's twins of these kernels).
pub(crate) fn applies<'a>(
    var: &Var,
    grad: &Tensor,
    state: impl IntoIterator<Item = &'a Tensor>,
) -> bool {
    let p = var.as_tensor();
    let on_cuda = cfg!(feature = "cuda") && p.device().is_cuda();
    if !(p.device().is_cpu() || on_cuda) {
        return false;
    }
    let here = |t: &Tensor| t.device().same_device(p.device()) && t.dtype() == DType::F32;
    here(p) && here(grad) && state.into_iter().all(here)
}

pub(super) fn slice<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("fused optimizer step: {what} is not a contiguous f32 tensor"),
    }
}

pub(super) fn slice_mut<'a>(
    s: &'a mut CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("fused optimizer step: {what} is not a contiguous f32 tensor"),
    }
}

/// The three operands of an in-place op, as equal-length f32 slices.
pub(super) fn operands<'a>(
    dst: (&'a mut CpuStorage, &Layout, &str),
    a: (&'a CpuStorage, &Layout, &str),
    b: (&'a CpuStorage, &Layout, &str),
) -> candle_core::Result<(&'a mut [f32], &'a [f32], &'a [f32])> {
    let (x, y) = (slice(a.0, a.1, a.2)?, slice(b.0, b.1, b.2)?);
    let d = slice_mut(dst.0, dst.1, dst.2)?;
    if d.len() != x.len() || y.len() != x.len() {
        candle_core::bail!(
            "fused optimizer step: {} ({}), {} ({}) and {} ({}) differ in size",
            dst.2,
            d.len(),
            a.2,
            x.len(),
            b.2,
            y.len()
        )
    }
    Ok((d, x, y))
}

/// Elements per parallel chunk of the elementwise updates (each element's update is
/// independent, so the result does not depend on the thread count).
const CHUNK: usize = 1 << 15;

/// `dst[i] = f(dst[i], x[i], y[i])` over equal-length slices.
#[inline(always)]
pub(super) fn zip3(dst: &mut [f32], x: &[f32], y: &[f32], f: impl Fn(f32, f32, f32) -> f32) {
    for ((d, &x), &y) in dst.iter_mut().zip(x).zip(y) {
        *d = f(*d, x, y);
    }
}

/// `dst = f(dst, x, y)` elementwise in parallel chunks (each element's update is independent,
/// so the result does not depend on the thread count).
pub(super) fn par_zip3(
    dst: &mut [f32],
    x: &[f32],
    y: &[f32],
    f: impl Fn(f32, f32, f32) -> f32 + Sync,
) {
    dst.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .zip(y.par_chunks(CHUNK))
        .for_each(|((d, x), y)| zip3(d, x, y, &f));
}
