//! 3x3, stride-1, padding-1 convolutions — the "same"-size convolutions that make up nearly all
//! of a ResNet's or an IResNet's work — by Winograd's minimal filtering F(m x m, 3x3) (Lavin and
//! Gray, "Fast Algorithms for Convolutional Neural Networks", 2015), forward and both gradients,
//! with 2x2 or 4x4 output tiles (`tiles`).
//!
//! Why: im2col + gemm spends 9 multiply-adds per input channel and output pixel, and on small
//! maps the gemm's packing of the 9x larger im2col matrix costs as much again. F(2x2, 3x3) makes
//! each 2x2 output tile from a 4x4 input tile with 16 products per channel pair (4 per pixel),
//! F(4x4, 3x3) each 4x4 tile from a 6x6 one with 36 (2.25 per pixel), as 16 or 36 independent
//! gemms in the transformed domain. The larger tile makes fewer products and moves less
//! transformed data per pixel, but its transformed weights are 4x the weights (1.8x for the
//! smaller) and its tiles hang further over an edge that is not a multiple of 4: `plan`
//! picks per layer. The backward passes are the exact adjoints of the forward's linear
//! maps, so they are the same gemms transposed:
//!
//! ```text
//! forward   U = G·g·Gᵀ   V_t = Bᵀ·d_t·B   M[ξ] = V[ξ]·U[ξ]ᵀ   y_t = Aᵀ·M_t·A
//! backward  gM_t = A·gy_t·Aᵀ
//!           gU[ξ] = Σ_t gM[ξ]ᵀ·V[ξ]   gg = Gᵀ·gU·G
//!           gV[ξ] = gM[ξ]·U[ξ]        gd_t = B·gV_t·Bᵀ, added onto the overlapping input tiles
//! ```
//!
//! Layout: ξ (the positions of a transformed tile) outermost, then tiles, then channels:
//! V `[ξ][T][C]`, M `[ξ][T][O]`, T the tiles of a block (a run of tile rows, about
//! `BLOCK_VALUES` / ξ / channels tiles, so that a block's buffers stay near the cache).
//! Channels innermost make every transform a sequence of operations on `LANES` channels at
//! once (the images are turned channels-innermost a band of rows at a time), and give each of
//! the three gemms operands that `gemm` packs at full speed (an operand whose reduced
//! dimension is contiguous in both factors packs at half speed: measured 42 vs 110 GFLOP/s on
//! a 64x64x512 product).
//! The images are split into one group per rayon thread; each group's blocks run in order on
//! that thread; a single group runs its gemms on all threads.
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use rayon::prelude::*;

use super::matmul::{matmul, View};
use super::zeroed;
use crate::vectorized_kernel;

mod tiles;
use tiles::{Tile, TileBackward, F2, F4};

/// Channels a transform handles at once (one 64-byte line of a tile's channels).
const LANES: usize = 16;

/// One value for each of `LANES` channels.
type Lanes = [f32; LANES];

/// The most positions a transformed tile has (F(4x4, 3x3)'s 6x6): the size of the tile
/// buffers on the stack, of which a tile size uses the first `Tile::XI`.
const MAX_XI: usize = 36;

/// The distance between the matrices of a transformed block of `len` values: a cache line
/// more than `len`, so that the streams a transform writes (or reads) at once do not all fall
/// into the same cache set whenever `len` is a multiple of 4 KiB.
fn xi_stride(len: usize) -> usize {
    len + LANES
}

/// Values of a block's transformed tiles (ξ positions x tiles x the wider of its input and
/// output channel counts): enough tiles for the gemms to run at full speed and to pay for their
/// call overhead, few enough that a block's transformed tiles (1 MiB) stay near the cache.
const BLOCK_VALUES: usize = 16 * 128 * 128;

/// The fewest input (and output) channels for which the Winograd path is taken: with fewer, the
/// gemms are too thin and the transforms dominate (the 3-channel stem of an image net).
/// Settable only so tests can run every eligible shape through both paths.
#[doc(hidden)]
pub static MIN_CHANNELS: AtomicUsize = AtomicUsize::new(8);

/// The output tile's side every Winograd convolution takes (2 or 4), or 0: the side `plan`
/// picks. Settable only so tests and benchmarks can run a shape through
/// either.
#[doc(hidden)]
pub static TILE_SIDE: AtomicUsize = AtomicUsize::new(0);

/// The output tile: F(2x2, 3x3) or F(4x4, 3x3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TileSize {
    F2,
    F4,
}

impl TileSize {
    /// Outputs along a tile's side.
    fn m(self) -> usize {
        match self {
            TileSize::F2 => F2::M,
            TileSize::F4 => F4::M,
        }
    }

    /// Positions of a transformed tile.
    fn xi(self) -> usize {
        match self {
            TileSize::F2 => F2::XI,
            TileSize::F4 => F4::XI,
        }
    }

    /// The transformed values per channel of an `h x w` map.
    fn values(self, h: usize, w: usize) -> usize {
        self.xi() * h.div_ceil(self.m()) * w.div_ceil(self.m())
    }

