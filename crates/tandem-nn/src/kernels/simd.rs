//! Our kernels' loops compiled for this CPU's vector unit.
//!
//! The crates are built for baseline x86-64 (SSE2) so that one binary runs on any x86-64 host,
//! and the kernels' loops are plain Rust that LLVM vectorises — at SSE2 width, or not at all
//! where a loop needs a blend, a conversion or a mask SSE2 lacks. `vectorized_kernel!` makes
//! a function in three builds (AVX-512, AVX2 + FMA, baseline) and calls the widest one this
//! CPU runs, detected once (the `multiversion` crate), as PyTorch's CPU kernels pick among
//! their per-ISA builds. Closures written inside the function (the bodies of rayon's parallel
//! loops) are compiled with its features.
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
}
