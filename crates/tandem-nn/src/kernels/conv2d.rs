//! `conv2d` on the CPU as im2col + gemm, forward and backward, as a candle custom op.
//!
//! Why: candle's CPU convolution backward computes the input gradient with a transposed
//! convolution and the weight gradient with a dilated convolution whose "kernel" is the whole
//! output gradient — direct loops that run an order of magnitude slower than the forward. Here
//! all three products are gemms over an im2col buffer (rebuilt in backward rather than kept):
//!
//! * forward, per image: `y[O, P] = w[O, K] · col[K, P]` (K = C·kh·kw, P = Ho·Wo);
//! * weight gradient: `gw[O, K] = Σ_images gy[O, P] · col[K, P]ᵀ`, no transposed convolution;
//! * input gradient, only when the input is in the autograd graph (not for the data):
//!   `gcol[K, P] = w[O, K]ᵀ · gy[O, P]`, scattered back by col2im.
//!
//! A 1x1 stride-1 unpadded convolution skips im2col (the image is its own `col`). Images are
//! spread over the rayon threads (`RAYON_NUM_THREADS`, which `tandem run` sets to cores per
//! rank); a batch smaller than the thread count parallelises inside each gemm instead.
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use rayon::prelude::*;

use super::matmul::{matmul, View};
use super::winograd;
use crate::backward::take_param_grad;
use crate::contiguous_f32;
use crate::kernels::{par_chunks_zeroed, with_f32_slice, zeroed};

/// Stride, padding and dilation, the same in both spatial dimensions (candle-nn's config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvParams {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
}

/// Output lines shorter than this are gathered through a table of offsets
/// ([`Geometry::im2col_taps`]) rather than copied line by line. Public for the probes.
#[doc(hidden)]
pub static SHORT_LINE_BELOW: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(24);

/// What a table of taps depends on: (h, w, kh, kw, ho, wo, params).
type TapsKey = (usize, usize, usize, usize, usize, usize, ConvParams);

/// The geometry of one convolution.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    ho: usize,
    wo: usize,
    p: ConvParams,
}

impl Geometry {
    fn new(x: &[usize], k: &[usize], p: ConvParams) -> candle_core::Result<Self> {
        let (&[n, c, h, w], &[o, kc, kh, kw]) = (x, k) else {
            candle_core::bail!("conv2d: expected input [N, C, H, W] and weight [O, C, kh, kw], got {x:?} and {k:?}")
        };
        if kc != c {
            candle_core::bail!("conv2d: input has {c} channels, weight {k:?} expects {kc}")
        }
        if p.stride == 0 || p.dilation == 0 {
            candle_core::bail!("conv2d: stride and dilation must be >= 1, got {p:?}")
        }
        let out = |size: usize, k: usize| {
            let span = p.dilation * (k - 1) + 1;
            (size + 2 * p.padding).checked_sub(span).map(|s| s / p.stride + 1)
        };
        let (Some(ho), Some(wo)) = (out(h, kh), out(w, kw)) else {
            candle_core::bail!("conv2d: kernel {kh}x{kw} (dilation {}) is larger than the padded input {h}x{w} (padding {})", p.dilation, p.padding)
        };
        Ok(Geometry { n, c, h, w, o, kh, kw, ho, wo, p })
    }

    fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }

    fn pixels(&self) -> usize {
        self.ho * self.wo
    }

    fn image_len(&self) -> usize {
        self.c * self.h * self.w
    }

    fn out_len(&self) -> usize {
        self.o * self.pixels()
    }

    /// The output's shape, `[N, O, Ho, Wo]`.
    fn out_shape(&self) -> Shape {
        Shape::from((self.n, self.o, self.ho, self.wo))
    }

    /// A 3x3 "same" convolution with enough channels for [`winograd`]: its dimensions there.
    fn winograd(&self) -> Option<winograd::Dims> {
        let p = self.p;
        let input = [self.n, self.c, self.h, self.w];
        winograd::plan((self.kh, self.kw), (p.stride, p.padding, p.dilation), input, self.o)
    }

    /// A thin Winograd convolution whose per-image im2col buffer stays in the core's cache:
    /// there the forward's one gemm over im2col beats Winograd's transformed tiles
    /// (`conv_strategies`, 2 threads, batch 32: 16 channels at 32x32 0.92 vs 1.18 ms; at
    /// IResNet's 112x112, a 7 MB buffer, 3.7 vs 3.3 ms; 32 channels at 16x16 even; with 4x4
    /// tiles, 16 channels at 32x32 on one thread 2.2–2.5 vs 2.9–3.9 ms). The
    /// input gradient, itself such a convolution, follows it (see `backward`); the weight's
    /// stays Winograd's.
    fn im2col_forward_is_ahead(&self) -> bool {
        const MAX_CHANNELS: usize = 16;
        const MAX_COL_BYTES: usize = 1 << 20;
        let col_bytes = self.k() * self.pixels() * std::mem::size_of::<f32>();
        self.c.max(self.o) <= MAX_CHANNELS && col_bytes <= MAX_COL_BYTES
    }

    /// The image is its own im2col matrix.
    fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.p.stride == 1 && self.p.padding == 0
    }

    /// The outputs `o` whose input `o * stride + k * dilation - padding` lies in `0..size`.
    #[inline]
    fn valid(&self, k: usize, size: usize, outputs: usize) -> std::ops::Range<usize> {
        let (s, offset) = (self.p.stride, k * self.p.dilation);
        let lo = self.p.padding.saturating_sub(offset).div_ceil(s);
        // Largest o with o * s + offset - padding <= size - 1.
        let hi = (size + self.p.padding).checked_sub(offset + 1).map_or(0, |top| top / s + 1);
        lo.min(outputs)..hi.min(outputs).max(lo.min(outputs))
    }

    /// A stride-1, "same"-size convolution (the 3x3 pad-1 layers of every ResNet): each im2col
    /// row is the image plane shifted, so it can be built with a few block copies.
    fn is_same_size_stride_1(&self) -> bool {
        self.p.stride == 1 && self.p.dilation == 1 && self.ho == self.h && self.wo == self.w
    }

    /// `col[K, P]` of one image, row `r` starting at `col[r * row_stride]`.
    fn im2col(&self, image: &[f32], col: &mut [f32], row_stride: usize) {
        if self.is_same_size_stride_1() {
            return self.im2col_shifted(image, col, row_stride);
        }
        if self.has_short_lines() {
            return self.im2col_taps(image, col, row_stride);
        }
        self.im2col_lines(image, col, row_stride)
    }

    /// Output lines shorter than [`SHORT_LINE_BELOW`]: the line-by-line loops spend more on
    /// each line's bounds than on its few values (ResNet's stride-2 convolutions into 8x8).
    fn has_short_lines(&self) -> bool {
        self.wo < SHORT_LINE_BELOW.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Row `(ky, kx)`'s input offset in the plane for each output pixel, `h·w` (past the
    /// plane) where the tap falls in the padding: `kh·kw·P` offsets, the same for every
    /// channel and image, so built once per thread and geometry.
    fn with_taps<R>(&self, f: impl FnOnce(&[u32]) -> R) -> R {
        thread_local! {
            static TAPS: std::cell::RefCell<(Option<TapsKey>, Vec<u32>)> =
                const { std::cell::RefCell::new((None, Vec::new())) };
        }
        let key = (self.h, self.w, self.kh, self.kw, self.ho, self.wo, self.p);
        TAPS.with(|t| {
            let mut t = t.borrow_mut();
            if t.0 != Some(key) {
                t.1 = self.taps();
                t.0 = Some(key);
            }
            f(&t.1)
        })
    }

    fn taps(&self) -> Vec<u32> {
        let (s, d, pad) = (self.p.stride, self.p.dilation, self.p.padding);
        let outside = (self.h * self.w) as u32;
        let at = |o: usize, k: usize, size: usize| {
            (o * s + k * d).checked_sub(pad).filter(|&i| i < size)
        };
        let mut taps = Vec::with_capacity(self.kh * self.kw * self.pixels());
        for ky in 0..self.kh {
            for kx in 0..self.kw {
                for oy in 0..self.ho {
                    for ox in 0..self.wo {
                        taps.push(match (at(oy, ky, self.h), at(ox, kx, self.w)) {
                            (Some(iy), Some(ix)) => (iy * self.w + ix) as u32,
                            _ => outside,
                        });
                    }
                }
            }
        }
        taps
    }

    /// [`Geometry::im2col`] as a gather through [`Geometry::with_taps`]' offsets.
    fn im2col_taps(&self, image: &[f32], col: &mut [f32], row_stride: usize) {
        let (plane_len, pixels, rows) = (self.h * self.w, self.pixels(), self.kh * self.kw);
        self.with_taps(|taps| {
            for ci in 0..self.c {
                let plane = &image[ci * plane_len..(ci + 1) * plane_len];
                for (r, taps) in taps.chunks_exact(pixels).enumerate() {
                    let dst = &mut col[(ci * rows + r) * row_stride..][..pixels];
                    for (v, &t) in dst.iter_mut().zip(taps) {
                        *v = plane.get(t as usize).copied().unwrap_or(0.0);
                    }
                }
            }
        })
    }

    /// [`Geometry::col2im`] as a scatter through [`Geometry::with_taps`]' offsets, in the
    /// line-by-line version's order (row by row, pixels in order), so the same bits.
    fn col2im_taps(&self, col: &[f32], image: &mut [f32], row_stride: usize) {
        let (plane_len, pixels, rows) = (self.h * self.w, self.pixels(), self.kh * self.kw);
        self.with_taps(|taps| {
            for ci in 0..self.c {
                let plane = &mut image[ci * plane_len..(ci + 1) * plane_len];
                for (r, taps) in taps.chunks_exact(pixels).enumerate() {
                    let src = &col[(ci * rows + r) * row_stride..][..pixels];
                    for (v, &t) in src.iter().zip(taps) {
                        if let Some(d) = plane.get_mut(t as usize) {
                            *d += v;
                        }
                    }
                }
            }
        })
    }

    /// [`Geometry::im2col`] line by line, for any geometry.
    fn im2col_lines(&self, image: &[f32], col: &mut [f32], row_stride: usize) {
        let (pixels, s) = (self.pixels(), self.p.stride);
        for ci in 0..self.c {
            let plane = &image[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for ky in 0..self.kh {
                let rows = self.valid(ky, self.h, self.ho);
                for kx in 0..self.kw {
                    let cols = self.valid(kx, self.w, self.wo);
                    let row = (ci * self.kh + ky) * self.kw + kx;
                    let dst = &mut col[row * row_stride..row * row_stride + pixels];
                    for oy in 0..self.ho {
                        let line = &mut dst[oy * self.wo..(oy + 1) * self.wo];
                        if !rows.contains(&oy) || cols.is_empty() {
                            line.fill(0.0);
                            continue;
                        }
                        let iy = oy * s + ky * self.p.dilation - self.p.padding;
                        let src = &plane[iy * self.w..(iy + 1) * self.w];
                        line[..cols.start].fill(0.0);
                        line[cols.end..].fill(0.0);
                        let ix0 = cols.start * s + kx * self.p.dilation - self.p.padding;
                        if s == 1 {
                            line[cols.clone()].copy_from_slice(&src[ix0..ix0 + cols.len()]);
                        } else {
                            let strided = src[ix0..].iter().step_by(s);
                            line[cols.clone()].iter_mut().zip(strided).for_each(|(v, x)| *v = *x);
                        }
                    }
                }
            }
        }
    }

    /// [`Geometry::im2col`] of a same-size stride-1 convolution. Row (ci, ky, kx) is plane ci
    /// shifted by (dy, dx) = (ky, kx) − padding: the valid lines are one contiguous block of the
    /// plane (rows wrap into each other at the edges), copied at once; then the |dx| edge
    /// columns of each line, which hold the neighbouring line's values, are zeroed, and so are
    /// the lines above and below the image. On small maps (8x8, 4x4) this replaces a pair of
    /// library calls per 4–8 element line with a few per row.
    fn im2col_shifted(&self, image: &[f32], col: &mut [f32], row_stride: usize) {
        let (h, w, pad) = (self.h, self.w, self.p.padding as isize);
        let plane_len = h * w;
        for ci in 0..self.c {
            let plane = &image[ci * plane_len..(ci + 1) * plane_len];
            for ky in 0..self.kh {
                let rows = self.valid(ky, h, h);
                let dy = ky as isize - pad;
                for kx in 0..self.kw {
                    let dx = kx as isize - pad;
                    let row = (ci * self.kh + ky) * self.kw + kx;
                    let dst = &mut col[row * row_stride..row * row_stride + plane_len];
                    dst[..rows.start * w].fill(0.0);
                    dst[rows.end * w..].fill(0.0);
                    if rows.is_empty() || dx.unsigned_abs() >= w {
                        dst[rows.start * w..rows.end * w].fill(0.0);
                        continue;
                    }
                    // dst[p] = plane[p + dy·w + dx] for p in the valid lines, clipped to the plane
                    // (the clipped elements are edge columns, zeroed below).
                    let (lo, hi) = (rows.start * w, rows.end * w);
                    let shift = dy * w as isize + dx;
                    let first = lo.max((-shift).max(0) as usize);
                    let last = hi.min((plane_len as isize - shift) as usize);
                    if first < last {
                        let from = (first as isize + shift) as usize;
                        dst[first..last].copy_from_slice(&plane[from..from + (last - first)]);
                    }
                    dst[lo..first].fill(0.0);
                    dst[last.max(lo)..hi].fill(0.0);
                    let edge = dx.unsigned_abs();
                    for line in dst[lo..hi].chunks_exact_mut(w) {
                        let cut = if dx < 0 { &mut line[..edge] } else { &mut line[w - edge..] };
                        for v in cut {
                            *v = 0.0;
                        }
                    }
                }
            }
        }
    }

    /// Adds `col[K, P]` (row `r` at `col[r * row_stride]`) into the image gradient (the adjoint
    /// of `im2col`); `image` must start zeroed (the callers allocate it so).
    fn col2im(&self, col: &[f32], image: &mut [f32], row_stride: usize) {
        if self.has_short_lines() {
            return self.col2im_taps(col, image, row_stride);
        }
        self.col2im_lines(col, image, row_stride)
    }

    /// [`Geometry::col2im`] line by line.
    fn col2im_lines(&self, col: &[f32], image: &mut [f32], row_stride: usize) {
        let s = self.p.stride;
        for ci in 0..self.c {
            let plane = &mut image[ci * self.h * self.w..(ci + 1) * self.h * self.w];
            for ky in 0..self.kh {
                let rows = self.valid(ky, self.h, self.ho);
                for kx in 0..self.kw {
                    let cols = self.valid(kx, self.w, self.wo);
                    if cols.is_empty() {
                        continue;
                    }
                    let row = (ci * self.kh + ky) * self.kw + kx;
                    let src = &col[row * row_stride..];
                    for oy in rows.clone() {
                        let iy = oy * s + ky * self.p.dilation - self.p.padding;
                        let line = &src[oy * self.wo + cols.start..oy * self.wo + cols.end];
                        let dst = &mut plane[iy * self.w..(iy + 1) * self.w];
                        let ix0 = cols.start * s + kx * self.p.dilation - self.p.padding;
                        if s == 1 {
                            dst[ix0..ix0 + line.len()]
                                .iter_mut()
                                .zip(line)
                                .for_each(|(d, v)| *d += v);
                        } else {
                            let strided = dst[ix0..].iter_mut().step_by(s);
                            strided.zip(line).for_each(|(d, v)| *d += v);
                        }
                    }
                }
            }
        }
    }
}

fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// Below this many output pixels per image, per-image gemms are too thin (inner dimension P in
/// the weight gradient): the whole batch goes through one gemm over `[K, N·P]` instead. At 8x8
/// (64 pixels) the per-image path is already ahead: ResNet-18's stride-2 convolutions into
/// 8x8 at batch 64, 2 threads, forward 1.9 vs 1.5 ms and backward 4.0 vs 3.3 ms batched vs
/// per image; at 4x4 the two are level. Settable only so tests can run every shape through
/// both paths.
#[doc(hidden)]
pub static BATCHED_BELOW_PIXELS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(64);

fn batched(g: &Geometry) -> bool {
    g.pixels() < BATCHED_BELOW_PIXELS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `col[K, N·P]`: image n's im2col in columns `n·P..(n+1)·P`; an input channel's rows (one
/// contiguous run of `col`) per parallel task — serial, this made the batched stride-2
/// convolutions of a small ResNet 3x slower than PyTorch's.
fn im2col_batch(g: &Geometry, x: &[f32]) -> Vec<f32> {
    let (np, rows) = (g.n * g.pixels(), g.kh * g.kw);
    let (plane, one_channel) = (g.h * g.w, Geometry { c: 1, ..*g });
    let mut col = zeroed(g.k() * np);
    col.par_chunks_mut(rows * np).enumerate().for_each(|(ci, channel_rows)| {
        for (n, image) in x.chunks(g.image_len()).enumerate() {
            let channel = &image[ci * plane..(ci + 1) * plane];
            one_channel.im2col(channel, &mut channel_rows[n * g.pixels()..], np);
        }
    });
    col
}

/// `[N, O, P]` <-> `[O, N·P]`.
fn swap_batch_and_channels(src: &[f32], dims: (usize, usize, usize)) -> Vec<f32> {
    let mut out = zeroed(src.len());
    swap_into(src, dims, &mut out);
    out
}

/// [`swap_batch_and_channels`] into `out`: `src[a][b][p]` to `out[b][a][p]`, one `b` per
/// parallel task.
fn swap_into(src: &[f32], (a, b, p): (usize, usize, usize), out: &mut [f32]) {
    out[..a * b * p].par_chunks_mut(a * p).enumerate().for_each(|(j, rows)| {
        for (i, row) in rows.chunks_exact_mut(p).enumerate() {
            row.copy_from_slice(&src[(i * b + j) * p..(i * b + j + 1) * p]);
        }
    });
}

fn forward_batched(g: &Geometry, x: &[f32], w: &[f32], y: &mut [f32]) {
    let (k, np) = (g.k(), g.n * g.pixels());
    let col = im2col_batch(g, x);
    let mut y_t = zeroed(g.o * np);
    let weight = View { data: w, rs: k, cs: 1 };
    matmul(
        (g.o, np, k),
        &mut y_t,
        np,
        weight,
        View { data: &col, rs: np, cs: 1 },
        false,
        threads(),
    );
    swap_into(&y_t, (g.o, g.n, g.pixels()), y);
}

fn weight_grad_batched(g: &Geometry, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let (k, np) = (g.k(), g.n * g.pixels());
    let col = im2col_batch(g, x);
    let gy_t = swap_batch_and_channels(gy, (g.n, g.o, g.pixels()));
    // gy_t is [O, N·P]: the same product as `weight_grad`'s for one image of N·P pixels.
    let mut gw = vec![0f32; k * g.o];
    weight_grad_product(g, &mut gw, &col, &gy_t, np, false, threads());
    finish_weight_grad(g, gw)
}

/// Whether the weight gradient is computed as its transpose `gwᵀ[K, O] = col · gyᵀ`: gemm
/// gathers its right operand column-wise, so the smaller of `colᵀ` (`P x K`) and `gyᵀ`
/// (`P x O`) goes right — with the long pixel dimension inner that gather dominates. `gwᵀ`
/// measured 2x faster on IResNet's 16-channel 112x112 maps (K = 144 > O = 16,
/// `examples/gemm_orient.rs`); a 1x1 stride-2 downsample or a 3-channel stem (K < O) is
/// faster the other way.
fn weight_grad_transposed(g: &Geometry) -> bool {
    g.o <= g.k()
}

/// Adds (or with `!accumulate`, writes) one image's `gy_i · col_iᵀ` into `gw`, held as `gwᵀ`
/// when [`weight_grad_transposed`]. `col`: `[K, P]`, `gy_i`: `[O, P]`, both rows of `pixels`.
fn weight_grad_product(
    g: &Geometry,
    gw: &mut [f32],
    col: &[f32],
    gy_i: &[f32],
    pixels: usize,
    accumulate: bool,
    threads: usize,
) {
    let k = g.k();
    if weight_grad_transposed(g) {
        let col = View { data: col, rs: pixels, cs: 1 };
        let gy_t = View { data: gy_i, rs: 1, cs: pixels };
        matmul((k, g.o, pixels), gw, g.o, col, gy_t, accumulate, threads);
    } else {
        let gy_i = View { data: gy_i, rs: pixels, cs: 1 };
        let col_t = View { data: col, rs: 1, cs: pixels };
        matmul((g.o, k, pixels), gw, k, gy_i, col_t, accumulate, threads);
    }
}

/// `gw[O, K]` from what [`weight_grad_product`] accumulated.
fn finish_weight_grad(g: &Geometry, gw: Vec<f32>) -> Vec<f32> {
    if weight_grad_transposed(g) {
        super::transposed(&gw, g.k(), g.o)
    } else {
        gw
    }
}

fn input_grad_batched(g: &Geometry, w: &[f32], gy: &[f32]) -> Vec<f32> {
    let (k, np) = (g.k(), g.n * g.pixels());
    let gy_t = swap_batch_and_channels(gy, (g.n, g.o, g.pixels()));
    let mut gcol = zeroed(k * np);
    let w_t = View { data: w, rs: 1, cs: k };
    matmul((k, np, g.o), &mut gcol, np, w_t, View { data: &gy_t, rs: np, cs: 1 }, false, threads());
    let mut gx = zeroed(g.n * g.image_len());
    gx.par_chunks_mut(g.image_len()).enumerate().for_each(|(n, gx_n)| {
        g.col2im(&gcol[n * g.pixels()..], gx_n, np);
    });
    gx
}

/// `w'[c][o][ky][kx] = w[o][c][kh − 1 − ky][kw − 1 − kx]`: the filters of the convolution
/// that maps a stride-1 "same" convolution's output gradient to its input gradient.
fn flipped_transposed(g: &Geometry, w: &[f32]) -> Vec<f32> {
    let taps = g.kh * g.kw;
    let mut out = vec![0f32; w.len()];
    for (oi, filters) in w.chunks_exact(g.c * taps).enumerate() {
        for (ci, filter) in filters.chunks_exact(taps).enumerate() {
            let to = &mut out[(ci * g.o + oi) * taps..][..taps];
            to.iter_mut().zip(filter.iter().rev()).for_each(|(t, &v)| *t = v);
        }
    }
    out
}

/// `y = conv2d(x, w)` (`[N, O, Ho, Wo]`, flat).
fn forward(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    if let Some(d) = g.winograd().filter(|_| !g.im2col_forward_is_ahead()) {
        let mut y = zeroed(g.n * g.out_len());
        winograd::forward(&d, x, w, &mut y);
        return y;
    }
    if batched(g) {
        let mut y = zeroed(g.n * g.out_len());
        forward_batched(g, x, w, &mut y);
        return y;
    }
    let (k, pixels, t) = (g.k(), g.pixels(), threads());
    let weight = View { data: w, rs: k, cs: 1 };
    let one = |image: &[f32], out: &mut [f32], col: &mut Vec<f32>, inner: usize| {
        let col = if g.is_pointwise() {
            image
        } else {
            col.resize(k * pixels, 0.0);
            g.im2col(image, col, pixels);
            col
        };
        matmul(
            (g.o, pixels, k),
            out,
            pixels,
            weight,
            View { data: col, rs: pixels, cs: 1 },
            false,
            inner,
        );
    };
    per_image((g.n, t), (x, g.image_len()), g.out_len(), one)
}

/// `one(src_i, out_i, scratch, threads)` for each of `n` images (`src` `src_len` values an
/// image, the output `out_len`): an image per task when there are at least as many images as
/// threads, each output zeroed in cache by its task just before it is written
/// (`par_chunks_zeroed`); else one image after another, `one` using the `t` threads itself.
fn per_image(
    (n, t): (usize, usize),
    (src, src_len): (&[f32], usize),
    out_len: usize,
    one: impl Fn(&[f32], &mut [f32], &mut Vec<f32>, usize) + Sync + Send,
) -> Vec<f32> {
    let src_i = |i: usize| &src[i * src_len..(i + 1) * src_len];
    if n >= t {
        return par_chunks_zeroed(n * out_len, out_len, Vec::new, |col, i, out| {
            one(src_i(i), out, col, 1)
        });
    }
    let mut out = zeroed(n * out_len);
    let mut col = Vec::new();
    for (i, out_i) in out.chunks_mut(out_len).enumerate() {
        one(src_i(i), out_i, &mut col, t);
    }
    out
}

/// `gw[O, K] = Σ gy_n · col_nᵀ`, over chunks of images in parallel (in the orientation of
/// [`weight_grad_transposed`]).
fn weight_grad(g: &Geometry, x: &[f32], gy: &[f32]) -> Vec<f32> {
    if batched(g) {
        return weight_grad_batched(g, x, gy);
    }
    let (k, pixels, t) = (g.k(), g.pixels(), threads());
    let chunks = t.min(g.n).max(1);
    let per_chunk = g.n.div_ceil(chunks);
    let partials: Vec<Vec<f32>> = (0..chunks)
        .into_par_iter()
        .map(|c| {
            let inner = if chunks >= t { 1 } else { t };
            let mut gw = vec![0f32; k * g.o];
            let mut col = Vec::new();
            for i in c * per_chunk..((c + 1) * per_chunk).min(g.n) {
                let image = &x[i * g.image_len()..(i + 1) * g.image_len()];
                let col = if g.is_pointwise() {
                    image
                } else {
                    col.resize(k * pixels, 0.0);
                    g.im2col(image, &mut col, pixels);
                    &col[..]
                };
                let gy_i = &gy[i * g.out_len()..(i + 1) * g.out_len()];
                weight_grad_product(g, &mut gw, col, gy_i, pixels, i > c * per_chunk, inner);
            }
            gw
        })
        .collect();
    let mut total = partials.into_iter();
    let mut gw = total.next().unwrap_or_else(|| vec![0f32; k * g.o]);
    for p in total {
        gw.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
    }
    finish_weight_grad(g, gw)
}

/// `gx_n = col2im(wᵀ · gy_n)`.
fn input_grad(g: &Geometry, w: &[f32], gy: &[f32]) -> Vec<f32> {
    if batched(g) {
        return input_grad_batched(g, w, gy);
    }
    let (k, pixels, t) = (g.k(), g.pixels(), threads());
    let w_t = View { data: w, rs: 1, cs: k };
    let one = |gy_i: &[f32], gx_i: &mut [f32], col: &mut Vec<f32>, inner: usize| {
        let gy_i = View { data: gy_i, rs: pixels, cs: 1 };
        if g.is_pointwise() {
            matmul((k, pixels, g.o), gx_i, pixels, w_t, gy_i, false, inner);
        } else {
            col.resize(k * pixels, 0.0);
            matmul((k, pixels, g.o), col, pixels, w_t, gy_i, false, inner);
            g.col2im(col, gx_i, pixels);
        }
    };
    per_image((g.n, t), (gy, g.out_len()), g.image_len(), one)
}

/// The convolution's output `[N, O, Ho, Wo]` (as a flat vector) and its geometry.
fn cpu_forward(
    p: ConvParams,
    xs: &CpuStorage,
    xl: &Layout,
    ws: &CpuStorage,
    wl: &Layout,
) -> candle_core::Result<(Vec<f32>, Geometry)> {
    let g = Geometry::new(xl.dims(), wl.dims(), p)?;
    let x = contiguous_f32(xs, xl, "conv2d", "input")?;
    let w = contiguous_f32(ws, wl, "conv2d", "weight")?;
    Ok((forward(&g, x, w), g))
}

/// The convolution's output `[N, O, Ho, Wo]` as a flat vector, and its shape.
pub(crate) fn forward_f32(
    p: ConvParams,
    (xs, xl): (&CpuStorage, &Layout),
    (ws, wl): (&CpuStorage, &Layout),
) -> candle_core::Result<(Vec<f32>, Shape)> {
    let (y, g) = cpu_forward(p, xs, xl, ws, wl)?;
    Ok((y, g.out_shape()))
}

/// The gradients of the input and the weight (each only when it is in the autograd graph;
/// inside [`crate::backward`] the weight's goes to the store directly).
pub(crate) fn backward(
    p: ConvParams,
    x: &Tensor,
    w: &Tensor,
    gy: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda_backward(cudnn_spec(p), x, w, gy);
    }
    let g = Geometry::new(x.dims(), w.dims(), p)?;
    let gy = gy.contiguous()?;
    if let Some(d) = g.winograd() {
        let (want_gw, want_gx) = (w.track_op(), x.track_op());
        // A "same" convolution's input gradient is the "same" convolution of `gy` by the
        // flipped, transposed filters: where im2col computes that forward faster than
        // Winograd (thin layers, a cached im2col buffer), it computes the gradient too
        // (ResNet-18's 16-channel stage at batch 32, forward + input gradient: 3.35–4.11 →
        // 2.73–3.37 ms).
        let adjoint = Geometry { c: g.o, o: g.c, ..g };
        let by_forward = want_gx && adjoint.im2col_forward_is_ahead();
        let (gw, gx) = with_f32_slice(x, |xs| {
            with_f32_slice(w, |ws| {
                with_f32_slice(&gy, |gys| {
                    let (gw, gx) =
                        winograd::backward(&d, xs, ws, gys, want_gw, want_gx && !by_forward);
                    let gx = if by_forward {
                        Some(forward(&adjoint, gys, &flipped_transposed(&g, ws)))
                    } else {
                        gx
                    };
                    (gw, gx)
                })
            })
        })???;
        let gw = gw.map(|v| Tensor::from_vec(v, w.shape(), w.device())).transpose()?;
        let gx = gx.map(|v| Tensor::from_vec(v, x.shape(), x.device())).transpose()?;
        return Ok((gx, take_param_grad(w, gw)?));
    }
    let gw = if w.track_op() {
        let v = with_f32_slice(x, |x| with_f32_slice(&gy, |gy| weight_grad(&g, x, gy)))??;
        Some(Tensor::from_vec(v, w.shape(), w.device())?)
    } else {
        None
    };
    let gx = if x.track_op() {
        let v = with_f32_slice(w, |w| with_f32_slice(&gy, |gy| input_grad(&g, w, gy)))??;
        Some(Tensor::from_vec(v, x.shape(), x.device())?)
    } else {
        None
    };
    Ok((gx, take_param_grad(w, gw)?))
}

/// cuDNN's description of an ungrouped convolution.
#[cfg(feature = "cuda")]
fn cudnn_spec(p: ConvParams) -> tandem_cuda::cudnn::ConvSpec {
    tandem_cuda::cudnn::ConvSpec {
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
        groups: 1,
    }
}

/// The gradients of a convolution (grouped or not) on the GPU, through cuDNN (each only when
/// it is in the autograd graph; the weight's goes to [`crate::backward`]'s store when inside it).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_backward(
    spec: tandem_cuda::cudnn::ConvSpec,
    x: &Tensor,
    w: &Tensor,
    gy: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    use tandem_cuda::cudnn::{backward_data, backward_filter};
    let gy = gy.to_dtype(x.dtype())?;
    let gx = x.track_op().then(|| backward_data(&gy, w, x.dims(), spec)).transpose()?;
    let gw = w.track_op().then(|| backward_filter(x, &gy, w.dims(), spec)).transpose()?;
    Ok((gx, take_param_grad(w, gw)?))
}

/// Whether a convolution of `x` by `w` runs through cuDNN: both on a GPU in one float dtype,
/// in a `cuda` build, unless `TANDEM_CUDNN=0` asks for candle's convolution.
pub(crate) fn takes_cudnn(x: &Tensor, w: &Tensor) -> bool {
    use candle_core::DType;
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && x.dtype() == w.dtype()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && cudnn_enabled()
}

#[cfg(feature = "cuda")]
fn cudnn_enabled() -> bool {
    tandem_cuda::cudnn::enabled()
}

#[cfg(not(feature = "cuda"))]
fn cudnn_enabled() -> bool {
    false
}

/// The convolution as a custom op: tandem's CPU kernels, or cuDNN on a GPU.
struct Conv2dOp(ConvParams);

impl CustomOp2 for Conv2dOp {
    fn name(&self) -> &'static str {
        "tandem-conv2d"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, g) = cpu_forward(self.0, xs, xl, ws, wl)?;
        Ok((CpuStorage::F32(y), g.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        tandem_cuda::cudnn::forward((xs, xl), (ws, wl), cudnn_spec(self.0))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        backward(self.0, x, w, gy)
    }
}

/// The convolution and its per-channel bias in one op: the bias is added to the output as it
/// is made, and backward hands candle one gradient for the input (a separate bias op's
/// backward gave the convolution's output a gradient of its own, which candle copies into a
/// zeroed accumulator).
struct Conv2dBiasOp(ConvParams);

impl CustomOp3 for Conv2dBiasOp {
    fn name(&self) -> &'static str {
        "tandem-conv2d-bias"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (mut y, g) = cpu_forward(self.0, xs, xl, ws, wl)?;
        let b = contiguous_f32(bs, bl, "conv2d", "bias")?;
        if b.len() != g.o {
            candle_core::bail!("tandem conv2d: {} bias values for {} output channels", b.len(), g.o)
        }
        add_per_plane(&mut y, b, g.ho * g.wo);
        Ok((CpuStorage::F32(y), g.out_shape()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gx, gw) = backward(self.0, x, w, gy)?;
        let gb = b.track_op().then(|| channel_sums(gy)).transpose()?;
        Ok((gx, gw, take_param_grad(b, gb)?))
    }
}

/// `y[plane] += b[plane % C]` for each `plane_len`-long plane of `[N, C, H, W]`.
fn add_per_plane(y: &mut [f32], b: &[f32], plane_len: usize) {
    let c = b.len();
    y.par_chunks_mut(plane_len).enumerate().for_each(|(plane, o)| {
        let v = b[plane % c];
        o.iter_mut().for_each(|x| *x += v);
    });
}

/// The per-channel sums of `g: [N, C, H, W]` (`[C]`), each accumulated in f64 in order.
fn channel_sums(g: &Tensor) -> candle_core::Result<Tensor> {
    let (_, c, h, w) = g.dims4()?;
    let sums = with_f32_slice(&g.contiguous()?, |g| {
        let mut sums = vec![0f64; c];
        for (plane, values) in g.chunks(h * w).enumerate() {
            sums[plane % c] += values.iter().map(|&v| v as f64).sum::<f64>();
        }
        sums.into_iter().map(|s| s as f32).collect::<Vec<f32>>()
    })?;
    Tensor::from_vec(sums, c, g.device())
}

/// `torch.nn.functional.conv2d(x, w, stride, padding, dilation)` (no bias, groups 1) with the
/// kernels above on CPU f32 tensors, through cuDNN on a GPU (`cuda` builds); other dtypes use
/// candle's convolution.
pub fn conv2d(x: &Tensor, w: &Tensor, p: ConvParams) -> candle_core::Result<Tensor> {
    let cpu_f32 = x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && w.dtype() == candle_core::DType::F32;
    if cpu_f32 || takes_cudnn(x, w) {
        x.contiguous()?.apply_op2(&w.contiguous()?, Conv2dOp(p))
    } else {
        x.conv2d(w, p.padding, p.stride, p.dilation, 1)
    }
}

/// `torch.nn.functional.conv2d(x, w, b, stride, padding, dilation)` (groups 1): [`conv2d`] with
/// the per-channel bias `b: [O]` added in the same op on CPU f32 tensors; elsewhere candle's
/// convolution and a broadcast add.
pub fn conv2d_bias(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    p: ConvParams,
) -> candle_core::Result<Tensor> {
    if x.device().is_cpu()
        && x.dtype() == candle_core::DType::F32
        && w.dtype() == candle_core::DType::F32
        && b.dtype() == candle_core::DType::F32
    {
        x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, Conv2dBiasOp(p))
    } else {
        add_channel_bias(&conv2d(x, w, p)?, b)
    }
}

