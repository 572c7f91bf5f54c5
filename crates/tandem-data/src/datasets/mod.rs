//! The datasets a job can name: the embedded UCI digits (default), MNIST / Fashion-MNIST IDX
//! files from a directory, and a synthetic set for benchmarks. Each spec yields a fixed
//! (train, eval) pair. Face-recognition data (insightface's RecordIO sets and `.bin`
//! verification pairs) is in [`faces`].
mod cifar;
mod digits;
pub mod faces;
mod idx;
pub mod ijb;
pub mod image_folder;
mod synthetic;

pub use cifar::{
    cifar10, read_cifar_batch, synthetic_cifar, CIFAR_CHANNELS, CIFAR_CLASSES, CIFAR_PIXELS,
    CIFAR_SIDE,
};
pub use digits::{digits, digits_all, DIGITS_EVAL_LEN};
pub use idx::{mnist, read_idx_images, read_idx_labels};
pub use synthetic::synthetic;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::{DataError, InMemoryDataset};

/// Defaults of the `synthetic` spec.
pub const SYNTHETIC_DEFAULT_LEN: usize = 10_000;
pub const SYNTHETIC_DEFAULT_DIM: usize = 64;
pub const SYNTHETIC_DEFAULT_CLASSES: usize = 10;
/// Seed of the `synthetic` spec's generator (train and eval come from one generated set).
pub const SYNTHETIC_SPEC_SEED: u64 = 0;

/// A dataset a job names, parsed once from its spec (`--data`) and written back the same way:
/// * `digits` — the embedded UCI digits, see [`digits`];
/// * `mnist:DIR` — MNIST or Fashion-MNIST IDX files in `DIR`, see [`mnist`];
/// * `cifar10:DIR` — CIFAR-10's binary batches in `DIR`, see [`cifar10`];
/// * `synthetic-cifar[:N]` — CIFAR-shaped synthetic data, `N` train examples (default 10000),
///   see [`synthetic_cifar`];
/// * `synthetic[:N[:DIM[:CLASSES]]]` — `N` train examples (default 10000) and `N / 5` eval
///   examples (at least 1) of `DIM` features (64) in `CLASSES` classes (10), drawn from the
///   same class centers with seed 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DatasetSpec {
    Digits,
    Mnist(PathBuf),
    Cifar10(PathBuf),
    SyntheticCifar { n: usize },
    Synthetic { n: usize, dim: usize, classes: usize },
}

impl FromStr for DatasetSpec {
    type Err = DataError;

    fn from_str(spec: &str) -> Result<Self, DataError> {
        let bad = |reason: String| DataError::BadSpec { spec: spec.to_string(), reason };
        let dir = |kind: &str, dir: &str| {
            if dir.is_empty() {
                return Err(bad(format!("{kind}: needs a directory after the colon")));
            }
            Ok(PathBuf::from(dir))
        };
        let positive = |name: &str, v: &str| {
            v.parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| bad(format!("{name} must be a positive integer, got {v:?}")))
        };
        if spec == "digits" {
            return Ok(DatasetSpec::Digits);
        }
        if let Some(d) = spec.strip_prefix("mnist:") {
            return Ok(DatasetSpec::Mnist(dir("mnist", d)?));
        }
        if let Some(d) = spec.strip_prefix("cifar10:") {
            return Ok(DatasetSpec::Cifar10(dir("cifar10", d)?));
        }
        if spec == "synthetic-cifar" || spec.starts_with("synthetic-cifar:") {
            let n = match spec.strip_prefix("synthetic-cifar:") {
                None => SYNTHETIC_DEFAULT_LEN,
                Some(n) => positive("N", n)?,
            };
            return Ok(DatasetSpec::SyntheticCifar { n });
        }
        if spec == "synthetic" || spec.starts_with("synthetic:") {
            let parts: Vec<&str> = spec.split(':').skip(1).collect();
            if parts.len() > 3 {
                return Err(bad(format!("synthetic takes at most 3 numbers, got {}", parts.len())));
            }
            let mut values =
                [SYNTHETIC_DEFAULT_LEN, SYNTHETIC_DEFAULT_DIM, SYNTHETIC_DEFAULT_CLASSES];
            for (i, (part, name)) in parts.iter().zip(["N", "DIM", "CLASSES"]).enumerate() {
                values[i] = positive(name, part)?;
            }
            let [n, dim, classes] = values;
            return Ok(DatasetSpec::Synthetic { n, dim, classes });
        }
        Err(bad("unknown dataset".into()))
    }
}

impl fmt::Display for DatasetSpec {
    /// The spec it was parsed from (defaults written out).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatasetSpec::Digits => f.write_str("digits"),
            DatasetSpec::Mnist(dir) => write!(f, "mnist:{}", dir.display()),
            DatasetSpec::Cifar10(dir) => write!(f, "cifar10:{}", dir.display()),
            DatasetSpec::SyntheticCifar { n } => write!(f, "synthetic-cifar:{n}"),
            DatasetSpec::Synthetic { n, dim, classes } => {
                write!(f, "synthetic:{n}:{dim}:{classes}")
            }
        }
    }
}

impl DatasetSpec {
    /// Its (train, eval) pair.
    pub fn load(&self) -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
        match self {
            DatasetSpec::Digits => digits(),
            DatasetSpec::Mnist(dir) => mnist(dir),
            DatasetSpec::Cifar10(dir) => cifar10(dir),
            DatasetSpec::SyntheticCifar { n } => synthetic_cifar(*n, SYNTHETIC_SPEC_SEED),
            DatasetSpec::Synthetic { n, dim, classes } => {
                synthetic_split(*n, *dim, *classes, SYNTHETIC_SPEC_SEED, "synthetic")
            }
        }
    }
}

/// Resolves a dataset spec (see [`DatasetSpec`]) to (train, eval).
pub fn from_spec(spec: &str) -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
    spec.parse::<DatasetSpec>()?.load()
}

/// `n` train and `n / 5` (at least 1) eval examples of [`synthetic`] data, drawn from the same
/// class centers, named `<name>-train` / `<name>-eval`.
pub fn synthetic_split(
    n: usize,
    dim: usize,
    classes: usize,
    seed: u64,
    name: &str,
) -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
    let n_eval = (n / 5).max(1);
    let all = synthetic(n + n_eval, dim, classes, seed)?;
    let train_idx: Vec<usize> = (0..n).collect();
    let eval_idx: Vec<usize> = (n..n + n_eval).collect();
    Ok((
        all.subset(format!("{name}-train"), &train_idx)?,
        all.subset(format!("{name}-eval"), &eval_idx)?,
    ))
}
