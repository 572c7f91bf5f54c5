//! Grouped convolution (`groups > 1`, depthwise included) as one custom op, forward and both
//! gradients: on CPU f32 tensors by direct loops over each output plane (on a zero-padded copy
//! of each input plane split into its stride phases, so every tap is one contiguous run over
//! the whole plane: long vector loops even on MobileFaceNet's 7x7 and stride-2 planes, a block
//! of outputs kept in registers across the taps; the input gradient gathers the same way); on a
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
use crate::kernels::simd::{lane_sum2, REDUCE_LANES};
use crate::kernels::{par_chunks_zeroed, with_f32_slice};
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
///
/// Where the taps read and where the plane's rows go are worked out once per call: per plane
/// and tap, the divisions by the stride cost more than the tap's multiply-adds on
/// MobileFaceNet's 14x14 and 7x7 planes.
struct Phases {
    s: usize,
    rows: usize,
    cols: usize,
    /// Per tap `(ky, kx)`, row-major: its phase and the offset in it where output `(0, 0)` reads.
    taps: Vec<(usize, usize)>,
    /// The unpadded plane as runs: `(start, at, n)` — the plane's elements `start, start + s,
    /// …` (`n` of them, one input row's columns of one phase) lie at `at, at + 1, …`.
    runs: Vec<(usize, usize, usize)>,
}

/// Floats of a phase of `rows x cols`: its spare row included, then zeros to a whole number
/// of vectors.
fn phase_len(rows: usize, cols: usize) -> usize {
    ((rows + 1) * cols).next_multiple_of(REDUCE_LANES)
}

impl Phases {
    fn of(g: &Geometry) -> Phases {
        let (ph, pw) = g.padded();
        let s = g.p.stride;
        let (rows, cols) = (ph.div_ceil(s), pw.div_ceil(s));
        let taps = (0..g.kh * g.kw)
            .map(|t| {
                let (dy, dx) = ((t / g.kw) * g.p.dilation, (t % g.kw) * g.p.dilation);
                ((dy % s) * s + dx % s, (dy / s) * cols + dx / s)
            })
            .collect();
        let (pad, len) = (g.p.padding, phase_len(rows, cols));
        let mut runs = Vec::with_capacity(g.h * s);
        for y in 0..g.h {
            let yy = y + pad;
            let row_start = (yy % s) * s * len + (yy / s) * cols;
            for px in 0..s {
                // The first column x with (x + pad) % s == px.
                let x0 = (px + s - pad % s) % s;
                if x0 < g.w {
                    let at = row_start + px * len + (x0 + pad) / s;
                    runs.push((y * g.w + x0, at, (g.w - x0).div_ceil(s)));
                }
            }
        }
        Phases { s, rows, cols, taps, runs }
    }

    /// Floats of one phase, and of all of them.
    fn len(&self) -> usize {
        phase_len(self.rows, self.cols)
    }

    fn total(&self) -> usize {
        self.s * self.s * self.len()
    }

    /// A buffer for the phases, with room for a tap to read a whole number of vectors past the
    /// output's last element.
    fn buffer(&self) -> Vec<f32> {
        vec![0f32; self.total() + REDUCE_LANES]
    }

    /// Where each tap reads in the phases, for output `(0, 0)`.
    fn tap_offsets(&self) -> Vec<usize> {
        self.taps.iter().map(|&(phase, off)| phase * self.len() + off).collect()
    }

    /// `plane` (`h x w`) into its places in `out`. Only the plane's places are written: the
    /// padding's stay as they are, zero from the buffer's making (no plane writes there).
    #[inline(always)]
    fn fill(&self, plane: &[f32], out: &mut [f32]) {
        for &(start, at, n) in &self.runs {
            let dst = &mut out[at..at + n];
            match self.s {
                1 => copy_run(dst, &plane[start..]),
                2 => every_other(dst, &plane[start..]),
                s => {
                    dst.iter_mut().zip(plane[start..].iter().step_by(s)).for_each(|(d, &v)| *d = v)
                }
            }
        }
    }

