//! Grouped convolution (`groups > 1`, depthwise included) as one custom op, forward and both
//! gradients: on CPU f32 tensors by direct loops over each output plane (on a zero-padded copy
//! of each input plane, so every tap covers whole rows); on a GPU through cuDNN with the group
//! count (`cuda` builds).
//!
//! Why: candle runs a grouped convolution as one convolution per group and a concatenation, so
//! MobileFaceNet's depthwise layers (128–512 groups of one channel each) become hundreds of tiny
//! im2col + GEMM calls forward and as many transposed convolutions backward. A group holds few
//! channels, so the direct form (each output plane a sum of shifted input rows scaled by one
//! weight) does the same arithmetic without the copies, and each plane is written by one task in
//! a fixed order: the same bits on any thread count.
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::backward::take_param_grad;
use crate::contiguous_f32;
use crate::kernels::with_f32_slice;

/// Stride, padding, dilation (the same on both axes, as candle's `Conv2dConfig`) and groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedConvParams {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// Shapes of one grouped convolution: input `[n, c, h, w]`, weight `[o, c / groups, kh, kw]`.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    /// Input and output channels per group.
    cpg: usize,
    opg: usize,
    p: GroupedConvParams,
}

impl Geometry {
    fn new(x: &[usize], k: &[usize], p: GroupedConvParams) -> candle_core::Result<Geometry> {
        let (&[n, c, h, w], &[o, cpg, kh, kw]) = (x, k) else {
            candle_core::bail!("grouped conv2d: input {x:?} and weight {k:?} must both be 4-d")
        };
        let g = p.groups;
        if g == 0 || !c.is_multiple_of(g) || !o.is_multiple_of(g) || cpg * g != c {
            candle_core::bail!(
                "grouped conv2d: {c} input and {o} output channels do not split into {g} groups \
                 of weight {k:?}"
            )
        }
        if p.stride == 0 || p.dilation == 0 || kh == 0 || kw == 0 {
            candle_core::bail!("grouped conv2d: stride, dilation and kernel must be at least 1")
        }
        let out = |len: usize, k: usize| {
            let span = p.dilation * (k - 1) + 1;
            (len + 2 * p.padding).checked_sub(span).map(|r| r / p.stride + 1)
        };
        let (Some(oh), Some(ow)) = (out(h, kh), out(w, kw)) else {
            candle_core::bail!("grouped conv2d: kernel {kh}x{kw} is larger than the padded {h}x{w}")
        };
        Ok(Geometry { n, c, h, w, o, kh, kw, oh, ow, cpg, opg: o / g, p })
    }

    fn out_shape(&self) -> Shape {
        Shape::from((self.n, self.o, self.oh, self.ow))
    }

    /// The padded plane's side lengths.
    fn padded(&self) -> (usize, usize) {
        (self.h + 2 * self.p.padding, self.w + 2 * self.p.padding)
    }
}

/// `src` (`h` x `w`) into the middle of `dst` (`h + 2p` x `w + 2p`, zero borders).
fn pad_into(g: &Geometry, src: &[f32], dst: &mut [f32]) {
    let (pad, pw) = (g.p.padding, g.padded().1);
    for (y, row) in src.chunks_exact(g.w).enumerate() {
        dst[(y + pad) * pw + pad..][..g.w].copy_from_slice(row);
    }
}

/// `out[ox] += a * src[ox * s]` for every `ox` of `out` (`src` long enough).
#[inline(always)]
fn axpy_strided(out: &mut [f32], a: f32, src: &[f32], s: usize) {
    if s == 1 {
        out.iter_mut().zip(src).for_each(|(o, &v)| *o += a * v);
    } else {
        out.iter_mut().zip(src.iter().step_by(s)).for_each(|(o, &v)| *o += a * v);
    }
}

/// `y[b, co] = Σ_{ci, ky, kx} w[co, ci, ky, kx] · shift(x[b, group·cpg + ci])`, over a zero-padded
/// copy of each input plane so every tap covers whole output rows (no bounds in the loops).
fn forward(g: &Geometry, x: &[f32], k: &[f32]) -> Vec<f32> {
    let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
    let (ph, pw) = g.padded();
    let mut y = vec![0f32; g.n * g.o * out_plane];
    let (s, d) = (g.p.stride, g.p.dilation);
    y.par_chunks_mut(out_plane).enumerate().for_each_init(
        || vec![0f32; ph * pw],
        |xp, (idx, yp)| {
            let (b, co) = (idx / g.o, idx % g.o);
            let group = co / g.opg;
            for ci in 0..g.cpg {
                pad_into(g, &x[(b * g.c + group * g.cpg + ci) * plane..][..plane], xp);
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        let wv = k[((co * g.cpg + ci) * g.kh + ky) * g.kw + kx];
                        for (oy, yr) in yp.chunks_exact_mut(g.ow).enumerate() {
                            let row = &xp[(oy * s + ky * d) * pw + kx * d..];
                            axpy_strided(yr, wv, row, s);
                        }
                    }
                }
            }
        },
    );
    y
}