    /// The tiles to try for an `h x w` map, in order: 4x4 first where its tiles make at most
    /// 60% of the transformed values 2x2 tiles make (56% where both cover the map alike: 8x8,
    /// 28x28, 56x56), then 2x2. On IResNet's 14x14 maps (16 4x4 tiles, 576 values, against 49
    /// 2x2 ones, 784) the larger tile's costlier transforms and weights ate its saving: the
    /// 256-channel layer at batch 8 took 14.2 ms forward and 30.4 backward with 4x4 tiles
    /// against 13.0 and 24.9 with 2x2 (`conv_strategies`, one thread, in-process turns).
    fn candidates(h: usize, w: usize) -> &'static [TileSize] {
        match TILE_SIDE.load(Ordering::Relaxed) {
            2 => &[TileSize::F2],
            4 => &[TileSize::F4],
            _ if 10 * TileSize::F4.values(h, w) <= 6 * TileSize::F2.values(h, w) => {
                &[TileSize::F4, TileSize::F2]
            }
            _ => &[TileSize::F2],
        }
    }
}

/// Dispatches `$f::<T>(args)` on the tile size `$tile`.
macro_rules! by_tile {
    ($tile:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $tile {
            TileSize::F2 => $f::<F2>($($arg),*),
            TileSize::F4 => $f::<F4>($($arg),*),
        }
    };
}

/// The shape of one convolution: input `[n, c, h, w]`, weight `[o, c, 3, 3]`, output
/// `[n, o, h, w]`, and the tile it is computed by.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub tile: TileSize,
}

impl Dims {
    /// Tile rows and columns (the last ones hang over an edge that is not a multiple of the
    /// tile's side).
    fn tiles_hw(&self) -> (usize, usize) {
        let m = self.tile.m();
        (self.h.div_ceil(m), self.w.div_ceil(m))
    }

    fn image_len(&self) -> usize {
        self.c * self.h * self.w
    }

    fn out_len(&self) -> usize {
        self.o * self.h * self.w
    }

    /// Columns of a padded band row: one left of the image, the rest right of it up to the
    /// last tile's edge (`m·tw + 2`).
    fn band_width(&self) -> usize {
        self.tile.m() * self.tiles_hw().1 + 2
    }

    /// Images per group for `threads` threads.
    fn images_per_group(&self, threads: usize) -> usize {
        if threads > 1 && self.n >= threads {
            self.n.div_ceil(threads)
        } else {
            self.n.max(1)
        }
    }

    /// The blocks of a group of `images`: runs of tile rows, numbered through the group
    /// (row `g` is tile row `g % th` of image `g / th`).
    fn blocks(&self, images: usize) -> impl Iterator<Item = Range<usize>> {
        let (th, tw) = self.tiles_hw();
        let rows = images * th;
        let tiles = BLOCK_VALUES / self.tile.xi() / self.c.max(self.o).max(1);
        let per_block = tiles.div_ceil(tw).max(1);
        (0..rows).step_by(per_block).map(move |g| g..(g + per_block).min(rows))
    }
}

/// How `conv2d` computes a convolution through this module, if it does: 3x3, stride 1,
/// padding 1, dilation 1, enough channels on both sides (see [`MIN_CHANNELS`]), fewer products
/// than im2col's, and transformed weights no larger than the transformed tiles (see
/// [`WEIGHTS_DECIDE`]). `input` is `[N, C, H, W]`.
pub(super) fn plan(
    kernel: (usize, usize),
    (stride, padding, dilation): (usize, usize, usize),
    input: [usize; 4],
    o: usize,
) -> Option<Dims> {
    let [n, c, h, w] = input;
    let min = MIN_CHANNELS.load(Ordering::Relaxed);
    let shape = kernel == (3, 3) && stride == 1 && padding == 1 && dilation == 1;
    if !shape || c < min || o < min {
        return None;
    }
    // Each tile's transformed weights against its transformed tiles (see WEIGHTS_DECIDE); the
    // 4x4 tile's at most half of them, as its weights are 4x the weights, not 1.8x: where they
    // were as many (CIFAR ResNet-18's 256-channel 8x8 layers at batch 32) 4x4 tiles ran no
    // faster than 2x2 ones, where they were more (its 128-channel 4x4 layers) slower.
    let weights_decide = WEIGHTS_DECIDE.load(Ordering::Relaxed);
    TileSize::candidates(h, w).iter().map(|&tile| Dims { n, c, h, w, o, tile }).find(|d| {
        let (th, tw) = d.tiles_hw();
        let tiles = n * th * tw * (c + o);
        let weights = match d.tile {
            TileSize::F2 => c * o,
            TileSize::F4 => 2 * c * o,
        };
        let fewer_products = d.tile.values(h, w) < 9 * h * w;
        fewer_products && !(weights_decide && weights > tiles)
    })
}

/// Whether `conv2d` computes a convolution through this module (see `plan`).
pub fn applies(
    kernel: (usize, usize),
    params: (usize, usize, usize),
    input: [usize; 4],
    o: usize,
) -> bool {
    plan(kernel, params, input, o).is_some()
}

/// The output tile's side `conv2d` takes for a convolution through this module (see
/// `plan`): 2 or 4.
pub fn tile_side(
    kernel: (usize, usize),
    params: (usize, usize, usize),
    input: [usize; 4],
    o: usize,
) -> Option<usize> {
    plan(kernel, params, input, o).map(|d| d.tile.m())
}

/// Whether a layer whose weights outweigh its activations is left to im2col: where the
/// transformed filters of every channel pair (made twice a step, gathered back once, and
/// repacked by every block's gemms) outnumber the transformed input and output tiles, they cost
/// more than Winograd's fewer products save. IResNet-50's 512-channel 7x7 layers at batch 8
/// (transformed weights twice the tiles, with 2x2 tiles): Winograd's forward and both gradients
/// ran at 0.52–1.08x (median 0.75x) of im2col's speed in ten same-run pairs; ResNet-18's
/// 128-channel 4x4 layers at batch 32 (half the tiles) at 1.73x. Settable only so tests can
/// run every eligible shape through both paths.
#[doc(hidden)]
pub static WEIGHTS_DECIDE: AtomicBool = AtomicBool::new(true);

fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// Channel runs `(first, count)` of at most `LANES` channels.
fn lane_runs(channels: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..channels).step_by(LANES).map(move |c0| (c0, LANES.min(channels - c0)))
}

/// Writes `count` lanes of each value of a tile to `dst[at(ξ)..]`.
#[inline(always)]
fn store_tile(dst: &mut [f32], out: &[Lanes], count: usize, at: impl Fn(usize) -> usize) {
    for (xi, value) in out.iter().enumerate() {
        if count == LANES {
            dst[at(xi)..at(xi) + LANES].copy_from_slice(value);
        } else {
            dst[at(xi)..at(xi) + count].copy_from_slice(&value[..count]);
        }
    }
}

/// Reads `count` lanes of each value of a tile from `src[at(ξ)..]` (the other lanes are left
/// as they are).
#[inline(always)]
fn load_tile(src: &[f32], tile: &mut [Lanes], count: usize, at: impl Fn(usize) -> usize) {
    for (xi, value) in tile.iter_mut().enumerate() {
        if count == LANES {
            value.copy_from_slice(&src[at(xi)..at(xi) + LANES]);
        } else {
            value[..count].copy_from_slice(&src[at(xi)..at(xi) + count]);
        }
    }
}

/// Filters transformed (or gathered back) per chunk: a run of this many contiguous values per
/// position and chunk instead of a write per position and filter, each far from the last (the
/// weights of a 512-channel layer outweigh its 7x7 activations).
const FILTER_CHUNK: usize = 16;

/// How the transformed weights are laid out.
#[derive(Clone, Copy)]
enum WeightLayout {
    /// `U[ξ][o][c]`: the input gradient's right operand.
    OutputMajor,
    /// `U[ξ][c][o]`: the forward's right operand.
    InputMajor,
}

/// `U = G·g·Gᵀ` for every 3x3 filter `g = w[o][c]`, in `layout`; the rows of the layout's
/// outer index in parallel (serial, this was 7% of a ResNet-18 step at width 64). The
/// transformed weights are 1.8x (2x2 tiles) or 4x (4x4) the weights and made twice a step
/// (forward and input gradient): written without a memset first, `LANES` filters at a time (a
/// filter at a time, this was 10% of an IResNet-50 step at batch 8, most of it in its deep
/// 512-channel layers).
fn transform_weights(d: &Dims, w: &[f32], layout: WeightLayout) -> Vec<f32> {
    let (o_n, c_n, xi_n) = (d.o, d.c, d.tile.xi());
    let oc_n = o_n * c_n;
    let mut u: Vec<f32> = Vec::with_capacity(xi_n * oc_n);
    // A row is the filters of one outer index: one o (output-major, c inner) or one c
    // (input-major, o inner); it is written at the same offset of each plane.
    let (outer, inner) = match layout {
        WeightLayout::OutputMajor => (o_n, c_n),
        WeightLayout::InputMajor => (c_n, o_n),
    };
    let mut rows: Vec<Vec<&mut [MaybeUninit<f32>]>> =
        (0..outer).map(|_| Vec::with_capacity(xi_n)).collect();
    for plane in u.spare_capacity_mut()[..xi_n * oc_n].chunks_mut(oc_n.max(1)) {
        for (row, part) in rows.iter_mut().zip(plane.chunks_mut(inner.max(1))) {
            row.push(part);
        }
    }
    rows.into_par_iter().enumerate().for_each(|(a, mut row)| {
        by_tile!(d.tile, transform_weight_row(w, (a, c_n, inner), layout, &mut row));
    });
    // SAFETY: the capacity is xi_n·oc_n, and the xi_n planes of oc_n values are the `outer`
    // rows of `inner` values each, every one of which `transform_weight_row` wrote whole.
    unsafe { u.set_len(xi_n * oc_n) };
    u
}

vectorized_kernel! {
    /// Row `a` of [`transform_weights`]: its `inner` filters into `row[ξ][..inner]` for tile
    /// `T`, `LANES` filters at a time (one run of contiguous writes per position instead of
    /// scattered writes per filter, and the transform's arithmetic in vector registers).
    fn transform_weight_row<T: Tile>(
        w: &[f32],
        (a, c_n, inner): (usize, usize, usize),
        layout: WeightLayout,
        row: &mut [&mut [MaybeUninit<f32>]],
    ) {
        let mut g = [[0f32; LANES]; 9];
        let mut u = [[0f32; LANES]; MAX_XI];
        let u = &mut u[..T::XI];
        for b0 in (0..inner).step_by(LANES) {
            let len = LANES.min(inner - b0);
            for (f, b) in (b0..b0 + len).enumerate() {
                let (o, c) = match layout {
                    WeightLayout::OutputMajor => (a, b),
                    WeightLayout::InputMajor => (b, a),
                };
                for (k, value) in w[(o * c_n + c) * 9..][..9].iter().enumerate() {
                    g[k][f] = *value;
                }
            }
            T::transform_filters(&g, u);
            for (dst, values) in row.iter_mut().zip(u.iter()) {
                for (d, v) in dst[b0..b0 + len].iter_mut().zip(values) {
                    d.write(*v);
                }
            }
        }
    }
}

