//! A checked, slice-based front end to `gemm::gemm` for f32 matrices given by strides.
//!
//! With several threads the product is cut into one block of output rows or columns per thread
//! (the longer side), each block a single-threaded gemm, run on rayon's pool. gemm's own rayon
//! mode splits work finer and synchronises inside the product; at the shapes of a training
//! step (a batch of 32–256 rows against 10³ features) it reached 0.55–0.85 of two threads'
//! speed on this machine where whole blocks reach 0.9–0.97 (`examples/matmul_probe.rs`). The
//! inner dimension is never split, so every output element is summed in the same order
//! whatever the thread count.
//!
//! A product of a few rows against a long inner dimension with the right operand's columns
//! contiguous (a Linear's forward at a small batch over a large weight: the ViT's feature
//! layer, `[8, 36864] · [36864, 256]`) is computed as dot products instead: gemm packs the
//! whole right operand (a copy of the weight) before the few rows use it, which made that
//! forward 2.3x PyTorch's time; the dot products read the weight once, in place.
use gemm::Parallelism;
use rayon::prelude::*;

use super::simd::REDUCE_LANES;
use crate::vectorized_kernel;

/// A matrix view into a slice: element (r, c) is `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `dst[m×n] (row-major, row stride dst_rs) = (accumulate ? dst : 0) + a[m×k] · b[k×n]`.
pub(crate) fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    a: View<'_>,
    b: View<'_>,
    accumulate: bool,
    threads: usize,
) {
    assert!(dst.len() >= span(m, n, dst_rs, 1), "matmul: destination too short");
    // Rows closer than a row's width would overlap: gemm's threads would write one element
    // from two places (a data race on a `&mut`).
    assert!(m <= 1 || dst_rs >= n, "matmul: destination row stride {dst_rs} < {n} columns");
    assert!(a.data.len() >= span(m, k, a.rs, a.cs), "matmul: left operand too short");
    assert!(b.data.len() >= span(k, n, b.rs, b.cs), "matmul: right operand too short");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * dst_rs..r * dst_rs + n].iter_mut().for_each(|v| *v = 0.0);
            }
        }
        return;
    }
    let blocks = blocks(m, n, k, threads);
    if by_dot_products(m, k, a, b) {
        let dst_addr = dst.as_mut_ptr() as usize;
        blocks.into_par_iter().for_each(|(_, (c0, c1))| {
            let mut out = vec![0f32; m * (c1 - c0)];
            dot_block(m, (c0, c1), k, (a.data, a.rs), (b.data, b.cs), &mut out);
            for (r, row) in out.chunks_exact(c1 - c0).enumerate() {
                // SAFETY: row r's columns c0..c1 lie inside `dst` (the asserts above) and
                // belong to this block alone.
                let to = unsafe {
                    std::slice::from_raw_parts_mut(
                        (dst_addr as *mut f32).add(r * dst_rs + c0),
                        c1 - c0,
                    )
                };
                if accumulate {
                    to.iter_mut().zip(row).for_each(|(d, v)| *d += v);
                } else {
                    to.copy_from_slice(row);
                }
            }
        });
        return;
    }
    if blocks.len() <= 1 {
        // SAFETY: the asserts above keep every element gemm addresses inside the slices;
        // `dst` is exclusively borrowed and cannot alias `a` or `b`.
        unsafe { gemm_block((0, m), (0, n), k, dst.as_mut_ptr(), dst_rs, a, b, accumulate) };
        return;
    }
    // Blocks write disjoint output elements; the address crosses threads as an integer.
    let dst_addr = dst.as_mut_ptr() as usize;
    blocks.into_par_iter().for_each(|(rows, cols)| {
        // SAFETY: as above, and no two blocks share an output element.
        unsafe { gemm_block(rows, cols, k, dst_addr as *mut f32, dst_rs, a, b, accumulate) }
    });
}

