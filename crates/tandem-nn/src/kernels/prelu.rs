//! PReLU (`y = x` where `x > 0`, else `a[c]·x`, one slope per channel) as one custom op on CPU
//! f32 tensors.
//!
//! Why: from candle ops a PReLU is a relu, a subtraction, a broadcast multiply and an add forward
//! (four full-size tensors), and backward candle reduces the slope's gradient over the
//! non-contiguous dimensions (0, 2, 3) of a broadcast — slower than the convolution before it.
//! Here the forward is one pass, and the backward one pass for the input gradient plus one
//! per-channel reduction `ga[c] = Σ gy·x` over `x ≤ 0` (f64 sums in vector lanes), as PyTorch
//! computes it.
use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::{par_filled, with_f32_slice, LaneSums};
use crate::vectorized_kernel;

/// Elements per parallel chunk when there is a single slope.
const CHUNK: usize = 1 << 14;

struct FastPRelu;

/// `(planes' channel count, plane length)` of `x` for `slopes` slopes: one slope covers the
/// whole tensor; otherwise dim 1 holds the channels.
fn planes(dims: &[usize], slopes: usize) -> candle_core::Result<(usize, usize)> {
    let total: usize = dims.iter().product();
    if slopes == 1 {
        return Ok((1, total.max(1)));
    }
    if dims.len() < 2 || dims[1] != slopes {
        candle_core::bail!("PReLU with {slopes} slopes got input of shape {dims:?}")
    }
    Ok((slopes, dims[2..].iter().product::<usize>().max(1)))
}

/// `x` where positive, else `slope·x`, over planes of `hw` values (`c` slopes; one for all
/// when `c == 1`).
fn forward_slices(x: &[f32], a: &[f32], (c, hw): (usize, usize)) -> Vec<f32> {
    let chunk = if c == 1 { CHUNK } else { hw };
    // SAFETY: `prelu_chunk` writes every slot of its chunk (a zip with an input of the
    // chunk's length).
    unsafe {
        par_filled(x.len(), chunk, |plane, y| {
            let slope = if c == 1 { a[0] } else { a[plane % c] };
            prelu_chunk(&x[plane * chunk..][..y.len()], None, slope, y)
        })
    }
}

/// The input gradient: `gy` where `x` is positive, else `slope·gy`.
fn input_grad_slices(x: &[f32], gy: &[f32], slopes: &[f32], (c, hw): (usize, usize)) -> Vec<f32> {
    let chunk = if c == 1 { CHUNK } else { hw };
    // SAFETY: `prelu_chunk` writes every slot of its chunk (a zip with inputs of the chunk's
    // length).
    unsafe {
        par_filled(x.len(), chunk, |plane, gx| {
            let slope = if c == 1 { slopes[0] } else { slopes[plane % c] };
            let (x, gy) = (&x[plane * chunk..][..gx.len()], &gy[plane * chunk..][..gx.len()]);
            prelu_chunk(x, Some(gy), slope, gx)
        })
    }
}

// The chunk loops are a `vectorized_kernel!` of their own, called from the rayon closures: a
// closure is compiled as a function of its own, without the features of the function it is
// written in (these loops ran at SSE width when they were closures).
vectorized_kernel! {
    /// `v · (x > 0 ? 1 : slope)` into `out`, with `v` the gradient `gy` when given (the input
    /// gradient), else `x` itself (the forward). Selects, not branches, so the loops vectorise.
    fn prelu_chunk(x: &[f32], gy: Option<&[f32]>, slope: f32, out: &mut [MaybeUninit<f32>]) {
        match gy {
            Some(gy) => out
                .iter_mut()
                .zip(x.iter().zip(gy))
                .for_each(|(o, (&x, &g))| _ = o.write(g * if x > 0.0 { 1.0 } else { slope })),
            None => out
                .iter_mut()
                .zip(x)
                .for_each(|(y, &v)| _ = y.write(v * if v > 0.0 { 1.0 } else { slope })),
        }
    }
}

/// The slopes' gradient: per slope, Σ x·gy over the values where `x` is not positive.
fn slope_grad_slices(x: &[f32], gy: &[f32], (c, hw): (usize, usize)) -> Vec<f32> {
    (0..c).into_par_iter().map(|ch| slope_grad(x, gy, (c, hw), ch)).collect()
}

vectorized_kernel! {
    /// Slope `ch`'s gradient of [`slope_grad_slices`].
    fn slope_grad(x: &[f32], gy: &[f32], (c, hw): (usize, usize), ch: usize) -> f32 {
        let planes = x.len() / hw;
        let mut s = LaneSums::new();
        for plane in (ch..planes).step_by(c) {
            let xs = &x[plane * hw..(plane + 1) * hw];
            let gs = &gy[plane * hw..(plane + 1) * hw];
            s.add([xs, gs], |[x, g]| [if x <= 0.0 { x * g } else { 0.0 }, 0.0]);
        }
        s.total().0 as f32
    }
}