/// `gg = Gᵀ·gU·G` for every filter, from `gU[ξ][o][c]`, into `[o][c][3][3]`, chunks of
/// filters in parallel.
fn inverse_transform_weights(d: &Dims, gu: &[f32]) -> Vec<f32> {
    let oc_n = d.o * d.c;
    let mut gw = vec![0f32; oc_n * 9];
    gw.par_chunks_mut(9 * FILTER_CHUNK).enumerate().for_each(|(ci, filters)| {
        inverse_transform_filters::<F2>(gu, oc_n, ci * FILTER_CHUNK, filters);
    });
    gw
}

vectorized_kernel! {
    /// The filters `start..` of [`inverse_transform_weights`] into `filters` (9 values each).
    fn inverse_transform_filters<T: TileBackward>(
        gu: &[f32],
        oc_n: usize,
        start: usize,
        filters: &mut [f32],
    ) {
        let len = filters.len() / 9;
        let mut chunk = [[0f32; FILTER_CHUNK]; MAX_XI];
        for (xi, values) in chunk[..T::XI].iter_mut().enumerate() {
            values[..len].copy_from_slice(&gu[xi * oc_n + start..][..len]);
        }
        for (f, g) in filters.chunks_exact_mut(9).enumerate() {
            g.copy_from_slice(&T::inverse_filter(|xi| chunk[xi][f]));
        }
    }
}

/// Which channels and tiles of a group a band covers.
#[derive(Clone, Copy)]
struct Run {
    /// The first channel and how many (at most `LANES`).
    c0: usize,
    count: usize,
}

#[inline(always)]
fn transpose4(a: [[f32; 4]; 4]) -> [[f32; 4]; 4] {
    std::array::from_fn(|q| std::array::from_fn(|r| a[r][q]))
}

/// Image row `row` of channels `run.c0 + l0 ..` (at most four) of image `n` of `x`
/// (`channels` planes of `h·w` per image).
#[inline(always)]
fn channel_rows<'a>(
    x: &'a [f32],
    d: &Dims,
    (channels, n, run): (usize, usize, Run),
    l0: usize,
    row: usize,
) -> [Option<&'a [f32]>; 4] {
    let (h, w) = (d.h, d.w);
    std::array::from_fn(|r| {
        let l = l0 + r;
        (l < run.count).then(|| &x[((n * channels + run.c0 + l) * h + row) * w..][..w])
    })
}

/// Writes image row `row` (any index; rows outside the image read as zeros) of channels
/// `run` of image `n` of `x` (planes of `h·w`, `channels` per image) into a band row,
/// channels innermost, image column `x` at band column `x + 1` — by 4x4 transposes, so that
/// the band is written (and then read) in whole vectors.
#[inline(always)]
fn gather_row(
    x: &[f32],
    d: &Dims,
    (channels, n, run): (usize, usize, Run),
    row: isize,
    band_row: &mut [f32],
) {
    band_row.fill(0.0);
    if row < 0 || row as usize >= d.h {
        return;
    }
    let w = d.w;
    for l0 in (0..run.count).step_by(4) {
        let rows = channel_rows(x, d, (channels, n, run), l0, row as usize);
        let mut col = 0;
        while col + 4 <= w {
            let quad: [[f32; 4]; 4] = std::array::from_fn(|r| {
                rows[r].map_or([0.0; 4], |src| src[col..col + 4].try_into().expect("4 values"))
            });
            for (q, values) in transpose4(quad).iter().enumerate() {
                band_row[(col + q + 1) * LANES + l0..][..4].copy_from_slice(values);
            }
            col += 4;
        }
        for col in col..w {
            for (r, src) in rows.iter().enumerate() {
                if let Some(src) = src {
                    band_row[(col + 1) * LANES + l0 + r] = src[col];
                }
            }
        }
    }
}

/// Adds a band row (image column `x` at band column `x + 1`) onto image row `row` of channels
/// `run` of image `n` of `x`; rows outside the image are dropped.
#[inline(always)]
fn scatter_add_row(
    x: &mut [f32],
    d: &Dims,
    (channels, n, run): (usize, usize, Run),
    row: isize,
    band_row: &[f32],
) {
    if row >= 0 && (row as usize) < d.h {
        band_to_row(x, d, (channels, n, run), row as usize, band_row, |dst, v| *dst += v);
    }
}

/// Writes a band row (image column `x` at band column `x + 1`) as image row `row` of channels
/// `run` of image `n` of `y`.
#[inline(always)]
fn write_row(
    y: &mut [f32],
    d: &Dims,
    (channels, n, run): (usize, usize, Run),
    row: usize,
    band_row: &[f32],
) {
    band_to_row(y, d, (channels, n, run), row, band_row, |dst, v| *dst = v);
}

/// Combines a band row into image row `row` of channels `run` of image `n` of `x` with `put`,
/// by 4x4 transposes.
#[inline(always)]
fn band_to_row(
    x: &mut [f32],
    d: &Dims,
    (channels, n, run): (usize, usize, Run),
    row: usize,
    band_row: &[f32],
    put: impl Fn(&mut f32, f32),
) {
    let (h, w) = (d.h, d.w);
    for l0 in (0..run.count).step_by(4) {
        let lanes = 4.min(run.count - l0);
        let start = |r: usize| ((n * channels + run.c0 + l0 + r) * h + row) * w;
        let mut col = 0;
        while col + 4 <= w {
            let quad: [[f32; 4]; 4] = std::array::from_fn(|q| {
                band_row[(col + q + 1) * LANES + l0..][..4].try_into().expect("4 values")
            });
            for (r, values) in transpose4(quad).iter().enumerate().take(lanes) {
                let dst = &mut x[start(r) + col..][..4];
                dst.iter_mut().zip(values).for_each(|(d, &v)| put(d, v));
            }
            col += 4;
        }
        for r in 0..lanes {
            let dst = &mut x[start(r)..][..w];
            for (c, v) in dst.iter_mut().enumerate().skip(col) {
                put(v, band_row[(c + 1) * LANES + l0 + r]);
            }
        }
    }
}