/// Rows at most, and inner length at least, of a product taken by dot products.
const DOT_MAX_ROWS: usize = 8;
const DOT_MIN_INNER: usize = 4096;

/// Whether `a · b` goes by dot products (see the module): few rows, a long inner dimension,
/// `a`'s rows and `b`'s columns contiguous.
pub(crate) fn by_dot_products(m: usize, k: usize, a: View<'_>, b: View<'_>) -> bool {
    m <= DOT_MAX_ROWS && k >= DOT_MIN_INNER && a.cs == 1 && b.rs == 1
}

/// Rows of `a` and columns of `b` sharing each load: 4 x 2 partial vectors in registers (4 x 4
/// spilled them to memory and ran scalar).
const DOT_ROWS: usize = 4;
const DOT_COLS: usize = 2;
/// Inner elements per pass over the columns: `a`'s rows of one pass stay in cache
/// (8 rows x 4096 x 4 B = 128 KiB, in L2) while every column streams by once.
const DOT_INNER_TILE: usize = 4096;

vectorized_kernel! {
    /// Columns `c0..c1` of `a · b` (row-major, `c1 − c0` wide) into `out`, each element a dot
    /// product summed in [`REDUCE_LANES`] partials in [`lane_sum2`]'s order (element `j` of
    /// the inner dimension into partial `j % REDUCE_LANES`), so its bits do not depend on the
    /// tiling or on which rows and columns share its loads.
    fn dot_block(
        m: usize,
        (c0, c1): (usize, usize),
        k: usize,
        (a, a_rs): (&[f32], usize),
        (b, b_cs): (&[f32], usize),
        out: &mut [f32],
    ) {
        let width = c1 - c0;
        let mut acc = vec![[0f32; REDUCE_LANES]; m * width];
        let full = k - k % REDUCE_LANES;
        for k0 in (0..full).step_by(DOT_INNER_TILE) {
            let k1 = (k0 + DOT_INNER_TILE).min(full);
            let row = |r: usize| &a[r * a_rs + k0..r * a_rs + k1];
            let col = |c: usize| &b[c * b_cs + k0..c * b_cs + k1];
            let mut c = c0;
            while c < c1 {
                let cols = DOT_COLS.min(c1 - c);
                let mut r = 0;
                while r < m {
                    let rows = DOT_ROWS.min(m - r);
                    if rows == DOT_ROWS && cols == DOT_COLS {
                        let mut part: [[[f32; REDUCE_LANES]; DOT_COLS]; DOT_ROWS] =
                            std::array::from_fn(|i| std::array::from_fn(|j| acc[(r + i) * width + c + j - c0]));
                        add_products(&mut part, std::array::from_fn(|i| row(r + i)), std::array::from_fn(|j| col(c + j)));
                        for (i, p) in part.iter().enumerate() {
                            for (j, p) in p.iter().enumerate() {
                                acc[(r + i) * width + c + j - c0] = *p;
                            }
                        }
                    } else {
                        for i in r..r + rows {
                            for j in c..c + cols {
                                let mut part = [[acc[i * width + j - c0]]];
                                add_products(&mut part, [row(i)], [col(j)]);
                                acc[i * width + j - c0] = part[0][0];
                            }
                        }
                    }
                    r += rows;
                }
                c += cols;
            }
        }
        for r in 0..m {
            for c in c0..c1 {
                let lanes = &mut acc[r * width + c - c0];
                for j in full..k {
                    lanes[j - full] += a[r * a_rs + j] * b[c * b_cs + j];
                }
                out[r * width + c - c0] = lanes.iter().fold(0f32, |s, v| s + v);
            }
        }
    }
}