/// `y + b` over the channels of `y: [N, C, H, W]` (`b: [C]`), whose backward sums the
/// gradient per channel in one contiguous pass — candle's broadcast-add backward reduces over
/// the non-contiguous dimensions (0, 2, 3), slower than the convolution it follows.
struct ChannelBias;

impl CustomOp2 for ChannelBias {
    fn name(&self) -> &'static str {
        "tandem-channel-bias"
    }

    fn cpu_fwd(
        &self,
        ys: &CpuStorage,
        yl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(y), CpuStorage::F32(b), Some((ya, yb)), Some((ba, bb))) =
            (ys, bs, yl.contiguous_offsets(), bl.contiguous_offsets())
        else {
            candle_core::bail!("channel bias: contiguous f32 operands only")
        };
        let (y, b) = (&y[ya..yb], &b[ba..bb]);
        let &[_, c, h, w] = yl.dims() else {
            candle_core::bail!("channel bias: expected [N, C, H, W], got {:?}", yl.dims())
        };
        if b.len() != c {
            candle_core::bail!("channel bias: {} values for {c} channels", b.len())
        }
        let mut out = y.to_vec();
        add_per_plane(&mut out, b, h * w);
        Ok((CpuStorage::F32(out), yl.shape().clone()))
    }

    fn bwd(
        &self,
        y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let gb = b.track_op().then(|| channel_sums(g)).transpose()?;
        Ok((y.track_op().then(|| g.clone()), take_param_grad(b, gb)?))
    }
}

