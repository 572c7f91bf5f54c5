//! A checked, slice-based front end to `gemm::gemm` for f32 matrices given by strides.
//!
//! With several threads the product is cut into one block of output rows or columns per thread
//! (the longer side), each block a single-threaded gemm, run on rayon's pool. gemm's own rayon
//! mode splits work finer and synchronises inside the product; at the shapes of a training
//! step (a batch of 32–256 rows against 10³ features) it reached 0.55–0.85 of two threads'
//! speed on this machine where whole blocks reach 0.9–0.97 (`examples/matmul_probe.rs`). The
//! inner dimension is never split, so every output element is summed in the same order
//! whatever the thread count.
use gemm::Parallelism;
use rayon::prelude::*;

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
