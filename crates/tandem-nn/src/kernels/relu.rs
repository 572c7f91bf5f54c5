//! ReLU with a one-pass backward: candle's builds a mask tensor (compare, convert) and
//! multiplies, three full-size passes and two allocations per ReLU; here the gradient is
//! `gy` where the output is positive, in one pass over the output (which the op keeps).
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::with_f32_slice;

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 14;

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "tandem-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("relu: contiguous f32 only")
        };
        let mut y = v[a..b].to_vec();
        y.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|v| *v = v.max(0.0)));
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, gy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let gx = masked_by_positive(&gy.contiguous()?, y)?;
        Ok(Some(Tensor::from_vec(gx, y.shape(), y.device())?))
    }
}

/// `gy` where `y > 0`, else 0.
fn masked_by_positive(gy: &Tensor, y: &Tensor) -> candle_core::Result<Vec<f32>> {
    with_f32_slice(gy, |gy| {
        with_f32_slice(y, |y| {
            let mut gx = gy.to_vec();
            // A select, not a branch: the loop vectorises (a conditional store did not).
            gx.par_chunks_mut(CHUNK).zip(y.par_chunks(CHUNK)).for_each(|(g, y)| {
                g.iter_mut().zip(y).for_each(|(g, &y)| *g = if y > 0.0 { *g } else { 0.0 })
            });
            gx
        })
    })?
}

/// `max(x, 0)` with the kernel above on CPU f32 tensors, candle's `relu` elsewhere.
pub fn relu(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        x.contiguous()?.apply_op1(Relu)
    } else {
        x.relu()
    }
}
