//! CPU kernels for convolutional nets, written here because candle's CPU path is the
//! bottleneck (see each module) and no crate offers trainable conv kernels on plain slices. The
//! matrix products are `gemm`'s (the crate candle itself uses); what is ours is the data layout
//! around them and the backward passes.
pub mod batch_norm;
#[cfg(feature = "cuda")]
pub mod batch_norm_cuda;
pub mod conv2d;
pub mod conv_batch_norm;
pub mod grouped_conv;
pub(crate) mod matmul;
pub mod pool;
pub mod prelu;
pub mod relu;
pub mod simd;
pub mod winograd;

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// A vector of `len` values written by `fill` over parallel chunks of `chunk` values (the chunk's
/// index and its slots), without zeroing them first: a fresh output's memset was a pass over
/// memory as long as the kernel's own.
///
/// # Safety
/// `fill` must write every slot of the chunk it is given (the kernels zip the slots with input
/// slices of the chunk's length); a slot left unwritten would be read uninitialised.
pub(crate) unsafe fn par_filled(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    // SAFETY: passed on from the caller.
    unsafe { par_filled_with(len, chunk, || (), |_, i, c| fill(i, c)) }
}

/// [`par_filled`], each task with its own scratch from `init` (rayon's `for_each_init`).
///
/// # Safety
/// As [`par_filled`]'s.
unsafe fn par_filled_with<S>(
    len: usize,
    chunk: usize,
    init: impl Fn() -> S + Sync + Send,
    fill: impl Fn(&mut S, usize, &mut [MaybeUninit<f32>]) + Sync + Send,
) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each_init(init, |scratch, (i, c)| fill(scratch, i, c));
    // SAFETY: the capacity is `len`, and `fill` wrote each of the first `len` slots (the
    // caller's promise).
    unsafe { v.set_len(len) };
    v
}

/// `len` values computed `chunk` at a time in parallel (the last chunk may be shorter): each
/// task zeroes its chunk just before `f` writes it (given the task's scratch from `init`, the
/// chunk's index and the chunk), so the zeros go to a chunk in cache rather than through one
/// memset of the whole buffer first — a pass over memory as long as the output itself (the
/// depthwise input gradient of MobileFaceNet's first stride-2 layer is 25 MB).
pub(crate) fn par_chunks_zeroed<S>(
    len: usize,
    chunk: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, &mut [f32]) + Sync + Send,
) -> Vec<f32> {
    let zero_then_f = |scratch: &mut S, i: usize, slots: &mut [MaybeUninit<f32>]| {
        slots.fill(MaybeUninit::new(0.0));
        // SAFETY: every slot was initialised by the fill just above, and `MaybeUninit<f32>`
        // has `f32`'s layout.
        let chunk = unsafe { &mut *(slots as *mut [MaybeUninit<f32>] as *mut [f32]) };
        f(scratch, i, chunk)
    };
    // SAFETY: `zero_then_f` writes every slot of its chunk (the zeros) before `f` sees it.
    unsafe { par_filled_with(len, chunk, init, zero_then_f) }
}

/// `a[rows × cols]` (row-major) transposed: `[cols × rows]`, by 16x16 tiles (each read as 16
/// row runs, written as 16 column runs: a column-by-column walk strode a whole row per value),
/// bands of 16 output rows in parallel.
pub(crate) fn transposed(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 16;
    assert_eq!(a.len(), rows * cols, "transposed: {rows}x{cols} from {} values", a.len());
    if rows == 0 || cols == 0 {
        return Vec::new();
    }
    // SAFETY: band `b` is output rows (source columns) `b·TILE..` up to `cols`, and each of
    // them is written whole: every tile of the band covers all its rows `c0..c1` over the
    // columns `r0..r1`, and the tiles' `r0..r1` cover `0..rows`.
    unsafe {
        par_filled(rows * cols, TILE * rows, |band, out| {
            let (c0, c1) = (band * TILE, (band * TILE + TILE).min(cols));
            let mut tile = [[0f32; TILE]; TILE];
            for r0 in (0..rows).step_by(TILE) {
                let r1 = (r0 + TILE).min(rows);
                for (r, t) in (r0..r1).zip(tile.iter_mut()) {
                    t[..c1 - c0].copy_from_slice(&a[r * cols + c0..r * cols + c1]);
                }
                for c in c0..c1 {
                    let dst = &mut out[(c - c0) * rows + r0..(c - c0) * rows + r1];
                    for (d, t) in dst.iter_mut().zip(&tile) {
                        d.write(t[c - c0]);
                    }
                }
            }
        })
    }
}

