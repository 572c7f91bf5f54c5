//! `relu6(x)`: `F.relu6` (`hardtanh(x, 0, 6)`) as one op on CPU f32, with its backward.
//!
//! candle's `clamp` is a `maximum` then a `minimum` against broadcast scalars: two passes
//! forward, and in backward two comparisons, two selects and the sums of their gradients. Here
//! each direction is one pass: the gradient passes where `0 < x < 6`, as PyTorch's hardtanh
//! backward lets it. Other dtypes and devices take `clamp`.
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::contiguous_f32;
use crate::kernels::with_f32_slice;

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
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(y, x)| {
            y.iter_mut().zip(x).for_each(|(y, x)| *y = x.clamp(0.0, 6.0));
        });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = g.contiguous()?;
        let gx = with_f32_slice(x, |x| {
            with_f32_slice(&g, |g| {
                let mut gx = vec![0f32; x.len()];
                gx.par_chunks_mut(CHUNK)
                    .zip(x.par_chunks(CHUNK).zip(g.par_chunks(CHUNK)))
                    .for_each(|(gx, (x, g))| {
                        for ((o, x), g) in gx.iter_mut().zip(x).zip(g) {
                            *o = if *x > 0.0 && *x < 6.0 { *g } else { 0.0 };
                        }
                    });
                gx
            })
        })??;
        Ok(Some(Tensor::from_vec(gx, x.shape(), x.device())?))
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