/// `gx[b, c] = Σ_{co in c's group, ky, kx} w[co, ci, ky, kx] · unshift(gy[b, co])`, scattered into a
/// zero-padded plane whose middle is the gradient.
fn input_grad(g: &Geometry, k: &[f32], gy: &[f32]) -> Vec<f32> {
    let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
    let (ph, pw) = g.padded();
    let pad = g.p.padding;
    let mut gx = vec![0f32; g.n * g.c * plane];
    let (s, d) = (g.p.stride, g.p.dilation);
    gx.par_chunks_mut(plane).enumerate().for_each_init(
        || vec![0f32; ph * pw],
        |gp, (idx, gxp)| {
            gp.fill(0.0);
            let (b, c) = (idx / g.c, idx % g.c);
            let (group, ci) = (c / g.cpg, c % g.cpg);
            for co in group * g.opg..(group + 1) * g.opg {
                let gyp = &gy[(b * g.o + co) * out_plane..][..out_plane];
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        let wv = k[((co * g.cpg + ci) * g.kh + ky) * g.kw + kx];
                        for (oy, gyr) in gyp.chunks_exact(g.ow).enumerate() {
                            let at = (oy * s + ky * d) * pw + kx * d;
                            if s == 1 {
                                gp[at..at + g.ow]
                                    .iter_mut()
                                    .zip(gyr)
                                    .for_each(|(o, &v)| *o += wv * v);
                            } else {
                                for (ox, &v) in gyr.iter().enumerate() {
                                    gp[at + ox * s] += wv * v;
                                }
                            }
                        }
                    }
                }
            }
            for (y, row) in gxp.chunks_exact_mut(g.w).enumerate() {
                row.copy_from_slice(&gp[(y + pad) * pw + pad..][..g.w]);
            }
        },
    );
    gx
}

/// `gw[co, ci, ky, kx] = Σ_{b, oy, ox} gy[b, co, oy, ox] · x[b, group·cpg + ci, shifted]`: per
/// image, each tap's products accumulate in f32 lanes along the output row (so the loop
/// vectorises), then each lane's sum joins the tap's f64 total, image after image, in a fixed
/// order (one task per output channel).
fn weight_grad(g: &Geometry, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
    let (ph, pw) = g.padded();
    let taps = g.cpg * g.kh * g.kw;
    let mut gw = vec![0f32; g.o * taps];
    let (s, d) = (g.p.stride, g.p.dilation);
    gw.par_chunks_mut(taps).enumerate().for_each_init(
        || (vec![0f32; ph * pw], vec![0f32; g.ow]),
        |(xp, lanes), (co, gwc)| {
            let group = co / g.opg;
            let mut acc = vec![0f64; taps];
            for b in 0..g.n {
                let gyp = &gy[(b * g.o + co) * out_plane..][..out_plane];
                for ci in 0..g.cpg {
                    pad_into(g, &x[(b * g.c + group * g.cpg + ci) * plane..][..plane], xp);
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            lanes.fill(0.0);
                            for (oy, gyr) in gyp.chunks_exact(g.ow).enumerate() {
                                let row = &xp[(oy * s + ky * d) * pw + kx * d..];
                                if s == 1 {
                                    lanes
                                        .iter_mut()
                                        .zip(gyr.iter().zip(row))
                                        .for_each(|(l, (&a, &v))| *l += a * v);
                                } else {
                                    lanes
                                        .iter_mut()
                                        .zip(gyr.iter().zip(row.iter().step_by(s)))
                                        .for_each(|(l, (&a, &v))| *l += a * v);
                                }
                            }
                            let sum: f64 = lanes.iter().map(|&l| f64::from(l)).sum();
                            acc[(ci * g.kh + ky) * g.kw + kx] += sum;
                        }
                    }
                }
            }
            gwc.iter_mut().zip(&acc).for_each(|(w, &a)| *w = a as f32);
        },
    );
    gw
}

struct GroupedConvOp(GroupedConvParams);

