//! Our kernels' loops compiled for this CPU's vector unit.
//!
//! The crates are built for baseline x86-64 (SSE2) so that one binary runs on any x86-64 host,
//! and the kernels' loops are plain Rust that LLVM vectorises — at SSE2 width, or not at all
//! where a loop needs a blend, a conversion or a mask SSE2 lacks. `vectorized_kernel!` makes
//! a function in three builds (AVX-512, AVX2 + FMA, baseline) and calls the widest one this
//! CPU runs, detected once (the `multiversion` crate), as PyTorch's CPU kernels pick among
//! their per-ISA builds. A closure written inside such a function is NOT compiled with its
//! features when it is called from elsewhere (the body of a rayon parallel loop is a function
//! of its own, called by rayon: it ran at SSE width): make the loop a `vectorized_kernel!` of
//! its own and call it from the closure. Helpers marked `#[inline(always)]` (the lane
//! reductions below) do take the features of the kernel they are inlined into.
//!
//! The bits do not depend on the build: Rust neither contracts `a * b + c` into a fused
//! multiply-add nor reassociates floating-point sums, so wider vectors change only the speed.
#[doc(hidden)]
pub use multiversion;

/// Wraps a `fn` item so that it is compiled for AVX-512 and for AVX2 + FMA beside the baseline
/// and dispatches at run time to the widest the CPU has (see the module).
#[macro_export]
macro_rules! vectorized_kernel {
    ($($item:tt)*) => {
        #[$crate::kernels::simd::multiversion::multiversion(targets(
            "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma+f16c",
            "x86_64+avx2+fma+f16c",
        ))]
        $($item)*
    };
}

/// Partial sums a reduction keeps: element `i` goes to partial `i % REDUCE_LANES`, the
/// partials are then added in order. A left-to-right float sum is one chain of dependent adds
/// (four cycles each, never vectorised: reordering would change the bits); these partials are
/// independent, so a vector unit adds them 16 (AVX-512) or 8 (AVX2) at a time — in a fixed
/// order, the same bits on every build and thread count.
pub const REDUCE_LANES: usize = 16;

/// `Σ f(a[i])` in [`REDUCE_LANES`] partial sums (inline it into a [`vectorized_kernel!`]).
#[inline(always)]
pub fn lane_sum(a: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    lane_sum2(a, a, |x, _| f(x))
}

/// `Σ f(a[i], b[i])` over the shorter slice's length, in [`REDUCE_LANES`] partial sums.
#[inline(always)]
pub fn lane_sum2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; REDUCE_LANES];
    let (ac, bc) = (a.chunks_exact(REDUCE_LANES), b.chunks_exact(REDUCE_LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..REDUCE_LANES {
            acc[l] += f(x[l], y[l]);
        }
    }
    for (l, (x, y)) in ar.iter().zip(br).enumerate() {
        acc[l] += f(*x, *y);
    }
    acc.iter().fold(0f32, |s, v| s + v)
}

/// The largest of `a` (`-inf` when empty; NaNs are skipped, as `f32::max` does).
#[inline(always)]
pub fn lane_max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; REDUCE_LANES];
    let chunks = a.chunks_exact(REDUCE_LANES);
    let rest = chunks.remainder();
    for x in chunks {
        for l in 0..REDUCE_LANES {
            acc[l] = acc[l].max(x[l]);
        }
    }
    for (l, x) in rest.iter().enumerate() {
        acc[l] = acc[l].max(*x);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v))
}

#[cfg(test)]
mod tests {
    vectorized_kernel! {
        fn affine(a: &[f32], b: &[f32]) -> Vec<f32> {
            a.iter().zip(b).map(|(a, b)| a * b + 0.1).collect()
        }
    }

    vectorized_kernel! {
        fn serial_sum(a: &[f32]) -> f32 {
            a.iter().fold(0f32, |s, v| s + v)
        }
    }

    /// The dispatched build gives the baseline loop's bits, on inputs where a fused
    /// multiply-add or a reordered sum would not (products and sums that round).
    #[test]
    fn same_bits_as_the_baseline_loop() {
        let a: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let b: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos() / 7.0).collect();
        let baseline: Vec<u32> = a.iter().zip(&b).map(|(a, b)| (a * b + 0.1).to_bits()).collect();
        let wide: Vec<u32> = affine(&a, &b).iter().map(|v| v.to_bits()).collect();
        assert_eq!(baseline, wide);
        let serial = a.iter().fold(0f32, |s, v| s + v);
        assert_eq!(serial.to_bits(), serial_sum(&a).to_bits());
    }

    vectorized_kernel! {
        fn lanes_wide(a: &[f32], b: &[f32]) -> (f32, f32, f32) {
            (super::lane_sum(a, |x| x * x), super::lane_sum2(a, b, |x, y| x * y), super::lane_max(a))
        }
    }

    /// The lane reductions: the partials' order written out by hand gives the same bits, on the
    /// dispatched build too, and every length (remainders included) is covered.
    #[test]
    fn lane_reductions_are_fixed_order_sums() {
        for n in [0, 1, 15, 16, 17, 100, 1000] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() / 7.0).collect();
            let mut partial = [0f32; super::REDUCE_LANES];
            for i in 0..n {
                partial[i % super::REDUCE_LANES] += a[i] * b[i];
            }
            let by_hand = partial.iter().fold(0f32, |s, v| s + v);
            let (sq, dot, max) = lanes_wide(&a, &b);
            assert_eq!(dot.to_bits(), by_hand.to_bits(), "n = {n}");
            assert_eq!(dot.to_bits(), super::lane_sum2(&a, &b, |x, y| x * y).to_bits());
            let exact: f64 = a.iter().map(|x| (*x as f64) * (*x as f64)).sum();
            assert!((sq as f64 - exact).abs() <= 1e-5 * exact.max(1.0), "n = {n}");
            assert_eq!(max, a.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v)));
        }
    }
}
