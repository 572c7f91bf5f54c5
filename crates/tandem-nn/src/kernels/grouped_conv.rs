//! Grouped convolution (`groups > 1`, depthwise included) as one custom op, forward and both
//! gradients: on CPU f32 tensors by direct loops over each output plane (on a zero-padded copy
//! of each input plane split into its stride phases, so every tap is one contiguous run over
//! the whole plane: long vector loops even on MobileFaceNet's 7x7 and stride-2 planes); on a
//! GPU through cuDNN with the group count (`cuda` builds).
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
use crate::kernels::simd::lane_sum2;
use crate::kernels::with_f32_slice;
use crate::vectorized_kernel;

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

/// The zero-padded input plane split into its `stride²` phases, as the taps read it: phase
/// `(py, px)` holds the padded plane's rows `py, py + s, …` and columns `px, px + s, …`
/// (`rows x cols`, zeros past the edge), so the tap `(ky, kx)` of every output reads one phase
/// at one offset — a contiguous run over the whole output in the phases' width, whatever the
/// stride. One spare row of zeros lets the last run read past its last row (those lanes only
/// fill the columns past the output's width, which are dropped).
#[derive(Clone, Copy)]
struct Phases {
    s: usize,
    rows: usize,
    cols: usize,
}

impl Phases {
    fn of(g: &Geometry) -> Phases {
        let (ph, pw) = g.padded();
        let s = g.p.stride;
        Phases { s, rows: ph.div_ceil(s), cols: pw.div_ceil(s) }
    }

    /// Floats of one phase (its spare row included), and of all of them.
    fn len(&self) -> usize {
        (self.rows + 1) * self.cols
    }

    fn total(&self) -> usize {
        self.s * self.s * self.len()
    }

    /// The phase and the offset in it where tap `(ky, kx)` of output `(0, 0)` reads.
    #[inline(always)]
    fn tap(&self, g: &Geometry, ky: usize, kx: usize) -> (usize, usize) {
        let (dy, dx) = (ky * g.p.dilation, kx * g.p.dilation);
        let phase = (dy % self.s) * self.s + dx % self.s;
        (phase * self.len(), (dy / self.s) * self.cols + dx / self.s)
    }

    /// `plane` (`h x w`) padded and split into `out` (every slot written).
    #[inline(always)]
    fn fill(&self, g: &Geometry, plane: &[f32], out: &mut [f32]) {
        out.fill(0.0);
        self.each_run(g, |y, x0, at, n| {
            let src = &plane[y * g.w + x0..(y + 1) * g.w];
            out[at..at + n].iter_mut().zip(src.iter().step_by(self.s)).for_each(|(d, &v)| *d = v);
        });
    }

    /// The unpadded plane (`h x w`) read back out of `phases` into `plane` (`fill`'s inverse).
    #[inline(always)]
    fn read(&self, g: &Geometry, phases: &[f32], plane: &mut [f32]) {
        self.each_run(g, |y, x0, at, n| {
            let dst = &mut plane[y * g.w + x0..(y + 1) * g.w];
            dst.iter_mut().step_by(self.s).zip(&phases[at..at + n]).for_each(|(d, &v)| *d = v);
        });
    }

    /// For every input row `y` and column phase: `f(y, x0, at, n)` — the row's columns `x0,
    /// x0 + s, …` (`n` of them) lie at `at, at + 1, …` of the phases.
    #[inline(always)]
    fn each_run(&self, g: &Geometry, mut f: impl FnMut(usize, usize, usize, usize)) {
        let (s, pad) = (self.s, g.p.padding);
        for y in 0..g.h {
            let yy = y + pad;
            let row_start = (yy % s) * s * self.len() + (yy / s) * self.cols;
            for px in 0..s {
                // The first column x with (x + pad) % s == px.
                let x0 = (px + s - pad % s) % s;
                if x0 < g.w {
                    let at = row_start + px * self.len() + (x0 + pad) / s;
                    f(y, x0, at, (g.w - x0).div_ceil(s));
                }
            }
        }
    }
}

