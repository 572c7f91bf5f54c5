//! A checked, slice-based front end to `gemm::gemm` for f32 matrices given by strides.
use gemm::Parallelism;

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
    let parallelism = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
    // SAFETY: the asserts above keep every element gemm addresses inside the slices; `dst`
    // is exclusively borrowed and cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