impl CustomOp2 for GroupedConvOp {
    fn name(&self) -> &'static str {
        "tandem-grouped-conv2d"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let g = Geometry::new(xl.dims(), kl.dims(), self.0)?;
        let x = contiguous_f32(xs, xl, "grouped conv2d", "input")?;
        let k = contiguous_f32(ks, kl, "grouped conv2d", "weight")?;
        Ok((CpuStorage::F32(forward(&g, x, k)), g.out_shape()))
    }

    /// On a GPU: cuDNN with the group count, one call for every group (candle's grouped
    /// convolution is one convolution per group).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        tandem_cuda::cudnn::forward((xs, xl), (ks, kl), cudnn_spec(self.0))
    }

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::kernels::conv2d::cuda_backward(cudnn_spec(self.0), x, k, gy);
        }
        let g = Geometry::new(x.dims(), k.dims(), self.0)?;
        let gy = gy.contiguous()?;
        let gk = if k.track_op() {
            let v = with_f32_slice(x, |x| with_f32_slice(&gy, |gy| weight_grad(&g, x, gy)))??;
            Some(Tensor::from_vec(v, k.shape(), k.device())?)
        } else {
            None
        };
        let gx = if x.track_op() {
            let v = with_f32_slice(k, |k| with_f32_slice(&gy, |gy| input_grad(&g, k, gy)))??;
            Some(Tensor::from_vec(v, x.shape(), x.device())?)
        } else {
            None
        };
        Ok((gx, take_param_grad(k, gk)?))
    }
}

/// cuDNN's description of the grouped convolution.
#[cfg(feature = "cuda")]
fn cudnn_spec(p: GroupedConvParams) -> tandem_cuda::cudnn::ConvSpec {
    tandem_cuda::cudnn::ConvSpec {
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
        groups: p.groups,
    }
}

/// `torch.nn.functional.conv2d(x, w, stride, padding, dilation, groups)` without bias: this
/// module's op on CPU f32 tensors and through cuDNN on a GPU (as the ungrouped convolution),
/// candle's (one convolution per group) elsewhere.
pub fn grouped_conv2d(x: &Tensor, w: &Tensor, p: GroupedConvParams) -> candle_core::Result<Tensor> {
    let cpu_f32 = x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && w.dtype() == candle_core::DType::F32;
    if cpu_f32 || crate::kernels::conv2d::takes_cudnn(x, w) {
        x.contiguous()?.apply_op2(&w.contiguous()?, GroupedConvOp(p))
    } else {
        x.conv2d(w, p.padding, p.stride, p.dilation, p.groups)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    }

    /// Against candle's grouped convolution (per-group convolutions) and its gradients, over
    /// MobileFaceNet's shapes: depthwise 3x3 strides 1 and 2, two channels per group, the GDC's
    /// 7x7 without padding, and dilation.
    #[test]
    fn matches_candles_grouped_convolution_and_gradients() {
        let cases = [
            // (n, c, h, o, k, stride, padding, dilation, groups)
            (2, 8, 9, 8, 3, 1, 1, 1, 8),
            (2, 8, 9, 8, 3, 2, 1, 1, 8),
            (1, 8, 7, 8, 3, 1, 1, 1, 4),
            (3, 6, 7, 6, 7, 1, 0, 1, 6),
            (2, 4, 10, 8, 3, 2, 2, 2, 2),
        ];
        for (i, &(n, c, h, o, k, stride, padding, dilation, groups)) in cases.iter().enumerate() {
            let p = GroupedConvParams { stride, padding, dilation, groups };
            let x = Var::from_tensor(&rand(&[n, c, h, h], i as u64)).unwrap();
            let w = Var::from_tensor(&rand(&[o, c / groups, k, k], 100 + i as u64)).unwrap();
            let ours = grouped_conv2d(&x, &w, p).unwrap();
            let theirs = x.conv2d(&w, padding, stride, dilation, groups).unwrap();
            assert_eq!(ours.dims(), theirs.dims(), "case {i}");
            assert!(max_diff(&ours, &theirs) < 1e-5, "case {i}: forward");
            let probe = rand(ours.dims(), 200 + i as u64);
            let g1 = (ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            for (what, v) in [("input", x.as_tensor()), ("weight", w.as_tensor())] {
                let (a, b) = (g1.get(v).unwrap(), g2.get(v).unwrap());
                assert!(max_diff(a, b) < 1e-5, "case {i}: {what} gradient");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let p = GroupedConvParams { stride: 1, padding: 0, dilation: 1, groups: 3 };
        let e = grouped_conv2d(&rand(&[1, 4, 5, 5], 0), &rand(&[4, 1, 3, 3], 1), p).unwrap_err();
        assert!(e.to_string().contains("groups"), "{e}");
        let p = GroupedConvParams { groups: 4, ..p };
        let e = grouped_conv2d(&rand(&[1, 4, 2, 2], 0), &rand(&[4, 1, 3, 3], 1), p).unwrap_err();
        assert!(e.to_string().contains("larger"), "{e}");
    }
}
