//! The UCI ML optical recognition of handwritten digits data (1797 8x8 images, 10 classes),
//! embedded in the binary: scikit-learn's `digits.csv.gz`, see `data/README.md` for source
//! and licence (CC BY 4.0, E. Alpaydin and C. Kaynak).
use crate::{DataError, InMemoryDataset};

static DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

pub const DIGITS_LEN: usize = 1797;
pub const DIGITS_DIM: usize = 64;
pub const DIGITS_CLASSES: usize = 10;
/// Size of the fixed eval split (the other 1500 rows train).
pub const DIGITS_EVAL_LEN: usize = 297;
/// Seed of the `torch.randperm` that assigns rows to the split.
pub const DIGITS_SPLIT_SEED: u64 = 0;

/// All 1797 examples in file order; pixels (0..=16) scaled by 1/16 to [0, 1].
pub fn digits_all() -> Result<InMemoryDataset, DataError> {
    use std::io::Read;
    let bad = |reason: String| DataError::Embedded { name: "digits", reason };
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_CSV_GZ)
        .read_to_string(&mut text)
        .map_err(|e| bad(format!("gunzip: {e}")))?;
    let mut features = Vec::with_capacity(DIGITS_LEN * DIGITS_DIM);
    let mut labels = Vec::with_capacity(DIGITS_LEN);
    for (line_no, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let values: Vec<&str> = line.split(',').collect();
        if values.len() != DIGITS_DIM + 1 {
            return Err(bad(format!(
                "line {}: {} fields, expected {}",
                line_no + 1,
                values.len(),
                DIGITS_DIM + 1
            )));
        }
        let parse = |s: &str| {
            s.trim().parse::<u8>().map_err(|e| bad(format!("line {}: {s:?}: {e}", line_no + 1)))
        };
        for v in &values[..DIGITS_DIM] {
            features.push(f32::from(parse(v)?) / 16.0);
        }
        labels.push(i64::from(parse(values[DIGITS_DIM])?));
    }
    if labels.len() != DIGITS_LEN {
        return Err(bad(format!("{} rows, expected {DIGITS_LEN}", labels.len())));
    }
    InMemoryDataset::new("digits", features, labels, DIGITS_DIM, DIGITS_CLASSES)
}

/// The fixed (train, eval) split of the digits: `perm = torch.randperm(1797, generator seeded
/// with 0)`; eval = `sorted(perm[1500:])`, train = `sorted(perm[:1500])`, so PyTorch reproduces it
/// in one line. A seeded shuffle rather than the file's tail: the file is ordered by writer, so
/// its tail is a handful of unseen writers, a harder and less representative test set.
pub fn digits() -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
    let all = digits_all()?;
    let split = DIGITS_LEN - DIGITS_EVAL_LEN;
    let perm = crate::randperm::torch_randperm(DIGITS_LEN, DIGITS_SPLIT_SEED);
    let mut train: Vec<usize> = perm[..split].to_vec();
    let mut eval: Vec<usize> = perm[split..].to_vec();
    train.sort_unstable();
    eval.sort_unstable();
    Ok((all.subset("digits-train", &train)?, all.subset("digits-eval", &eval)?))
}
