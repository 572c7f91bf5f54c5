//! Which way round to hand the convolution's three products to `gemm`, on the shapes of
//! IResNet's first stage (16 channels, 3x3, 112x112 maps: O = 16, K = 144, P = 12544 per image).
//! Prints the best of 5 runs of each orientation, single-threaded; the weight gradient's
//! transposed form (`gwᵀ = col · gyᵀ`, the pixels inner and `col` the left operand) is the
//! one `kernels::conv2d` uses.
//!
//!   cargo run --release -p tandem-nn --example gemm_orient
use std::time::Instant;

/// A row-major-or-strided operand: element (r, c) at `data[r * rs + c * cs]`.
struct Operand<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// Best-of-5 milliseconds of `dst[m×n] = a[m×k] · b[k×n]`.
fn best_ms((m, n, k): (usize, usize, usize), a: Operand<'_>, b: Operand<'_>) -> f64 {
    let mut dst = vec![0f32; m * n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: `dst` holds m×n elements; `a` and `b` span their m×k and k×n views (the
        // callers size them so), and nothing aliases `dst`.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
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
                gemm::Parallelism::None,
            );
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    best
}

fn main() {
    let (o, k, p) = (16usize, 144usize, 112 * 112);
    let col: Vec<f32> = (0..k * p).map(|i| (i % 7) as f32).collect();
    let gy: Vec<f32> = (0..o * p).map(|i| (i % 5) as f32).collect();
    let w: Vec<f32> = (0..o * k).map(|i| (i % 3) as f32).collect();
    let v = |data, rs, cs| Operand { data, rs, cs };
    let rows = [
        ("forward        y[O,P] = w · col", best_ms((o, p, k), v(&w, k, 1), v(&col, p, 1))),
        ("weight grad    gw[O,K] = gy · colᵀ", best_ms((o, k, p), v(&gy, p, 1), v(&col, 1, p))),
        ("weight grad    gwᵀ[K,O] = col · gyᵀ", best_ms((k, o, p), v(&col, p, 1), v(&gy, 1, p))),
        ("input grad     gcol[K,P] = wᵀ · gy", best_ms((k, p, o), v(&w, 1, k), v(&gy, p, 1))),
    ];
    for (what, ms) in rows {
        println!("{what:<40} {ms:.2} ms");
    }
}
