//! `relu6(x)`: `F.relu6` (`hardtanh(x, 0, 6)`) as one op on CPU f32, with its backward.
//!
//! candle's `clamp` is a `maximum` then a `minimum` against broadcast scalars: two passes
//! forward, and in backward two comparisons, two selects and the sums of their gradients. Here
//! each direction is one pass: the gradient passes where `0 < x < 6`, as PyTorch's hardtanh
//! backward lets it. Other dtypes and devices take `clamp`.
use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use crate::contiguous_f32;
use crate::kernels::{par_filled, with_f32_slice};
use crate::vectorized_kernel;

/// `min(max(x, 0), 6)`.
pub fn relu6(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        x.contiguous()?.apply_op1(Relu6)
    } else {
        x.clamp(0f32, 6f32)
    }
}

struct Relu6;

/// Values per parallel chunk.
const CHUNK: usize = 1 << 16;

impl CustomOp1 for Relu6 {
    fn name(&self) -> &'static str {
        "tandem-relu6"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "relu6", "input")?;
        Ok((CpuStorage::F32(clamped(x)), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = g.contiguous()?;
        let gx = with_f32_slice(x, |x| with_f32_slice(&g, |g| passed(x, g)))??;
        Ok(Some(Tensor::from_vec(gx, x.shape(), x.device())?))
    }
}

/// `clamp(x, 0, 6)`.
fn clamped(x: &[f32]) -> Vec<f32> {
    // SAFETY: `clamp_chunk` writes every slot of its chunk (a zip with an input of the chunk's
    // length).
    unsafe { par_filled(x.len(), CHUNK, |i, y| clamp_chunk(&x[i * CHUNK..][..y.len()], y)) }
}

/// `clamp(x, 0, 6)` in place (a fused op's epilogue: `fused_linear_relu6`).
pub(super) fn clamp_in_place(x: &mut [f32]) {
    use rayon::prelude::*;
    x.par_chunks_mut(CHUNK).for_each(clamp_chunk_in_place);
}

/// `g` where `0 < x < 6`, else 0.
pub(super) fn passed(x: &[f32], g: &[f32]) -> Vec<f32> {
    // SAFETY: `pass_chunk` writes every slot of its chunk (a zip with inputs of its length).
    unsafe {
        par_filled(x.len(), CHUNK, |i, out| {
            pass_chunk(&x[i * CHUNK..][..out.len()], &g[i * CHUNK..][..out.len()], out)
        })
    }
}

// The chunk loops are kernels of their own: a closure does not get the features of the
// function it is written in.
vectorized_kernel! {
    fn clamp_chunk(x: &[f32], y: &mut [MaybeUninit<f32>]) {
        y.iter_mut().zip(x).for_each(|(y, x)| _ = y.write(x.clamp(0.0, 6.0)));
    }
}

vectorized_kernel! {
    fn clamp_chunk_in_place(x: &mut [f32]) {
        x.iter_mut().for_each(|x| *x = x.clamp(0.0, 6.0));
    }
}

vectorized_kernel! {
    fn pass_chunk(x: &[f32], g: &[f32], out: &mut [MaybeUninit<f32>]) {
        for (o, (x, g)) in out.iter_mut().zip(x.iter().zip(g)) {
            _ = o.write(if *x > 0.0 && *x < 6.0 { *g } else { 0.0 });
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::relu6;

    /// Values and gradient equal `clamp(0, 6)`'s away from the corners; at exactly 0 and 6 the
    /// gradient is 0, as PyTorch's.
    #[test]
    fn matches_clamp_and_torch_s_corners() {
        let dev = Device::Cpu;
        let mut v: Vec<f32> = (0..1000).map(|i| (i as f32 - 300.0) * 0.0171).collect();
        v.extend([0.0, 6.0, -0.0]);
        let x = Var::from_tensor(&Tensor::from_vec(v.clone(), v.len(), &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, v.len(), &dev).unwrap();
        let y = relu6(&x).unwrap();
        let want: Vec<f32> = v.iter().map(|x| x.clamp(0.0, 6.0)).collect();
        assert_eq!(y.to_vec1::<f32>().unwrap(), want);
        let g = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let g = g.get(&x).unwrap().to_vec1::<f32>().unwrap();
        let p = probe.to_vec1::<f32>().unwrap();
        for (i, x) in v.iter().enumerate() {
            let want = if *x > 0.0 && *x < 6.0 { p[i] } else { 0.0 };
            assert_eq!(g[i], want, "x = {x}");
        }
    }
}