/// `vec![0f32; len]`, zeroed by the rayon threads when it is large: a kernel's fresh output
/// or scratch buffer comes back from the allocator dirty, and one thread's memset of a
/// multi-megabyte buffer ran at half the speed of two.
pub(crate) fn zeroed(len: usize) -> Vec<f32> {
    const PARALLEL_FROM: usize = 1 << 16;
    if len < PARALLEL_FROM {
        return vec![0f32; len];
    }
    // SAFETY: each chunk is written whole by `fill`.
    unsafe { par_filled(len, PARALLEL_FROM / 4, |_, c| c.fill(MaybeUninit::new(0.0))) }
}

/// Runs `f` on the tensor's data as one contiguous f32 slice, copying only when the tensor is
/// strided or not on the CPU.
pub fn with_f32_slice<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    if t.dtype() != candle_core::DType::F32 {
        candle_core::bail!("expected an f32 tensor, got {:?}", t.dtype())
    }
    if t.device().is_cpu() {
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// Independent accumulators of a sum (two AVX-512 registers of f64).
const SUM_LANES: usize = 16;

/// Two sums `(Σ f(v)[0], Σ f(v)[1])` in f64 over [`SUM_LANES`] independent accumulators, so
/// that the loop vectorises (one f64 chain per element was the kernel's slowest part), kept
/// across the slices added: a channel's planes are many short slices, and reducing the lanes
/// once per channel instead of once per plane matters on 4x4 maps. f64 because the sums of a
/// BatchNorm's backward cancel (Σ gy over a channel is often ~0 while its terms are not).
pub(crate) struct LaneSums {
    lanes: [[f64; SUM_LANES]; 2],
    tail: [f64; 2],
}

impl LaneSums {
    pub(crate) fn new() -> Self {
        LaneSums { lanes: [[0.0; SUM_LANES]; 2], tail: [0.0; 2] }
    }

    /// Adds `f` of the values of the slices `v` (all of one length), element by element.
    #[inline(always)]
    pub(crate) fn add<const K: usize>(&mut self, v: [&[f32]; K], f: impl Fn([f32; K]) -> [f32; 2]) {
        let len = v[0].len();
        let whole = len / SUM_LANES * SUM_LANES;
        // Locals, so that the accumulators stay in registers through the loop.
        let [mut a, mut b] = self.lanes;
        for at in (0..whole).step_by(SUM_LANES) {
            // Plain loops rather than `array::from_fn`, which does not always inline here (and
            // a call per element keeps the loop scalar).
            let mut c = [[0f32; SUM_LANES]; K];
            for k in 0..K {
                c[k].copy_from_slice(&v[k][at..at + SUM_LANES]);
            }
            for l in 0..SUM_LANES {
                let mut x = [0f32; K];
                for k in 0..K {
                    x[k] = c[k][l];
                }
                let [p, q] = f(x);
                a[l] += p as f64;
                b[l] += q as f64;
            }
        }
        self.lanes = [a, b];
        let tail = &mut self.tail;
        (whole..len).for_each(|i| {
            let [p, q] = f(std::array::from_fn(|k| v[k][i]));
            tail[0] += p as f64;
            tail[1] += q as f64;
        });
    }

    pub(crate) fn total(&self) -> (f64, f64) {
        let [a, b] = &self.lanes;
        (a.iter().sum::<f64>() + self.tail[0], b.iter().sum::<f64>() + self.tail[1])
    }
}

#[cfg(test)]
mod tests {
    use super::transposed;

    /// Every element lands at its transposed place, on shapes with partial tiles on both
    /// sides, a single row or column, and more bands than threads.
    #[test]
    fn transposed_moves_every_element() {
        for (rows, cols) in [(1, 1), (1, 37), (37, 1), (16, 16), (17, 33), (243, 256), (5, 1000)] {
            let a: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let t = transposed(&a, rows, cols);
            assert_eq!(t.len(), a.len());
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(t[c * rows + r], a[r * cols + c], "{rows}x{cols} at ({r}, {c})");
                }
            }
        }
        assert!(transposed(&[], 0, 5).is_empty());
    }
}
