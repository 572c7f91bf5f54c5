//! A synthetic classification set for benchmarks: class centers and samples drawn from MT19937
//! (so it is identical on every platform and run), `x = center[label] + N(0, 1)`.
use rand_mt::Mt64;

use crate::{DataError, InMemoryDataset};

/// Spread of the class centers; with unit noise the classes overlap a little, so a model learns
/// something but not everything at once.
const CENTER_SCALE: f64 = 1.0;

fn uniform(rng: &mut Mt64) -> f64 {
    // 53 random bits in (0, 1]; never 0 so ln() below stays finite.
    ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

fn normal(rng: &mut Mt64) -> f64 {
    // Box–Muller; one value per call is plenty here.
    (-2.0 * uniform(rng).ln()).sqrt() * (std::f64::consts::TAU * uniform(rng)).cos()
}

/// `n` examples of `dim` features in `classes` classes. The centers depend only on
/// (`dim`, `classes`, `seed`), so prefixes of different `n` agree.
pub fn synthetic(
    n: usize,
    dim: usize,
    classes: usize,
    seed: u64,
) -> Result<InMemoryDataset, DataError> {
    if dim == 0 {
        return Err(DataError::ZeroArgument { what: "synthetic dim" });
    }
    if classes == 0 {
        return Err(DataError::ZeroArgument { what: "synthetic classes" });
    }
    let mut center_rng = Mt64::new(seed);
    let centers: Vec<f64> =
        (0..classes * dim).map(|_| CENTER_SCALE * normal(&mut center_rng)).collect();
    let mut rng = Mt64::new(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut features = Vec::with_capacity(n * dim);
    let mut labels = Vec::with_capacity(n);
    for _ in 0..n {
        let label = (rng.next_u64() % classes as u64) as usize;
        let center = &centers[label * dim..(label + 1) * dim];
        features.extend(center.iter().map(|c| (c + normal(&mut rng)) as f32));
        labels.push(label as i64);
    }
    InMemoryDataset::new(format!("synthetic-{n}x{dim}-{classes}c"), features, labels, dim, classes)
}