vectorized_kernel! {
    /// `V_t = Bᵀ·d_t·B` for the tile rows `rows` of the group `x`, into `V[ξ][t][c]`.
    fn transform_input<T: Tile>(
        d: &Dims,
        x: &[f32],
        rows: Range<usize>,
        v: &mut [f32],
        band: &mut Vec<f32>,
    ) {
        let (th, tw) = d.tiles_hw();
        let c_n = d.c;
        let row_len = d.band_width() * LANES;
        let sv = xi_stride(rows.len() * tw * c_n);
        band.resize(T::ALPHA * row_len, 0.0);
        let mut out = [[0f32; LANES]; MAX_XI];
        let out = &mut out[..T::XI];
        for (c0, count) in lane_runs(c_n) {
            let run = Run { c0, count };
            let mut previous: Option<usize> = None;
            for (local, g) in rows.clone().enumerate() {
                let (n, i) = (g / th, g % th);
                // Padded rows m·i .. m·i + α are image rows m·i − 1 .. m·i + α − 1; the last two of
                // the previous tile row are this one's first two.
                let first_new = if i > 0 && previous == Some(g - 1) {
                    band.copy_within(T::M * row_len..T::ALPHA * row_len, 0);
                    T::ALPHA - T::M
                } else {
                    0
                };
                for k in first_new..T::ALPHA {
                    let row = (T::M * i + k) as isize - 1;
                    let band_row = &mut band[k * row_len..(k + 1) * row_len];
                    gather_row(x, d, (c_n, n, run), row, band_row);
                }
                previous = Some(g);
                for j in 0..tw {
                    T::input_tile(band, row_len, T::M * j, out);
                    let t = local * tw + j;
                    store_tile(v, out, count, |xi| xi * sv + t * c_n + c0);
                }
            }
        }
    }
}

vectorized_kernel! {
    /// `y_t = Aᵀ·M_t·A` for the tile rows `rows` of the group `y`, from `M[ξ][t][o]`, cropping
    /// tiles that hang over the edge.
    fn transform_output<T: Tile>(
        d: &Dims,
        m: &[f32],
        rows: Range<usize>,
        y: &mut [f32],
        band: &mut Vec<f32>,
    ) {
        let (th, tw) = d.tiles_hw();
        let o_n = d.o;
        let row_len = d.band_width() * LANES;
        let sm = xi_stride(rows.len() * tw * o_n);
        band.resize(T::M * row_len, 0.0);
        let mut mt = [[0f32; LANES]; MAX_XI];
        let mt = &mut mt[..T::XI];
        for (o0, count) in lane_runs(o_n) {
            let run = Run { c0: o0, count };
            for (local, g) in rows.clone().enumerate() {
                let (n, i) = (g / th, g % th);
                for j in 0..tw {
                    let t = local * tw + j;
                    load_tile(m, mt, count, |xi| xi * sm + t * o_n + o0);
                    // Band column x + 1 holds image column x (the same layout as the inputs').
                    T::output_tile(mt, band, row_len, T::M * j + 1);
                }
                for (r, out) in band.chunks_exact(row_len).enumerate() {
                    let row = T::M * i + r;
                    if row < d.h {
                        write_row(y, d, (o_n, n, run), row, out);
                    }
                }
            }
        }
    }
}

vectorized_kernel! {
    /// `gM_t = A·gy_t·Aᵀ` for the tile rows `rows` of the group `gy`, into `gM[ξ][t][o]`, zeros
    /// standing in for the outputs a tile hangs over.
    fn transform_output_grad<T: TileBackward>(
        d: &Dims,
        gy: &[f32],
        rows: Range<usize>,
        gm: &mut [f32],
        band: &mut Vec<f32>,
    ) {
        let (th, tw) = d.tiles_hw();
        let o_n = d.o;
        let row_len = d.band_width() * LANES;
        let sm = xi_stride(rows.len() * tw * o_n);
        band.resize(T::M * row_len, 0.0);
        let mut out = [[0f32; LANES]; MAX_XI];
        let out = &mut out[..T::XI];
        for (o0, count) in lane_runs(o_n) {
            let run = Run { c0: o0, count };
            for (local, g) in rows.clone().enumerate() {
                let (n, i) = (g / th, g % th);
                for (r, band_row) in band.chunks_exact_mut(row_len).enumerate() {
                    gather_row(gy, d, (o_n, n, run), (T::M * i + r) as isize, band_row);
                }
                for j in 0..tw {
                    T::output_grad_tile(band, row_len, T::M * j + 1, out);
                    let t = local * tw + j;
                    store_tile(gm, out, count, |xi| xi * sm + t * o_n + o0);
                }
            }
        }
    }
}