/// Adds a per-channel bias to `y: [N, C, H, W]` (see `ChannelBias`).
pub fn add_channel_bias(y: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if y.device().is_cpu()
        && y.dtype() == candle_core::DType::F32
        && b.dtype() == candle_core::DType::F32
    {
        y.contiguous()?.apply_op2(&b.contiguous()?, ChannelBias)
    } else {
        y.broadcast_add(&b.reshape((1, b.elem_count(), 1, 1))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The convolution with its bias in one op equals the convolution then the bias op, in value
    /// and in the gradients of input, weight and bias, bit for bit — on the Winograd path
    /// (3x3, 8+ channels) and the im2col one — and a bias of the wrong length is an error.
    #[test]
    fn conv_with_bias_equals_conv_then_bias() {
        let dev = candle_core::Device::Cpu;
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        for (c, o, k, stride) in [(8, 8, 3, 1), (3, 5, 3, 2), (4, 6, 1, 1)] {
            let p = ConvParams { stride, padding: k / 2, dilation: 1 };
            let x = candle_core::Var::randn(0f32, 1.0, (2, c, 9, 9), &dev).unwrap();
            let w = candle_core::Var::randn(0f32, 0.3, (o, c, k, k), &dev).unwrap();
            let b = candle_core::Var::randn(0f32, 0.3, o, &dev).unwrap();
            let fused = conv2d_bias(&x, &w, &b, p).unwrap();
            let apart = add_channel_bias(&conv2d(&x, &w, p).unwrap(), &b).unwrap();
            assert_eq!(bits(&fused), bits(&apart), "c {c} o {o} k {k}: values");
            let r = Tensor::randn(0f32, 1.0, fused.shape(), &dev).unwrap();
            let gf = (&fused * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let ga = (&apart * &r).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, v) in [("input", &x), ("weight", &w), ("bias", &b)] {
                let (f, a) = (gf.get(v.as_tensor()).unwrap(), ga.get(v.as_tensor()).unwrap());
                assert_eq!(bits(f), bits(a), "c {c} o {o} k {k}: {name} gradient");
            }
        }
        let x = Tensor::randn(0f32, 1.0, (1, 2, 5, 5), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 2, 3, 3), &dev).unwrap();
        let b = Tensor::zeros(4, candle_core::DType::F32, &dev).unwrap();
        let p = ConvParams { stride: 1, padding: 1, dilation: 1 };
        let err = conv2d_bias(&x, &w, &b, p).unwrap_err().to_string();
        assert!(err.contains("4 bias values for 3 output channels"), "{err}");
    }

    /// The block-copy im2col equals the line-by-line one on every same-size stride-1 geometry
    /// (kernel 1, 3, 5; maps down to 1x1 and non-square; several channels).
    #[test]
    fn shifted_im2col_equals_the_line_by_line_one() {
        for (c, h, w, k) in [
            (2, 8, 8, 3),
            (3, 4, 4, 3),
            (1, 1, 1, 3),
            (2, 5, 7, 3),
            (1, 6, 3, 5),
            (2, 3, 3, 1),
            (1, 2, 9, 5),
        ] {
            let p = ConvParams { stride: 1, padding: k / 2, dilation: 1 };
            let g = Geometry::new(&[1, c, h, w], &[1, c, k, k], p).unwrap();
            assert!(g.is_same_size_stride_1());
            let image: Vec<f32> = (0..c * h * w).map(|i| i as f32 + 1.0).collect();
            let rows = g.k() * g.pixels();
            let (mut a, mut b) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            g.im2col_shifted(&image, &mut a, g.pixels());
            g.im2col_lines(&image, &mut b, g.pixels());
            assert_eq!(a, b, "c {c} h {h} w {w} k {k}");
        }
    }

    /// The tap-table gather and scatter equal the line-by-line loops, bit for bit, on strided,
    /// padded and dilated geometries (taps in the padding included), with rows spaced wider
    /// than one image's pixels as the whole-batch path lays them out.
    #[test]
    fn tap_table_equals_the_line_by_line_loops() {
        for (c, h, w, k, stride, padding, dilation) in [
            (2, 8, 8, 3, 2, 1, 1),
            (3, 7, 5, 3, 2, 1, 1),
            (1, 9, 9, 3, 3, 2, 1),
            (2, 6, 6, 1, 2, 0, 1),
            (1, 10, 7, 3, 1, 2, 2),
            (2, 5, 5, 5, 2, 2, 1),
            (1, 3, 3, 3, 1, 0, 1),
        ] {
            let p = ConvParams { stride, padding, dilation };
            let g = Geometry::new(&[1, c, h, w], &[1, c, k, k], p).unwrap();
            let case = format!("c {c} {h}x{w} k {k} stride {stride} pad {padding} dil {dilation}");
            let image: Vec<f32> = (0..c * h * w).map(|i| i as f32 * 0.37 + 1.0).collect();
            let row_stride = g.pixels() + 3;
            let len = g.k() * row_stride;
            let (mut a, mut b) = (vec![f32::NAN; len], vec![f32::NAN; len]);
            g.im2col_taps(&image, &mut a, row_stride);
            g.im2col_lines(&image, &mut b, row_stride);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "im2col, {case}");
            let col: Vec<f32> = (0..len).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
            let (mut ga, mut gb) = (vec![0f32; c * h * w], vec![0f32; c * h * w]);
            g.col2im_taps(&col, &mut ga, row_stride);
            g.col2im_lines(&col, &mut gb, row_stride);
            assert_eq!(bits(&ga), bits(&gb), "col2im, {case}");
        }
    }
}
