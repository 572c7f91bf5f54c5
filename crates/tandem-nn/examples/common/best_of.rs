//! Timing shared by the kernel probes.
use std::time::Instant;

/// The fastest of `repeats` runs of `f` in milliseconds, after one untimed run.
pub fn best_ms(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..repeats)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::MAX, f64::min)
}