vectorized_kernel! {
    /// `gx += B·gV_t·Bᵀ` onto the overlapping input tiles of the tile rows `rows` of the group
    /// `gx`, from `gV[ξ][t][c]`, dropping what falls on the padding.
    fn inverse_transform_input<T: TileBackward>(
        d: &Dims,
        gv: &[f32],
        rows: Range<usize>,
        gx: &mut [f32],
        band: &mut Vec<f32>,
    ) {
        let (th, tw) = d.tiles_hw();
        let c_n = d.c;
        let row_len = d.band_width() * LANES;
        let sv = xi_stride(rows.len() * tw * c_n);
        band.resize(T::ALPHA * row_len, 0.0);
        let mut vt = [[0f32; LANES]; MAX_XI];
        let vt = &mut vt[..T::XI];
        for (c0, count) in lane_runs(c_n) {
            let run = Run { c0, count };
            band.fill(0.0);
            for (local, g) in rows.clone().enumerate() {
                let (n, i) = (g / th, g % th);
                for j in 0..tw {
                    let t = local * tw + j;
                    load_tile(gv, vt, count, |xi| xi * sv + t * c_n + c0);
                    // Added at band rows 0..α, columns m·j .. m·j + α.
                    T::input_grad_tile(vt, band, row_len, T::M * j);
                }
                // Band rows 0..m (image rows m·i − 1 .. m·i + m − 1) are complete; the last two
                // carry into the next tile row of the same image, or are complete too at an image's
                // end or the block's.
                let last_of_image = i + 1 == th || local + 1 == rows.len();
                let complete = if last_of_image { T::ALPHA } else { T::M };
                for k in 0..complete {
                    let row = (T::M * i + k) as isize - 1;
                    let band_row = &band[k * row_len..(k + 1) * row_len];
                    scatter_add_row(gx, d, (c_n, n, run), row, band_row);
                }
                if last_of_image {
                    band.fill(0.0);
                } else {
                    band.copy_within(T::M * row_len..T::ALPHA * row_len, 0);
                    band[(T::ALPHA - T::M) * row_len..].fill(0.0);
                }
            }
        }
    }
}

/// Buffers one thread reuses across blocks, and across calls (see [`with_scratch`]).
#[derive(Default)]
struct Scratch {
    v: Vec<f32>,
    m: Vec<f32>,
    band: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// Runs `f` with this thread's [`Scratch`]: a fresh one per call zero-filled its buffers as
/// they grew (a megabyte each on every convolution, 2–3% of a small ResNet's step); kept, they
/// grow once. (Taken out of the cell meanwhile, so a nested call would get a fresh one.)
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let mut scratch = SCRATCH.take();
    let out = f(&mut scratch);
    SCRATCH.set(scratch);
    out
}

/// The forward of one group of images: `x` → `y`, block by block, `ut` = `U[ξ][c][o]`.
fn forward_group(d: &Dims, ut: &[f32], x: &[f32], y: &mut [f32], s: &mut Scratch, inner: usize) {
    let (o_n, c_n, tw, xi_n) = (d.o, d.c, d.tiles_hw().1, d.tile.xi());
    for rows in d.blocks(x.len() / d.image_len()) {
        let tb = rows.len() * tw;
        let (sv, sm) = (xi_stride(tb * c_n), xi_stride(tb * o_n));
        s.v.resize(xi_n * sv, 0.0);
        s.m.resize(xi_n * sm, 0.0);
        by_tile!(d.tile, transform_input(d, x, rows.clone(), &mut s.v, &mut s.band));
        // M[ξ][t][o] = V[ξ][t][c] · U[ξ][c][o].
        for xi in 0..xi_n {
            let a = View { data: &s.v[xi * sv..xi * sv + tb * c_n], rs: c_n, cs: 1 };
            let b = View { data: &ut[xi * c_n * o_n..(xi + 1) * c_n * o_n], rs: o_n, cs: 1 };
            let dst = &mut s.m[xi * sm..xi * sm + tb * o_n];
            matmul((tb, o_n, c_n), dst, o_n, a, b, false, inner);
        }
        by_tile!(d.tile, transform_output(d, &s.m, rows, y, &mut s.band));
    }
}

/// `y = conv2d(x, w)` (3x3, stride 1, padding 1) into `y: [N, O, H, W]`.
pub(super) fn forward(d: &Dims, x: &[f32], w: &[f32], y: &mut [f32]) {
    let ut = transform_weights(d, w, WeightLayout::InputMajor);
    let t = threads();
    let ipg = d.images_per_group(t);
    let groups = x.chunks(ipg * d.image_len()).zip(y.chunks_mut(ipg * d.out_len()));
    if d.n.div_ceil(ipg) > 1 {
        groups
            .par_bridge()
            .for_each(|(xg, yg)| with_scratch(|s| forward_group(d, &ut, xg, yg, s, 1)));
    } else {
        groups.for_each(|(xg, yg)| with_scratch(|s| forward_group(d, &ut, xg, yg, s, t)));
    }
}

