//! CIFAR-10 in its binary distribution: `data_batch_1.bin` … `data_batch_5.bin` (train, in that
//! order) and `test_batch.bin` (eval). Each record is 1 label byte and 3072 pixel bytes
//! (1024 red, 1024 green, 1024 blue, each 32x32 row-major: CHW), scaled to [0, 1] (x / 255) with
//! no normalisation. Errors name the file and, for a bad label, the record.
use std::path::{Path, PathBuf};

use crate::{DataError, InMemoryDataset};

pub const CIFAR_CHANNELS: usize = 3;
pub const CIFAR_SIDE: usize = 32;
pub const CIFAR_PIXELS: usize = CIFAR_CHANNELS * CIFAR_SIDE * CIFAR_SIDE;
pub const CIFAR_CLASSES: usize = 10;
const RECORD: usize = 1 + CIFAR_PIXELS;
const TRAIN_FILES: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];
const TEST_FILE: &str = "test_batch.bin";

/// `dir`, or its `cifar-10-batches-bin` subdirectory (the archive's layout), whichever holds
/// the test file.
fn data_dir(dir: &Path) -> PathBuf {
    let nested = dir.join("cifar-10-batches-bin");
    if !dir.join(TEST_FILE).is_file() && nested.join(TEST_FILE).is_file() {
        nested
    } else {
        dir.to_path_buf()
    }
}

/// Appends the records of one batch file to `features` / `labels`.
pub fn read_cifar_batch(
    path: &Path,
    features: &mut Vec<f32>,
    labels: &mut Vec<i64>,
) -> Result<(), DataError> {
    let bytes =
        std::fs::read(path).map_err(|source| DataError::Io { path: path.into(), source })?;
    let malformed = |reason: String| DataError::Malformed { path: path.into(), reason };
    if bytes.is_empty() || bytes.len() % RECORD != 0 {
        return Err(malformed(format!(
            "{} bytes is not a whole number of {RECORD}-byte records (1 label + {CIFAR_PIXELS} pixels); truncated or not a CIFAR-10 binary batch",
            bytes.len()
        )));
    }
    features.reserve(bytes.len() / RECORD * CIFAR_PIXELS);
    for (record, chunk) in bytes.chunks_exact(RECORD).enumerate() {
        let label = chunk[0];
        if usize::from(label) >= CIFAR_CLASSES {
            return Err(malformed(format!(
                "record {record}: label {label}, expected 0..{CIFAR_CLASSES} (CIFAR-100 or another format?)"
            )));
        }
        labels.push(i64::from(label));
        features.extend(chunk[1..].iter().map(|&p| f32::from(p) / 255.0));
    }
    Ok(())
}

/// (train, eval) from the CIFAR-10 binary files in `dir` (see the module docs).
pub fn cifar10(dir: impl AsRef<Path>) -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
    let dir = data_dir(dir.as_ref());
    let split = |files: &[&str], name: &str| {
        let (mut features, mut labels) = (Vec::new(), Vec::new());
        for file in files {
            read_cifar_batch(&dir.join(file), &mut features, &mut labels)?;
        }
        InMemoryDataset::new(name, features, labels, CIFAR_PIXELS, CIFAR_CLASSES)
    };
    Ok((split(&TRAIN_FILES, "cifar10-train")?, split(&[TEST_FILE], "cifar10-eval")?))
}

/// CIFAR-shaped synthetic data for benchmarks: [`super::synthetic_split`] with 3x32x32 = 3072
/// features and 10 classes (`n` train and `n / 5` eval examples, deterministic in `seed`).
pub fn synthetic_cifar(
    n: usize,
    seed: u64,
) -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
    super::synthetic_split(n, CIFAR_PIXELS, CIFAR_CLASSES, seed, "synthetic-cifar")
}