/// `part[i][j][l] += Σ rows[i][p] · cols[j][p]` over the `p ≡ l` (mod [`REDUCE_LANES`]) of
/// a multiple-of-lanes run. Written over whole `[f32; 16]` arrays so the partials stay in
/// vector registers (an index loop kept them in memory, scalar).
#[inline(always)]
fn add_products<const R: usize, const C: usize>(
    part: &mut [[[f32; REDUCE_LANES]; C]; R],
    rows: [&[f32]; R],
    cols: [&[f32]; C],
) {
    let mut acc = *part;
    let lanes = cols[0].len() / REDUCE_LANES;
    let rows = rows.map(|r| &r[..lanes * REDUCE_LANES]);
    let cols = cols.map(|c| &c[..lanes * REDUCE_LANES]);
    let at = |s: &[f32], p: usize| -> [f32; REDUCE_LANES] {
        s[p * REDUCE_LANES..][..REDUCE_LANES].try_into().unwrap()
    };
    for p in 0..lanes {
        let y: [[f32; REDUCE_LANES]; C] = std::array::from_fn(|j| at(cols[j], p));
        for i in 0..R {
            let x = at(rows[i], p);
            for j in 0..C {
                acc[i][j] = lanes_mul_add(acc[i][j], &x, &y[j]);
            }
        }
    }
    *part = acc;
}

/// `acc + x ⊙ y`, lane by lane.
#[inline(always)]
fn lanes_mul_add(
    acc: [f32; REDUCE_LANES],
    x: &[f32; REDUCE_LANES],
    y: &[f32; REDUCE_LANES],
) -> [f32; REDUCE_LANES] {
    std::array::from_fn(|l| acc[l] + x[l] * y[l])
}

/// Smallest product (multiply-adds) worth a second thread: below it the handoff costs more
/// than the work (a few microseconds).
const MIN_PARALLEL_WORK: usize = 1 << 17;

/// The `(rows, cols)` ranges of output each thread computes: the longer output side cut into
/// `threads` blocks (multiples of 16, a vector register of f32).
fn blocks(m: usize, n: usize, k: usize, threads: usize) -> Vec<((usize, usize), (usize, usize))> {
    let parts = threads.min((m * n * k) / MIN_PARALLEL_WORK).min(m.max(n).div_ceil(16));
    if parts <= 1 {
        return vec![((0, m), (0, n))];
    }
    let long = m.max(n);
    let step = long.div_ceil(parts).div_ceil(16) * 16;
    (0..long)
        .step_by(step)
        .map(|start| {
            let cut = (start, (start + step).min(long));
            if m >= n {
                (cut, (0, n))
            } else {
                ((0, m), cut)
            }
        })
        .collect()
}