/// One group's share of the backward, block by block: adds its `gU[ξ][o][c]` into `gu` (when
/// the weight gradient is wanted) and adds its images' input gradient into `gx` (when given,
/// zeroed by the caller); `u` = `U[ξ][o][c]`.
#[allow(clippy::too_many_arguments)]
fn backward_group(
    d: &Dims,
    u: &[f32],
    x: &[f32],
    gy: &[f32],
    mut gu: Option<&mut [f32]>,
    mut gx: Option<&mut [f32]>,
    s: &mut Scratch,
    inner: usize,
) {
    debug_assert_eq!(d.tile, TileSize::F2, "the gradients are computed by 2x2 tiles");
    let (o_n, c_n, tw, xi_n) = (d.o, d.c, d.tiles_hw().1, d.tile.xi());
    for rows in d.blocks(gy.len() / d.out_len()) {
        let tb = rows.len() * tw;
        let (sv, sm) = (xi_stride(tb * c_n), xi_stride(tb * o_n));
        s.m.resize(xi_n * sm, 0.0);
        s.v.resize(xi_n * sv, 0.0);
        transform_output_grad::<F2>(d, gy, rows.clone(), &mut s.m, &mut s.band);
        if let Some(gu) = gu.as_deref_mut() {
            transform_input::<F2>(d, x, rows.clone(), &mut s.v, &mut s.band);
            // gU[ξ][o][c] += gM[ξ][t][o]ᵀ · V[ξ][t][c].
            for xi in 0..xi_n {
                let a = View { data: &s.m[xi * sm..xi * sm + tb * o_n], rs: 1, cs: o_n };
                let b = View { data: &s.v[xi * sv..xi * sv + tb * c_n], rs: c_n, cs: 1 };
                let dst = &mut gu[xi * o_n * c_n..(xi + 1) * o_n * c_n];
                matmul((o_n, c_n, tb), dst, c_n, a, b, true, inner);
            }
        }
        if let Some(gx) = gx.as_deref_mut() {
            // gV[ξ][t][c] = gM[ξ][t][o] · U[ξ][o][c], into `v` (its input values are spent).
            for xi in 0..xi_n {
                let a = View { data: &s.m[xi * sm..xi * sm + tb * o_n], rs: o_n, cs: 1 };
                let b = View { data: &u[xi * o_n * c_n..(xi + 1) * o_n * c_n], rs: c_n, cs: 1 };
                let dst = &mut s.v[xi * sv..xi * sv + tb * c_n];
                matmul((tb, c_n, o_n), dst, c_n, a, b, false, inner);
            }
            inverse_transform_input::<F2>(d, &s.v, rows, gx, &mut s.band);
        }
    }
}