/// Whether each output plane is a single value over the whole unpadded input plane (the GDC
/// of MobileFaceNet: a 7x7 kernel on 7x7 maps): then each output is one dot product, which
/// the phases' width would spread over a row of scratch lanes.
fn global(g: &Geometry) -> bool {
    g.oh == 1 && g.ow == 1 && g.p.padding == 0 && g.kh == g.h && g.kw == g.w && g.p.dilation == 1
}

/// Floats of an output plane in the phases' width (`oh x cols`; columns from `ow` on are
/// scratch).
fn wide_len(g: &Geometry, ph: &Phases) -> usize {
    g.oh * ph.cols
}

/// `plane` (`oh x ow`) into the phases' width with zeros in the extra columns.
#[inline(always)]
fn widen(g: &Geometry, ph: &Phases, plane: &[f32], wide: &mut [f32]) {
    wide.fill(0.0);
    for (row, out) in plane.chunks_exact(g.ow).zip(wide.chunks_exact_mut(ph.cols)) {
        out[..g.ow].copy_from_slice(row);
    }
}

// Each task's work is a `vectorized_kernel!` of its own, called from the rayon closure: a
// closure is compiled as a function of its own, without the features of the function it is
// written in (the plane loops ran at SSE width when they were closures).

/// `y[b, co] = Σ_{ci, ky, kx} w[co, ci, ky, kx] · shift(x[b, group·cpg + ci])`: each tap
/// one multiply-add over the whole output plane in the phases' width (see [`Phases`]), in
/// order ci, ky, kx for every element.
fn forward(g: &Geometry, x: &[f32], k: &[f32]) -> Vec<f32> {
    let ph = Phases::of(g);
    let mut y = vec![0f32; g.n * g.o * g.oh * g.ow];
    y.par_chunks_mut(g.oh * g.ow).enumerate().for_each_init(
        || (vec![0f32; ph.total()], vec![0f32; wide_len(g, &ph)]),
        |(xp, yw), (idx, yp)| forward_plane((g, &ph), (x, k), idx, (xp, yw), yp),
    );
    y
}

vectorized_kernel! {
    /// Output plane `idx` (image `idx / o`, channel `idx % o`) of [`forward`] into `yp`.
    fn forward_plane(
        (g, ph): (&Geometry, &Phases),
        (x, k): (&[f32], &[f32]),
        idx: usize,
        (xp, yw): (&mut [f32], &mut [f32]),
        yp: &mut [f32],
    ) {
        let plane = g.h * g.w;
        let (b, co) = (idx / g.o, idx % g.o);
        let group = co / g.opg;
        let x = |ci: usize| &x[(b * g.c + group * g.cpg + ci) * plane..][..plane];
        if global(g) {
            let k = |ci: usize| &k[(co * g.cpg + ci) * plane..][..plane];
            yp[0] = (0..g.cpg).fold(0f32, |s, ci| s + lane_sum2(k(ci), x(ci), |a, v| a * v));
            return;
        }
        yw.fill(0.0);
        for ci in 0..g.cpg {
            ph.fill(g, x(ci), xp);
            for ky in 0..g.kh {
                for kx in 0..g.kw {
                    let wv = k[((co * g.cpg + ci) * g.kh + ky) * g.kw + kx];
                    let (phase, off) = ph.tap(g, ky, kx);
                    let src = &xp[phase + off..][..yw.len()];
                    yw.iter_mut().zip(src).for_each(|(o, &v)| *o += wv * v);
                }
            }
        }
        for (out, row) in yp.chunks_exact_mut(g.ow).zip(yw.chunks_exact(ph.cols)) {
            out.copy_from_slice(&row[..g.ow]);
        }
    }
}

/// `gx[b, c] = Σ_{co in c's group, ky, kx} w[co, ci, ky, kx] · unshift(gy[b, co])`: each tap
/// scatters the whole (widened) output gradient into the phases at its offset, then the
/// input's positions are read back out of them.
fn input_grad(g: &Geometry, k: &[f32], gy: &[f32]) -> Vec<f32> {
    let ph = Phases::of(g);
    let mut gx = vec![0f32; g.n * g.c * g.h * g.w];
    gx.par_chunks_mut(g.h * g.w).enumerate().for_each_init(
        || (vec![0f32; ph.total()], vec![0f32; wide_len(g, &ph)]),
        |(gp, gyw), (idx, gxp)| input_grad_plane((g, &ph), (k, gy), idx, (gp, gyw), gxp),
    );
    gx
}

