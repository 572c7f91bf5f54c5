//! ReLU with a one-pass backward: candle's builds a mask tensor (compare, convert) and
//! multiplies, three full-size passes and two allocations per ReLU; here the gradient is
//! `gy` where the output is positive, in one pass over the output (which the op keeps).
use std::mem::MaybeUninit;

use crate::kernels::{par_filled, with_f32_slice};
use crate::vectorized_kernel;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "tandem-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = crate::contiguous_f32(s, l, "relu", "input")?;
        Ok((CpuStorage::F32(relu_slice(x)), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, gy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let gx = masked_by_positive(&gy.contiguous()?, y)?;
        Ok(Some(Tensor::from_vec(gx, y.shape(), y.device())?))
    }
}

/// `max(x, 0)`.
fn relu_slice(x: &[f32]) -> Vec<f32> {
    // SAFETY: `relu_chunk` writes every slot of its chunk (a zip with an input of the chunk's
    // length).
    unsafe { par_filled(x.len(), CHUNK, |i, y| relu_chunk(&x[i * CHUNK..][..y.len()], None, y)) }
}

/// `max(a + b, 0)`.
fn add_relu_slices(a: &[f32], b: &[f32]) -> Vec<f32> {
    // SAFETY: `relu_chunk` writes every slot of its chunk (a zip with inputs of the chunk's
    // length).
    unsafe {
        par_filled(a.len(), CHUNK, |i, y| {
            relu_chunk(&a[i * CHUNK..][..y.len()], Some(&b[i * CHUNK..][..y.len()]), y)
        })
    }
}

/// `gy` where `y > 0`, else 0.
fn masked_slice(gy: &[f32], y: &[f32]) -> Vec<f32> {
    // SAFETY: `mask_chunk` writes every slot of its chunk (a zip with inputs of the chunk's
    // length).
    unsafe {
        par_filled(gy.len(), CHUNK, |i, gx| {
            mask_chunk(&gy[i * CHUNK..][..gx.len()], &y[i * CHUNK..][..gx.len()], gx)
        })
    }
}

// The chunk loops are `vectorized_kernel!`s of their own, called from the rayon closures: a
// closure is compiled as a function of its own, without the features of the function it is
// written in (these loops ran at SSE width when they were closures).
vectorized_kernel! {
    /// `max(a (+ b), 0)` into `y`.
    fn relu_chunk(a: &[f32], b: Option<&[f32]>, y: &mut [MaybeUninit<f32>]) {
        match b {
            Some(b) => {
                let sums = a.iter().zip(b);
                y.iter_mut().zip(sums).for_each(|(y, (a, b))| _ = y.write((a + b).max(0.0)))
            }
            None => y.iter_mut().zip(a).for_each(|(y, x)| _ = y.write(x.max(0.0))),
        }
    }
}

vectorized_kernel! {
    /// `gy` where `y > 0`, else 0, into `gx`. A select, not a branch: the loop vectorises (a
    /// conditional store did not).
    fn mask_chunk(gy: &[f32], y: &[f32], gx: &mut [MaybeUninit<f32>]) {
        gx.iter_mut()
            .zip(gy.iter().zip(y))
            .for_each(|(o, (&g, &y))| _ = o.write(if y > 0.0 { g } else { 0.0 }))
    }
}

/// `gy` where `y > 0`, else 0.
pub(crate) fn masked_by_positive(gy: &Tensor, y: &Tensor) -> candle_core::Result<Vec<f32>> {
    with_f32_slice(gy, |gy| with_f32_slice(y, |y| masked_slice(gy, y)))?
}

/// `max(a + b, 0)` in one op: a residual block's sum and activation, one pass forward; backward
/// hands the same masked gradient to both operands (one node in the graph instead of two: the
/// sum's full-size gradient buffer is never made).
struct AddRelu;

impl candle_core::CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "tandem-add-relu"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let a = crate::contiguous_f32(a, al, "add_relu", "left")?;
        let b = crate::contiguous_f32(b, bl, "add_relu", "right")?;
        Ok((CpuStorage::F32(add_relu_slices(a, b)), al.shape().clone()))
    }

    fn bwd(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = Tensor::from_vec(masked_by_positive(&gy.contiguous()?, y)?, y.shape(), y.device())?;
        Ok((Some(g.clone()), Some(g)))
    }
}

/// `relu(a + b)` for same-shaped tensors: one kernel on CPU f32, candle's ops elsewhere.
pub fn add_relu(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if a.shape() != b.shape() {
        candle_core::bail!("add_relu: shapes {:?} and {:?} differ", a.dims(), b.dims())
    }
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle_core::DType::F32;
    if f32_cpu(a) && f32_cpu(b) {
        a.contiguous()?.apply_op2(&b.contiguous()?, AddRelu)
    } else {
        (a + b)?.relu()
    }
}

/// `max(x, 0)` with the kernel above on CPU f32 tensors, candle's `relu` elsewhere.
pub fn relu(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        x.contiguous()?.apply_op1(Relu)
    } else {
        x.relu()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// `add_relu` equals `relu(a + b)` in value and in both operands' gradients (exact zeros
    /// included: the gradient passes only where the sum is positive).
    #[test]
    fn add_relu_equals_candles_sum_and_relu() {
        let dev = Device::Cpu;
        let a = Var::randn(0f32, 1.0, (3, 4, 50, 50), &dev).unwrap();
        let b = Var::randn(0f32, 1.0, (3, 4, 50, 50), &dev).unwrap();
        let r = Tensor::randn(0f32, 1.0, (3, 4, 50, 50), &dev).unwrap();
        let ours = super::add_relu(&a, &b).unwrap();
        let theirs = (a.as_tensor() + b.as_tensor()).unwrap().relu().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&ours), flat(&theirs));
        let go = (ours * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gt = (theirs * &r).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&a, &b] {
            assert_eq!(flat(go.get(v).unwrap()), flat(gt.get(v).unwrap()));
        }
        let c = Tensor::zeros((3, 4), candle_core::DType::F32, &dev).unwrap();
        assert!(super::add_relu(&c, &c.t().unwrap()).is_err(), "shapes must match");
    }
}
