//! MNIST / Fashion-MNIST in their IDX files (gzip-compressed or raw), as distributed by the
//! dataset authors and downloaded by torchvision. Images become `rows * cols` f32 features
//! scaled by 1/255 (what `transforms.ToTensor()` gives, flattened); no other normalisation.
//! The format is a few lines (big-endian header, then u8 data), so no crate is used for it.
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::{DataError, InMemoryDataset};

const IMAGES_MAGIC: [u8; 4] = [0, 0, 0x08, 3];
const LABELS_MAGIC: [u8; 4] = [0, 0, 0x08, 1];
const MNIST_CLASSES: usize = 10;

fn malformed(path: &Path, reason: impl Into<String>) -> DataError {
    DataError::Malformed { path: path.to_path_buf(), reason: reason.into() }
}

/// The file's bytes, gunzipped when it starts with the gzip magic (whatever its name).
fn read_maybe_gz(path: &Path) -> Result<Vec<u8>, DataError> {
    let raw =
        std::fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| malformed(path, format!("not a valid gzip file: {e}")))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Checks the magic number and header, returns the dimensions and the data after the header.
fn parse_idx<'a>(
    path: &Path,
    bytes: &'a [u8],
    magic: [u8; 4],
    what: &str,
) -> Result<(Vec<usize>, &'a [u8]), DataError> {
    if bytes.len() < 4 {
        return Err(malformed(
            path,
            format!("{} bytes, too short for an IDX header ({what})", bytes.len()),
        ));
    }
    if bytes[..4] != magic {
        return Err(malformed(
            path,
            format!(
                "magic number {:02x}{:02x}{:02x}{:02x}, expected {:02x}{:02x}{:02x}{:02x} (IDX {what})",
                bytes[0], bytes[1], bytes[2], bytes[3], magic[0], magic[1], magic[2], magic[3]
            ),
        ));
    }
    let ndim = usize::from(magic[3]);
    let header_len = 4 + 4 * ndim;
    if bytes.len() < header_len {
        return Err(malformed(
            path,
            format!("truncated header: {} bytes, expected {header_len}", bytes.len()),
        ));
    }
    let dims: Vec<usize> = bytes[4..header_len]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let data = &bytes[header_len..];
    match expected {
        Some(n) if n == data.len() => Ok((dims, data)),
        Some(n) => Err(malformed(
            path,
            format!(
                "header {dims:?} needs {n} data bytes, file has {}{}",
                data.len(),
                if data.len() < n { " (truncated)" } else { "" }
            ),
        )),
        None => Err(malformed(path, format!("header dimensions {dims:?} overflow"))),
    }
}

/// An IDX3 image file: (count, rows * cols, pixels scaled to [0, 1]).
pub fn read_idx_images(path: &Path) -> Result<(usize, usize, Vec<f32>), DataError> {
    let bytes = read_maybe_gz(path)?;
    let (dims, data) =
        parse_idx(path, &bytes, IMAGES_MAGIC, "images: unsigned bytes, 3 dimensions")?;
    let pixels = dims[1] * dims[2];
    if pixels == 0 {
        return Err(malformed(path, format!("images of {}x{} pixels", dims[1], dims[2])));
    }
    Ok((dims[0], pixels, data.iter().map(|&b| f32::from(b) / 255.0).collect()))
}

/// An IDX1 label file; every label must be a digit class 0..=9.
pub fn read_idx_labels(path: &Path) -> Result<Vec<i64>, DataError> {
    let bytes = read_maybe_gz(path)?;
    let (_, data) = parse_idx(path, &bytes, LABELS_MAGIC, "labels: unsigned bytes, 1 dimension")?;
    if let Some((i, &l)) = data.iter().enumerate().find(|(_, &l)| usize::from(l) >= MNIST_CLASSES) {
        return Err(malformed(
            path,
            format!("label {l} at position {i}, expected 0..{MNIST_CLASSES}"),
        ));
    }
    Ok(data.iter().map(|&l| i64::from(l)).collect())
}

/// `DIR/<stem>.gz` or `DIR/<stem>`, also under torchvision's `MNIST/raw` and
/// `FashionMNIST/raw` subdirectories.
fn find_file(dir: &Path, stem: &str) -> Result<PathBuf, DataError> {
    let mut tried = Vec::new();
    for sub in ["", "MNIST/raw", "FashionMNIST/raw"] {
        for name in [format!("{stem}.gz"), stem.to_string()] {
            let p = dir.join(sub).join(&name);
            if p.is_file() {
                return Ok(p);
            }
            tried.push(p);
        }
    }
    Err(DataError::Io {
        path: dir.join(format!("{stem}[.gz]")),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "MNIST/Fashion-MNIST IDX file not found; tried {}",
                tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            ),
        ),
    })
}

fn load_split(dir: &Path, prefix: &str, name: &str) -> Result<InMemoryDataset, DataError> {
    let images_path = find_file(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let labels_path = find_file(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let (count, pixels, features) = read_idx_images(&images_path)?;
    let labels = read_idx_labels(&labels_path)?;
    if labels.len() != count {
        return Err(malformed(
            &labels_path,
            format!("{} labels, but {} has {count} images", labels.len(), images_path.display()),
        ));
    }
    tracing::debug!(images = %images_path.display(), count, pixels, "read IDX split");
    InMemoryDataset::new(name, features, labels, pixels, MNIST_CLASSES)
}

/// (train, eval) = (`train-*`, `t10k-*`) IDX files of MNIST or Fashion-MNIST in `dir`.
pub fn mnist(dir: impl AsRef<Path>) -> Result<(InMemoryDataset, InMemoryDataset), DataError> {
    let dir = dir.as_ref();
    Ok((load_split(dir, "train", "mnist-train")?, load_split(dir, "t10k", "mnist-eval")?))
}