impl CustomOp2 for FastPRelu {
    fn name(&self) -> &'static str {
        "tandem-prelu"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        a_s: &CpuStorage,
        al: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = crate::contiguous_f32(xs, xl, "prelu", "input")?;
        let a = crate::contiguous_f32(a_s, al, "prelu", "slopes")?;
        let (c, hw) = planes(xl.dims(), a.len())?;
        let y = forward_slices(x, a, (c, hw));
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        a_s: &candle_core::CudaStorage,
        al: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let geometry = planes(xl.dims(), al.shape().elem_count())?;
        let y = tandem_cuda::prelu::forward((xs, xl), (a_s, al), geometry)?;
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let gy = gy.to_dtype(x.dtype())?;
            let geometry = planes(x.dims(), a.elem_count())?;
            let (gx, ga) = tandem_cuda::prelu::backward(x, a, &gy, geometry, x.track_op())?;
            return Ok((gx, a.track_op().then_some(ga)));
        }
        let gy = gy.contiguous()?;
        let slopes = with_f32_slice(a, <[f32]>::to_vec)?;
        let (c, hw) = planes(x.dims(), slopes.len())?;
        let gx = if x.track_op() {
            let v = with_f32_slice(x, |x| {
                with_f32_slice(&gy, |gy| input_grad_slices(x, gy, &slopes, (c, hw)))
            })??;
            Some(Tensor::from_vec(v, x.shape(), x.device())?)
        } else {
            None
        };
        let ga = if a.track_op() {
            let sums = with_f32_slice(x, |x| {
                with_f32_slice(&gy, |gy| slope_grad_slices(x, gy, (c, hw)))
            })??;
            Some(Tensor::from_vec(sums, a.shape(), a.device())?)
        } else {
            None
        };
        Ok((gx, crate::backward::take_param_grad(a, ga)?))
    }
}

/// `prelu(x, a)` with the kernel above on CPU f32 tensors, tandem-cuda's on a GPU (f32, f16 or
/// bf16 input, f32 slopes); elsewhere from candle ops. `a`: `[C]` slopes for `x: [N, C, ...]`,
/// or one slope for any `x`.
pub fn prelu(x: &Tensor, a: &Tensor) -> candle_core::Result<Tensor> {
    use candle_core::DType;
    let f32_slopes = a.dtype() == DType::F32;
    let cpu = x.device().is_cpu() && x.dtype() == DType::F32;
    let cuda = cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if f32_slopes && (cpu || cuda) {
        return x.contiguous()?.apply_op2(&a.contiguous()?, FastPRelu);
    }
    let c = a.elem_count();
    let slope = if c == 1 {
        a.reshape(())?
    } else {
        planes(x.dims(), c)?;
        let mut shape = vec![1; x.rank()];
        shape[1] = c;
        a.reshape(shape)?
    };
    let positive = x.relu()?;
    let negative = (x - &positive)?;
    positive + negative.broadcast_mul(&slope)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The kernel against the same formula from candle ops, values and both gradients, on odd
    /// shapes, one slope and per-channel slopes.
    #[test]
    fn kernel_equals_the_candle_formula_with_both_gradients() {
        let dev = Device::Cpu;
        for (shape, slopes) in [(vec![3, 5, 7, 9], 5), (vec![1, 4, 1, 1], 4), (vec![2, 3, 11], 1)] {
            let n: usize = shape.iter().product();
            // No exact zeros: there candle's relu and PyTorch's PReLU differ (below).
            let xv: Vec<f32> = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.5) / 7.0).collect();
            let av: Vec<f32> = (0..slopes).map(|i| 0.1 + 0.2 * i as f32).collect();
            let x = Var::from_vec(xv, shape.clone(), &dev).unwrap();
            let a = Var::from_vec(av, slopes, &dev).unwrap();
            let r = Tensor::rand(-1f32, 1.0, shape.clone(), &dev).unwrap();
            let ours = prelu(x.as_tensor(), a.as_tensor()).unwrap();
            let slope = if slopes == 1 {
                a.as_tensor().reshape(()).unwrap()
            } else {
                let mut s = vec![1; shape.len()];
                s[1] = slopes;
                a.as_tensor().reshape(s).unwrap()
            };
            let pos = x.as_tensor().relu().unwrap();
            let neg = (x.as_tensor() - &pos).unwrap();
            let theirs = (pos + neg.broadcast_mul(&slope).unwrap()).unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&ours), flat(&theirs), "{shape:?}");
            let g1 = (&ours * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (&theirs * &r).unwrap().sum_all().unwrap().backward().unwrap();
            for (v, what) in [(&x, "input"), (&a, "slope")] {
                let (p, q) = (flat(g1.get(v).unwrap()), flat(g2.get(v).unwrap()));
                let worst = p.iter().zip(&q).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-5, "{what} gradient off by {worst} for {shape:?}");
            }
        }
        // At x = 0 the input gradient is the slope, as PyTorch's `x > 0 ? 1 : a`.
        let x = Var::from_vec(vec![0f32, -1.0], (1, 1, 2), &dev).unwrap();
        let a = Var::from_vec(vec![0.25f32], 1, &dev).unwrap();
        let g = prelu(x.as_tensor(), a.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g.get(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(gx, [0.25, 0.25]);
        let x = Tensor::zeros((2, 3, 4), candle_core::DType::F32, &dev).unwrap();
        let a = Tensor::ones(2, candle_core::DType::F32, &dev).unwrap();
        assert!(prelu(&x, &a).unwrap_err().to_string().contains("2 slopes"));
    }
}