    /// The unpadded plane (`h x w`) read back out of `phases` into `plane` (`fill`'s inverse).
    #[inline(always)]
    fn read(&self, phases: &[f32], plane: &mut [f32]) {
        for &(start, at, n) in &self.runs {
            let src = &phases[at..at + n];
            match self.s {
                1 => copy_run(&mut plane[start..start + n], src),
                s => plane[start..].iter_mut().step_by(s).zip(src).for_each(|(d, &v)| *d = v),
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
/// scratch), then zeros to a whole number of vectors: every loop over it runs in whole
/// vectors (a 7x7 plane's 63 floats left 15 to a scalar tail per tap).
fn wide_len(g: &Geometry, ph: &Phases) -> usize {
    (g.oh * ph.cols).next_multiple_of(REDUCE_LANES)
}

/// `plane` (`oh x ow`) into the phases' width. The scratch columns are not written: they stay
/// zero from the buffer's making.
#[inline(always)]
fn widen(g: &Geometry, ph: &Phases, plane: &[f32], wide: &mut [f32]) {
    for (row, out) in plane.chunks_exact(g.ow).zip(wide.chunks_exact_mut(ph.cols)) {
        copy_run(&mut out[..g.ow], row);
    }
}

/// Outputs [`correlate`] keeps in registers across its taps (four AVX-512 vectors).
const BLOCK: usize = 64;

/// `out[i] = (add ? out[i] : 0) + Σ_t w[t] · src[at[t] + i]` for every `i` of `out`, the
/// taps added one after the other in their order (a separate multiply and add, as everywhere
/// in these kernels). A block of outputs stays in registers across the taps instead of going
/// through memory once per tap.
#[inline(always)]
fn correlate(out: &mut [f32], src: &[f32], at: &[usize], w: &[f32], add: bool) {
    let full = out.len() / BLOCK * BLOCK;
    for start in (0..full).step_by(BLOCK) {
        let block: &mut [f32; BLOCK] = (&mut out[start..start + BLOCK]).try_into().unwrap();
        let mut acc = if add { *block } else { [0f32; BLOCK] };
        for (&a, &wv) in at.iter().zip(w) {
            let s: &[f32; BLOCK] = src[a + start..a + start + BLOCK].try_into().unwrap();
            for l in 0..BLOCK {
                acc[l] += wv * s[l];
            }
        }
        *block = acc;
    }
    let rest = &mut out[full..];
    if !add {
        rest.iter_mut().for_each(|o| *o = 0.0);
    }
    for (&a, &wv) in at.iter().zip(w) {
        rest.iter_mut().zip(&src[a + full..]).for_each(|(o, &v)| *o += wv * v);
    }
}

/// `dst[i] = src[2·i]`: by pairs, which vectorise (a shuffle of two loads); `step_by(2)`
/// copied one float at a time, most of a stride-2 layer's forward.
#[inline(always)]
fn every_other(dst: &mut [f32], src: &[f32]) {
    let pairs = src.len().min(2 * dst.len()) / 2;
    for (d, pair) in dst[..pairs].iter_mut().zip(src.chunks_exact(2)) {
        *d = pair[0];
    }
    if pairs < dst.len() {
        dst[pairs] = src[2 * pairs];
    }
}

/// `dst = src` (equal lengths) in fixed-size moves: these kernels copy runs of 3–56 floats
/// (a plane's rows), where a call to memmove cost more than the copy (memmove was ~10% of a
/// depthwise layer's profile).
#[inline(always)]
fn copy_run(dst: &mut [f32], src: &[f32]) {
    let n = dst.len();
    let src = &src[..n];
    if n >= 8 {
        for (d, s) in dst.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
            d.copy_from_slice(s);
        }
        // The last eight again, overlapping the ones just copied.
        dst[n - 8..].copy_from_slice(&src[n - 8..]);
    } else if n >= 4 {
        dst[..4].copy_from_slice(&src[..4]);
        dst[n - 4..].copy_from_slice(&src[n - 4..]);
    } else {
        dst.iter_mut().zip(src).for_each(|(d, &v)| *d = v);
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
    let at = ph.tap_offsets();
    par_chunks_zeroed(
        g.n * g.o * g.oh * g.ow,
        g.oh * g.ow,
        || (ph.buffer(), vec![0f32; wide_len(g, &ph)]),
        |(xp, yw), idx, yp| forward_plane((g, &ph, &at), (x, k), idx, (xp, yw), yp),
    )
}

vectorized_kernel! {
    /// Output plane `idx` (image `idx / o`, channel `idx % o`) of [`forward`] into `yp`.
    fn forward_plane(
        (g, ph, at): (&Geometry, &Phases, &[usize]),
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
        let taps = g.kh * g.kw;
        for ci in 0..g.cpg {
            ph.fill(x(ci), xp);
            correlate(yw, xp, at, &k[(co * g.cpg + ci) * taps..][..taps], ci > 0);
        }
        for (out, row) in yp.chunks_exact_mut(g.ow).zip(yw.chunks_exact(ph.cols)) {
            copy_run(out, row);
        }
    }
}

/// The input gradient as [`correlate`]s: tap `t` adds `w_t · gy` into the phases at its offset
/// `off_t`, so a phase's element `j` is `Σ w_t · gy[j − off_t]` over that phase's taps in their
/// order — a correlation with the widened output gradient placed `lead` zeros into a buffer
/// (`lead` = the largest offset), each tap reading it from `lead − off_t`.
struct InputGradTaps {
    lead: usize,
    /// Per phase: its taps (indices into the kernel's taps) and where each reads the buffer.
    phases: Vec<(Vec<usize>, Vec<usize>)>,
    /// The buffer's length: up to every position a phase reads, zeros past the gradient.
    len: usize,
}

impl InputGradTaps {
    fn of(g: &Geometry, ph: &Phases) -> InputGradTaps {
        let lead = ph.taps.iter().map(|&(_, off)| off).max().unwrap_or(0);
        let phases = (0..ph.s * ph.s)
            .map(|p| {
                let taps: Vec<usize> = (0..ph.taps.len()).filter(|&t| ph.taps[t].0 == p).collect();
                let reads = taps.iter().map(|&t| lead - ph.taps[t].1).collect();
                (taps, reads)
            })
            .collect();
        InputGradTaps { lead, phases, len: lead + ph.len().max(wide_len(g, ph)) }
    }
}

/// `gx[b, c] = Σ_{co in c's group, ky, kx} w[co, ci, ky, kx] · unshift(gy[b, co])`: per
/// phase, the taps that land in it gather the (widened) output gradient (see
/// [`InputGradTaps`]), then the input's positions are read back out of the phases.
fn input_grad(g: &Geometry, k: &[f32], gy: &[f32]) -> Vec<f32> {
    let ph = Phases::of(g);
    let gt = InputGradTaps::of(g, &ph);
    par_chunks_zeroed(
        g.n * g.c * g.h * g.w,
        g.h * g.w,
        || (vec![0f32; ph.total()], vec![0f32; gt.len], vec![0f32; g.kh * g.kw]),
        |(gp, gyw, w), idx, gxp| input_grad_plane((g, &ph, &gt), (k, gy), idx, (gp, gyw, w), gxp),
    )
}

vectorized_kernel! {
    /// Input-gradient plane `idx` (image `idx / c`, channel `idx % c`) of [`input_grad`].
    fn input_grad_plane(
        (g, ph, gt): (&Geometry, &Phases, &InputGradTaps),
        (k, gy): (&[f32], &[f32]),
        idx: usize,
        (gp, gyw, w): (&mut [f32], &mut [f32], &mut [f32]),
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
        let (taps, len) = (g.kh * g.kw, ph.len());
        for (i, co) in outputs.enumerate() {
            widen(g, ph, &gy[(b * g.o + co) * out_plane..][..out_plane], &mut gyw[gt.lead..]);
            let kc = &k[(co * g.cpg + ci) * taps..][..taps];
            for (p, (phase_taps, reads)) in gt.phases.iter().enumerate() {
                w.iter_mut().zip(phase_taps).for_each(|(w, &t)| *w = kc[t]);
                let (out, w) = (&mut gp[p * len..(p + 1) * len], &w[..reads.len()]);
                correlate(out, gyw, reads, w, i > 0);
            }
        }
        ph.read(gp, gxp);
    }
}

/// `gw[co, ci, ky, kx] = Σ_{b, oy, ox} gy[b, co, oy, ox] · x[b, group·cpg + ci, shifted]`: per
/// image, each tap's dot product of the widened output gradient (zeros past the output's
/// width) with its phase run, in [`REDUCE_LANES`](super::simd::REDUCE_LANES) f32 partials;
/// each image's dot then joins the tap's f64 total, image after image, in a fixed order (one
/// task per output channel).
fn weight_grad(g: &Geometry, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let ph = Phases::of(g);
    let at = ph.tap_offsets();
    let taps = g.cpg * g.kh * g.kw;
    let mut gw = vec![0f32; g.o * taps];
    gw.par_chunks_mut(taps).enumerate().for_each_init(
        || (ph.buffer(), vec![0f32; wide_len(g, &ph)], vec![0f64; taps]),
        |(xp, gyw, acc), (co, gwc)| {
            weight_grad_channel((g, &ph, &at), (x, gy), co, (xp, gyw, acc), gwc)
        },
    );
    gw
}

vectorized_kernel! {
    /// Output channel `co`'s weight gradient of [`weight_grad`] into `gwc`.
    fn weight_grad_channel(
        (g, ph, at): (&Geometry, &Phases, &[usize]),
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
                ph.fill(&x[(b * g.c + group * g.cpg + ci) * plane..][..plane], xp);
                let acc = &mut acc[ci * at.len()..][..at.len()];
                for (a, &t) in acc.iter_mut().zip(at) {
                    *a += f64::from(lane_sum2(gyw, &xp[t..t + gyw.len()], |a, v| a * v));
                }
            }
        }
        gwc.iter_mut().zip(acc.iter()).for_each(|(w, &a)| *w = a as f32);
    }
}

/// The grouped convolution's output on CPU f32 storage, and its shape (also the forward of
/// the fused convolution → BatchNorm op, `kernels::conv_batch_norm`).
pub(crate) fn forward_f32(
    p: GroupedConvParams,
    (xs, xl): (&CpuStorage, &Layout),
    (ks, kl): (&CpuStorage, &Layout),
) -> candle_core::Result<(Vec<f32>, Shape)> {
    let g = Geometry::new(xl.dims(), kl.dims(), p)?;
    let x = contiguous_f32(xs, xl, "grouped conv2d", "input")?;
    let k = contiguous_f32(ks, kl, "grouped conv2d", "weight")?;
    Ok((forward(&g, x, k), g.out_shape()))
}

/// The gradients of the input and the weight on the CPU (each only when it is in the autograd
/// graph; inside [`crate::backward`] the weight's goes to the store directly).
pub(crate) fn backward(
    p: GroupedConvParams,
    x: &Tensor,
    k: &Tensor,
    gy: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    let g = Geometry::new(x.dims(), k.dims(), p)?;
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
        let (y, shape) = forward_f32(self.0, (xs, xl), (ks, kl))?;
        Ok((CpuStorage::F32(y), shape))
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
        backward(self.0, x, k, gy)
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
    /// 7x7 without padding, and dilation; and the edges of the kernels' copies and blocks.
    #[test]
    fn matches_candles_grouped_convolution_and_gradients() {
        let cases = [
            // (n, c, h, o, k, stride, padding, dilation, groups)
            (2, 8, 9, 8, 3, 1, 1, 1, 8),
            (2, 8, 9, 8, 3, 2, 1, 1, 8),
            (1, 8, 7, 8, 3, 1, 1, 1, 4),
            (3, 6, 7, 6, 7, 1, 0, 1, 6),
            (2, 4, 10, 8, 3, 2, 2, 2, 2),
            // Rows shorter than four floats; a 1x1 stride-2 kernel (phases no tap reads);
            // stride 3; a plane of several blocks of outputs and a remainder.
            (2, 4, 3, 4, 3, 1, 1, 1, 4),
            (2, 4, 11, 4, 1, 2, 0, 1, 4),
            (1, 6, 13, 6, 3, 3, 1, 1, 3),
            (1, 4, 20, 4, 3, 1, 1, 1, 4),
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
