//! Grouped convolution (`groups > 1`, depthwise included) on CPU f32 tensors as one custom op,
//! forward and both gradients, by direct loops over each output plane.
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
        if p.stride == 0 || p.dilation == 0 {
            candle_core::bail!("grouped conv2d: stride and dilation must be at least 1")
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

    /// The output positions `o0..o1` whose tap `k` lands inside `0..len` of the input, for an
    /// axis of `out` positions: input index `o·stride + k·dilation − padding`.
    fn valid(&self, k: usize, len: usize, out: usize) -> (usize, usize) {
        let (s, off) = (self.p.stride, k * self.p.dilation);
        let pad = self.p.padding;
        // first o with o·s + off >= pad
        let lo = if off >= pad { 0 } else { (pad - off).div_ceil(s) };
        // last o with o·s + off − pad < len
        let hi = if off >= len + pad { 0 } else { (len + pad - off - 1) / s + 1 };
        (lo.min(out), hi.min(out).max(lo.min(out)))
    }
}

/// `y[b, co] = Σ_{ci, ky, kx} w[co, ci, ky, kx] · shift(x[b, group·cpg + ci])`.
fn forward(g: &Geometry, x: &[f32], k: &[f32]) -> Vec<f32> {
    let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
    let mut y = vec![0f32; g.n * g.o * out_plane];
    let (s, d, pad) = (g.p.stride, g.p.dilation, g.p.padding);
    y.par_chunks_mut(out_plane).enumerate().for_each(|(idx, yp)| {
        let (b, co) = (idx / g.o, idx % g.o);
        let group = co / g.opg;
        for ci in 0..g.cpg {
            let xp = &x[(b * g.c + group * g.cpg + ci) * plane..][..plane];
            for ky in 0..g.kh {
                let (oy0, oy1) = g.valid(ky, g.h, g.oh);
                for kx in 0..g.kw {
                    let wv = k[((co * g.cpg + ci) * g.kh + ky) * g.kw + kx];
                    let (ox0, ox1) = g.valid(kx, g.w, g.ow);
                    for oy in oy0..oy1 {
                        let row = &xp[(oy * s + ky * d - pad) * g.w..][..g.w];
                        let yr = &mut yp[oy * g.ow..][..g.ow];
                        if s == 1 {
                            let start = ox0 + kx * d - pad;
                            yr[ox0..ox1]
                                .iter_mut()
                                .zip(&row[start..start + (ox1 - ox0)])
                                .for_each(|(y, &v)| *y += wv * v);
                        } else {
                            for ox in ox0..ox1 {
                                yr[ox] += wv * row[ox * s + kx * d - pad];
                            }
                        }
                    }
                }
            }
        }
    });
    y
}

/// `gx[b, c] = Σ_{co in c's group, ky, kx} w[co, ci, ky, kx] · unshift(gy[b, co])`.
fn input_grad(g: &Geometry, k: &[f32], gy: &[f32]) -> Vec<f32> {
    let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
    let mut gx = vec![0f32; g.n * g.c * plane];
    let (s, d, pad) = (g.p.stride, g.p.dilation, g.p.padding);
    gx.par_chunks_mut(plane).enumerate().for_each(|(idx, gxp)| {
        let (b, c) = (idx / g.c, idx % g.c);
        let (group, ci) = (c / g.cpg, c % g.cpg);
        for co in group * g.opg..(group + 1) * g.opg {
            let gyp = &gy[(b * g.o + co) * out_plane..][..out_plane];
            for ky in 0..g.kh {
                let (oy0, oy1) = g.valid(ky, g.h, g.oh);
                for kx in 0..g.kw {
                    let wv = k[((co * g.cpg + ci) * g.kh + ky) * g.kw + kx];
                    let (ox0, ox1) = g.valid(kx, g.w, g.ow);
                    for oy in oy0..oy1 {
                        let gr = &mut gxp[(oy * s + ky * d - pad) * g.w..][..g.w];
                        let gyr = &gyp[oy * g.ow..][..g.ow];
                        if s == 1 {
                            let start = ox0 + kx * d - pad;
                            gr[start..start + (ox1 - ox0)]
                                .iter_mut()
                                .zip(&gyr[ox0..ox1])
                                .for_each(|(gx, &v)| *gx += wv * v);
                        } else {
                            for ox in ox0..ox1 {
                                gr[ox * s + kx * d - pad] += wv * gyr[ox];
                            }
                        }
                    }
                }
            }
        }
    });
    gx
}

/// `gw[co, ci, ky, kx] = Σ_{b, oy, ox} gy[b, co, oy, ox] · x[b, group·cpg + ci, shifted]`,
/// each output row's products summed in f32 and the rows and batch in f64 (one task per output
/// channel).
fn weight_grad(g: &Geometry, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
    let taps = g.cpg * g.kh * g.kw;
    let mut gw = vec![0f32; g.o * taps];
    let (s, d, pad) = (g.p.stride, g.p.dilation, g.p.padding);
    gw.par_chunks_mut(taps).enumerate().for_each(|(co, gwc)| {
        let group = co / g.opg;
        let mut acc = vec![0f64; taps];
        for b in 0..g.n {
            let gyp = &gy[(b * g.o + co) * out_plane..][..out_plane];
            for ci in 0..g.cpg {
                let xp = &x[(b * g.c + group * g.cpg + ci) * plane..][..plane];
                for ky in 0..g.kh {
                    let (oy0, oy1) = g.valid(ky, g.h, g.oh);
                    for kx in 0..g.kw {
                        let (ox0, ox1) = g.valid(kx, g.w, g.ow);
                        // Each row's products in f32, the rows in f64.
                        let mut sum = 0f64;
                        for oy in oy0..oy1 {
                            let row = &xp[(oy * s + ky * d - pad) * g.w..][..g.w];
                            let gyr = &gyp[oy * g.ow..][..g.ow];
                            let line: f32 = if s == 1 {
                                let start = ox0 + kx * d - pad;
                                gyr[ox0..ox1]
                                    .iter()
                                    .zip(&row[start..start + (ox1 - ox0)])
                                    .map(|(&a, &v)| a * v)
                                    .sum()
                            } else {
                                (ox0..ox1).map(|ox| gyr[ox] * row[ox * s + kx * d - pad]).sum()
                            };
                            sum += f64::from(line);
                        }
                        acc[(ci * g.kh + ky) * g.kw + kx] += sum;
                    }
                }
            }
        }
        gwc.iter_mut().zip(&acc).for_each(|(w, &a)| *w = a as f32);
    });
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

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
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

/// `torch.nn.functional.conv2d(x, w, stride, padding, dilation, groups)` without bias: this
/// module's op on CPU f32 tensors, candle's (one convolution per group) elsewhere.
pub fn grouped_conv2d(x: &Tensor, w: &Tensor, p: GroupedConvParams) -> candle_core::Result<Tensor> {
    let cpu_f32 = x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && w.dtype() == candle_core::DType::F32;
    if cpu_f32 {
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