/// The gradients of `y = conv2d(x, w)` given `gy`: the weight's `[O, C, 3, 3]` when
/// `want_gw`, the input's `[N, C, H, W]` when `want_gx`.
///
/// Both by 2x2 tiles, whichever tile the forward took: the weight's transformed gradient is a
/// sum over every tile of the batch, and 4x4 tiles' transforms (entries up to 8 and 1/24
/// against 1 and ½) lose enough to rounding in it to miss PyTorch's by 2.2e-4 on a 3-channel
/// 32x32 layer (conv_torch's measure, |a − b| / max(|b|, 1); 2x2 tiles: 3.1e-5); the input's by 4x4 tiles, in a pass of its own, ran no faster than
/// both by 2x2 tiles in one (`conv_strategies`: IResNet-50's 56x56 and 28x28 layers 26.0 and
/// 19.8 ms against 26.8 and 20.8; IResNet-18's 112x112 and 56x56 ones 17.6 and 9.9 against
/// 17.4 and 9.5).
pub(super) fn backward(
    d: &Dims,
    x: &[f32],
    w: &[f32],
    gy: &[f32],
    want_gw: bool,
    want_gx: bool,
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    let d = &Dims { tile: TileSize::F2, ..*d };
    if !want_gw && !want_gx {
        return (None, None);
    }
    let xi_n = d.tile.xi();
    let u = if want_gx { transform_weights(d, w, WeightLayout::OutputMajor) } else { Vec::new() };
    let t = threads();
    let ipg = d.images_per_group(t);
    let groups_n = d.n.div_ceil(ipg);
    let gu_len = if want_gw { xi_n * d.c * d.o } else { 0 };
    let mut gx = want_gx.then(|| zeroed(d.n * d.image_len()));
    let gx_groups: Vec<Option<&mut [f32]>> = match gx.as_mut() {
        Some(gx) => gx.chunks_mut(ipg * d.image_len()).map(Some).collect(),
        None => (0..groups_n).map(|_| None).collect(),
    };
    let groups = x.chunks(ipg * d.image_len()).zip(gy.chunks(ipg * d.out_len())).zip(gx_groups);
    let gu = if groups_n > 1 {
        // One partial gU per group, added in group order: a rayon fold/reduce would pair the
        // partials as work-stealing happens to split them, and the sum's rounding (so the
        // trained weights) would change from run to run.
        let groups: Vec<_> = groups.collect();
        let partials: Vec<Vec<f32>> = groups
            .into_par_iter()
            .map(|((xg, gyg), gxg)| {
                let mut gu = vec![0f32; gu_len];
                let gu_part = want_gw.then_some(&mut gu[..]);
                with_scratch(|s| backward_group(d, &u, xg, gyg, gu_part, gxg, s, 1));
                gu
            })
            .collect();
        let mut partials = partials.into_iter();
        let mut gu = partials.next().unwrap_or_default();
        for p in partials {
            gu.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
        }
        gu
    } else {
        let mut gu = vec![0f32; gu_len];
        with_scratch(|s| {
            for ((xg, gyg), gxg) in groups {
                let gu_part = want_gw.then_some(&mut gu[..]);
                backward_group(d, &u, xg, gyg, gu_part, gxg, s, t);
            }
        });
        gu
    };
    let gw = want_gw.then(|| inverse_transform_weights(d, &gu));
    (gw, gx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct 3x3 "same" convolution in f64 with the gradients of Σ r·y: (y, gx, gw).
    fn direct(d: &Dims, x: &[f32], w: &[f32], r: &[f32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut y = vec![0f64; d.n * d.out_len()];
        let mut gx = vec![0f64; x.len()];
        let mut gw = vec![0f64; w.len()];
        for (n, o, yy, xx) in itertools(d) {
            let yi = ((n * d.o + o) * d.h + yy) * d.w + xx;
            for c in 0..d.c {
                for k in 0..9 {
                    let (iy, ix) = ((yy + k / 3) as isize - 1, (xx + k % 3) as isize - 1);
                    if iy < 0 || ix < 0 || iy >= d.h as isize || ix >= d.w as isize {
                        continue;
                    }
                    let xi = ((n * d.c + c) * d.h + iy as usize) * d.w + ix as usize;
                    let wi = (o * d.c + c) * 9 + k;
                    y[yi] += x[xi] as f64 * w[wi] as f64;
                    gx[xi] += r[yi] as f64 * w[wi] as f64;
                    gw[wi] += r[yi] as f64 * x[xi] as f64;
                }
            }
        }
        (y, gx, gw)
    }

    fn itertools(d: &Dims) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        (0..d.n).flat_map(move |n| {
            (0..d.o).flat_map(move |o| {
                (0..d.h).flat_map(move |yy| (0..d.w).map(move |xx| (n, o, yy, xx)))
            })
        })
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(40_503));
                ((h >> 8) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn assert_close(what: &str, got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!((*a as f64 - b).abs() < 1e-4 * b.abs().max(1.0), "{what}[{i}]: {a} vs {b}");
        }
    }

    /// Forward and both gradients equal the direct convolution's on odd, tiny and non-square
    /// maps, on one thread and on three (blocks spread over threads vs. gemms on all of them).
    #[test]
    fn layers_whose_weights_outweigh_their_tiles_are_left_to_im2col() {
        let same = (1, 1, 1);
        let side = |input: [usize; 4], o: usize| tile_side((3, 3), same, input, o);
        // IResNet-50's 512-channel 7x7 layers: at batch 8, 4x4 2x2 tiles x 8 images = 128 <
        // 256 (and 4x4 tiles' weights outweigh theirs more); at batch 16, 2x2 tiles.
        assert_eq!(side([8, 512, 7, 7], 512), None);
        assert_eq!(side([16, 512, 7, 7], 512), Some(2));
        // Its 256-channel 14x14 layers, and its 256 -> 512 layer at 14x14, stay Winograd's,
        // with 2x2 tiles (4x4 ones would make 73% of their values: not few enough).
        assert_eq!(side([8, 256, 14, 14], 256), Some(2));
        assert_eq!(side([8, 256, 14, 14], 512), Some(2));
        // Its 128-channel 28x28 layers and 64-channel 56x56 ones: 4x4 tiles.
        assert_eq!(side([8, 128, 28, 28], 128), Some(4));
        assert_eq!(side([8, 64, 56, 56], 64), Some(4));
        // CIFAR ResNet-18's 128-channel 4x4 layers at batch 32: 32 4x4 tiles' weights outweigh
        // them; 128 2x2 tiles against 64.
        assert_eq!(side([32, 128, 4, 4], 128), Some(2));
        // Its 64-channel 8x8 layers: 4x4 tiles' weights a quarter of them; 256 channels: equal.
        assert_eq!(side([32, 64, 8, 8], 64), Some(4));
        assert_eq!(side([32, 256, 8, 8], 256), Some(2));
        // A 1x1 map: a 2x2 tile's 16 products are more than im2col's 9.
        assert_eq!(side([32, 64, 1, 1], 64), None);
        // Not a 3x3 "same" convolution, or too few channels.
        assert!(!applies((3, 3), (2, 1, 1), [8, 64, 56, 56], 64));
        assert!(!applies((3, 3), same, [8, 4, 56, 56], 64));
    }

    #[test]
    fn forward_and_gradients_equal_the_direct_convolution() {
        for (threads, tile) in
            [1, 3].into_iter().flat_map(|t| [(t, TileSize::F2), (t, TileSize::F4)])
        {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                for (n, c, h, w, o) in [
                    (1, 1, 1, 1, 1),
                    (2, 3, 5, 7, 2),
                    (1, 2, 2, 2, 3),
                    (3, 4, 6, 3, 5),
                    (5, 2, 9, 4, 1),
                    // Every remainder of a side by 4, several tile rows in a block and across
                    // blocks, and channel counts past one run of lanes.
                    (2, 17, 13, 10, 18),
                    (1, 20, 11, 15, 33),
                    (3, 9, 8, 12, 7),
                ] {
                    let d = Dims { n, c, h, w, o, tile };
                    let (x, wt, r) =
                        (values(n * c * h * w, 1), values(o * c * 9, 2), values(n * o * h * w, 3));
                    let (want_y, want_gx, want_gw) = direct(&d, &x, &wt, &r);
                    let mut y = vec![0f32; n * o * h * w];
                    forward(&d, &x, &wt, &mut y);
                    let what = format!("{d:?} on {threads} thread(s)");
                    assert_close(&format!("{what} y"), &y, &want_y);
                    let (gw, gx) = backward(&d, &x, &wt, &r, true, true);
                    assert_close(&format!("{what} gx"), &gx.unwrap(), &want_gx);
                    assert_close(&format!("{what} gw"), &gw.unwrap(), &want_gw);
                    let (gw, gx) = backward(&d, &x, &wt, &r, true, false);
                    assert!(gx.is_none());
                    assert_close(&format!("{what} gw alone"), &gw.unwrap(), &want_gw);
                    let (gw, gx) = backward(&d, &x, &wt, &r, false, true);
                    assert!(gw.is_none());
                    assert_close(&format!("{what} gx alone"), &gx.unwrap(), &want_gx);
                }
            });
        }
    }
}