/// One block of the product, single-threaded: output rows `r0..r1`, columns `c0..c1`.
///
/// # Safety
/// `dst` with row stride `dst_rs` must be valid for every element of the block, and no other
/// thread may touch those elements meanwhile; `a` and `b` must span `m × k` and `k × n`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_block(
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    a: View<'_>,
    b: View<'_>,
    accumulate: bool,
) {
    gemm::gemm(
        r1 - r0,
        c1 - c0,
        k,
        dst.add(r0 * dst_rs + c0),
        1,
        dst_rs as isize,
        accumulate,
        a.data.as_ptr().add(r0 * a.rs),
        a.cs as isize,
        a.rs as isize,
        b.data.as_ptr().add(c0 * b.cs),
        b.cs as isize,
        b.rs as isize,
        1.0,
        1.0,
        false,
        false,
        false,
        Parallelism::None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::lane_sum2;

    fn filled(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Blocks split across threads give a reference product, with transposed operands and
    /// accumulation, and the same bits as one thread (the inner dimension is never cut).
    #[test]
    fn blocks_across_threads_equal_one_thread_and_a_reference() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for (m, n, k) in [(128, 1024, 784), (1024, 784, 128), (70, 33, 300), (5, 900, 64)] {
            // a stored transposed (column-major), b row-major.
            let (a, b) = (filled(m * k, 1), filled(k * n, 2));
            let av = View { data: &a, rs: 1, cs: m };
            let bv = View { data: &b, rs: n, cs: 1 };
            let start = filled(m * n, 3);
            let run = |threads: usize| {
                let mut dst = start.clone();
                pool.install(|| matmul((m, n, k), &mut dst, n, av, bv, true, threads));
                dst
            };
            let one = run(1);
            assert!(blocks(m, n, k, 3).len() > 1 || m * n * k < 3 * MIN_PARALLEL_WORK);
            assert_eq!(one, run(3), "{m}x{n}x{k}: threads changed the bits");
            for (i, j) in [(0, 0), (m - 1, n - 1), (m / 2, n / 3)] {
                let want: f64 = start[i * n + j] as f64
                    + (0..k).map(|p| a[p * m + i] as f64 * b[p * n + j] as f64).sum::<f64>();
                assert!(
                    (one[i * n + j] as f64 - want).abs() < 1e-3 * (1.0 + want.abs()),
                    "{m}x{n}x{k} ({i},{j})"
                );
            }
        }
    }

    /// The dot-product path (few rows, long inner dimension): a reference product, with and
    /// without accumulation, remainder rows and lanes included, and the same bits on 1 and 3
    /// threads and whichever rows share a block.
    #[test]
    fn dot_products_equal_a_reference_and_keep_their_bits() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for (m, n, k) in [(8, 100, 5000), (3, 40, 4099), (7, 33, 4096)] {
            // a row-major, b with contiguous columns (a Linear's weight, transposed).
            let (a, w) = (filled(m * k, 4), filled(n * k, 5));
            let av = View { data: &a, rs: k, cs: 1 };
            let bv = View { data: &w, rs: 1, cs: k };
            assert!(by_dot_products(m, k, av, bv));
            let start = filled(m * n, 6);
            let run = |threads: usize, accumulate: bool| {
                let mut dst = start.clone();
                pool.install(|| matmul((m, n, k), &mut dst, n, av, bv, accumulate, threads));
                dst
            };
            let one = run(1, true);
            assert_eq!(one, run(3, true), "{m}x{n}x{k}: threads changed the bits");
            let fresh = run(1, false);
            for i in 0..m {
                for j in [0, n / 2, n - 1] {
                    let dot: f64 = (0..k).map(|p| a[i * k + p] as f64 * w[j * k + p] as f64).sum();
                    let e =
                        |got: f32, want: f64| (got as f64 - want).abs() < 1e-3 * (1.0 + want.abs());
                    assert!(e(fresh[i * n + j], dot), "{m}x{n}x{k} ({i},{j})");
                    assert!(
                        e(one[i * n + j], start[i * n + j] as f64 + dot),
                        "{m}x{n}x{k} ({i},{j})"
                    );
                    let alone = lane_sum2(&a[i * k..][..k], &w[j * k..][..k], |x, y| x * y);
                    assert_eq!(
                        fresh[i * n + j].to_bits(),
                        alone.to_bits(),
                        "row blocking changed bits"
                    );
                }
            }
        }
    }

    #[test]
    fn blocks_tile_the_longer_side_in_multiples_of_sixteen() {
        let b = blocks(128, 1000, 784, 2);
        assert_eq!(b, vec![((0, 128), (0, 512)), ((0, 128), (512, 1000))]);
        let b = blocks(1000, 100, 784, 4);
        assert_eq!(
            b.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            [(0, 256), (256, 512), (512, 768), (768, 1000)]
        );
        assert_eq!(blocks(8, 8, 8, 2), vec![((0, 8), (0, 8))], "too small to split");
    }

    #[test]
    #[should_panic(expected = "destination row stride 2 < 3 columns")]
    fn overlapping_destination_rows_are_refused() {
        let a = vec![1.0f32; 2 * 2];
        let b = vec![1.0f32; 2 * 3];
        let mut dst = vec![0.0f32; 16];
        matmul(
            (2, 3, 2),
            &mut dst,
            2,
            View { data: &a, rs: 2, cs: 1 },
            View { data: &b, rs: 3, cs: 1 },
            false,
            1,
        );
    }
}