vectorized_kernel! {
    /// Input-gradient plane `idx` (image `idx / c`, channel `idx % c`) of [`input_grad`].
    fn input_grad_plane(
        (g, ph): (&Geometry, &Phases),
        (k, gy): (&[f32], &[f32]),
        idx: usize,
        (gp, gyw): (&mut [f32], &mut [f32]),
        gxp: &mut [f32],
    ) {
        let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
        let (b, c) = (idx / g.c, idx % g.c);
        let (group, ci) = (c / g.cpg, c % g.cpg);
        let outputs = group * g.opg..(group + 1) * g.opg;
        if global(g) {
            gxp.fill(0.0);
            for co in outputs {
                let gyv = gy[b * g.o + co];
                let kp = &k[(co * g.cpg + ci) * plane..][..plane];
                gxp.iter_mut().zip(kp).for_each(|(o, &w)| *o += w * gyv);
            }
            return;
        }
        gp.fill(0.0);
        for co in outputs {
            widen(g, ph, &gy[(b * g.o + co) * out_plane..][..out_plane], gyw);
            for ky in 0..g.kh {
                for kx in 0..g.kw {
                    let wv = k[((co * g.cpg + ci) * g.kh + ky) * g.kw + kx];
                    let (phase, off) = ph.tap(g, ky, kx);
                    let dst = &mut gp[phase + off..][..gyw.len()];
                    dst.iter_mut().zip(gyw.iter()).for_each(|(o, &v)| *o += wv * v);
                }
            }
        }
        ph.read(g, gp, gxp);
    }
}

/// `gw[co, ci, ky, kx] = Σ_{b, oy, ox} gy[b, co, oy, ox] · x[b, group·cpg + ci, shifted]`: per
/// image, each tap's dot product of the widened output gradient (zeros past the output's
/// width) with its phase run, in [`REDUCE_LANES`](super::simd::REDUCE_LANES) f32 partials;
/// each image's dot then joins the tap's f64 total, image after image, in a fixed order (one
/// task per output channel).
fn weight_grad(g: &Geometry, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let ph = Phases::of(g);
    let taps = g.cpg * g.kh * g.kw;
    let mut gw = vec![0f32; g.o * taps];
    gw.par_chunks_mut(taps).enumerate().for_each_init(
        || (vec![0f32; ph.total()], vec![0f32; wide_len(g, &ph)], vec![0f64; taps]),
        |(xp, gyw, acc), (co, gwc)| weight_grad_channel((g, &ph), (x, gy), co, (xp, gyw, acc), gwc),
    );
    gw
}

vectorized_kernel! {
    /// Output channel `co`'s weight gradient of [`weight_grad`] into `gwc`.
    fn weight_grad_channel(
        (g, ph): (&Geometry, &Phases),
        (x, gy): (&[f32], &[f32]),
        co: usize,
        (xp, gyw, acc): (&mut [f32], &mut [f32], &mut [f64]),
        gwc: &mut [f32],
    ) {
        let (plane, out_plane) = (g.h * g.w, g.oh * g.ow);
        let group = co / g.opg;
        acc.fill(0.0);
        for b in 0..g.n {
            if global(g) {
                let gyv = gy[b * g.o + co];
                let xb = &x[(b * g.c + group * g.cpg) * plane..][..g.cpg * plane];
                acc.iter_mut().zip(xb).for_each(|(a, &v)| *a += f64::from(gyv * v));
                continue;
            }
            widen(g, ph, &gy[(b * g.o + co) * out_plane..][..out_plane], gyw);
            for ci in 0..g.cpg {
                ph.fill(g, &x[(b * g.c + group * g.cpg + ci) * plane..][..plane], xp);
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        let (phase, off) = ph.tap(g, ky, kx);
                        let run = &xp[phase + off..][..gyw.len()];
                        let dot = lane_sum2(gyw, run, |a, v| a * v);
                        acc[(ci * g.kh + ky) * g.kw + kx] += f64::from(dot);
                    }
                }
            }
        }
        gwc.iter_mut().zip(acc.iter()).for_each(|(w, &a)| *w = a as f32);
    }
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
