//! Per-example image transforms applied as the loader reads: per-channel normalisation and
//! torchvision-style augmentation (`RandomCrop(side, padding)` then `RandomHorizontalFlip()`).
//!
//! The random draws are a pure function of (seed, epoch, example index) — a counter-based hash,
//! not a stateful generator — so an example is augmented the same way whichever rank, worker
//! or batch reads it: results do not depend on the world size or the number of loader workers.
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{DataError, Dataset, Example, InMemoryDataset};

/// Random crop after zero padding, then a random horizontal flip (probability 1/2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropFlip {
    pub padding: usize,
    pub seed: u64,
}

/// What to apply to each example, whose features are a `[channels, height, width]` image.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImageTransforms {
    pub chw: (usize, usize, usize),
    /// Per-channel (mean, std): x -> (x - mean) / std, after augmentation.
    pub normalize: Option<(Vec<f32>, Vec<f32>)>,
    pub crop_flip: Option<CropFlip>,
}

/// Per-channel mean and (population) standard deviation of a dataset of `[C, H, W]` images.
pub fn channel_stats(
    data: &InMemoryDataset,
    channels: usize,
) -> Result<(Vec<f32>, Vec<f32>), DataError> {
    if channels == 0 || !data.input_dim().is_multiple_of(channels) {
        return Err(DataError::BadSpec {
            spec: data.name().to_string(),
            reason: format!("{} features are not {channels} channels", data.input_dim()),
        });
    }
    let plane = data.input_dim() / channels;
    let (mut sum, mut sq) = (vec![0f64; channels], vec![0f64; channels]);
    for i in 0..data.len() {
        for (c, values) in data.row(i)?.chunks_exact(plane).enumerate() {
            for &v in values {
                sum[c] += v as f64;
                sq[c] += (v as f64) * (v as f64);
            }
        }
    }
    let n = (data.len() * plane).max(1) as f64;
    let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
    let std = sq.iter().zip(&mean).map(|(q, m)| ((q / n - m * m).max(0.0)).sqrt().max(1e-12));
    Ok((mean.iter().map(|&m| m as f32).collect(), std.map(|s| s as f32).collect()))
}

/// A dataset whose examples go through [`ImageTransforms`]; the epoch (set by the training
/// loop before each epoch) feeds the augmentation's draws.
pub struct Transformed<D: Dataset> {
    inner: D,
    transforms: ImageTransforms,
    epoch: AtomicU64,
}

impl<D: Dataset> Transformed<D> {
    pub fn new(inner: D, transforms: ImageTransforms) -> Result<Self, DataError> {
        let (c, h, w) = transforms.chw;
        let active = transforms.normalize.is_some() || transforms.crop_flip.is_some();
        if active && c * h * w != inner.input_dim() {
            return Err(DataError::FeatureLength {
                index: 0,
                got: inner.input_dim(),
                expected: c * h * w,
            });
        }
        if let Some((mean, std)) = &transforms.normalize {
            if mean.len() != c || std.len() != c || std.iter().any(|s| s.is_nan() || *s <= 0.0) {
                return Err(DataError::ZeroArgument {
                    what: "normalisation std (one positive value per channel)",
                });
            }
        }
        Ok(Transformed { inner, transforms, epoch: AtomicU64::new(0) })
    }

    /// No transforms: examples as stored.
    pub fn identity(inner: D) -> Self {
        Transformed { inner, transforms: ImageTransforms::default(), epoch: AtomicU64::new(0) }
    }

    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::SeqCst);
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of a counter.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `image` ([C, H, W]) cropped at offset (dy, dx) of its zero-padded version, optionally flipped.
fn crop_flip(
    image: &[f32],
    (c, h, w): (usize, usize, usize),
    pad: usize,
    dy: usize,
    dx: usize,
    flip: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; image.len()];
    for ch in 0..c {
        for y in 0..h {
            let sy = (y + dy).checked_sub(pad).filter(|&sy| sy < h);
            let Some(sy) = sy else { continue };
            for x in 0..w {
                let tx = if flip { w - 1 - x } else { x };
                if let Some(sx) = (tx + dx).checked_sub(pad).filter(|&sx| sx < w) {
                    out[(ch * h + y) * w + x] = image[(ch * h + sy) * w + sx];
                }
            }
        }
    }
    out
}

impl<D: Dataset> Dataset for Transformed<D> {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn input_dim(&self) -> usize {
        self.inner.input_dim()
    }
    fn num_classes(&self) -> usize {
        self.inner.num_classes()
    }
    fn get(&self, index: usize) -> Result<Example, DataError> {
        let mut ex = self.inner.get(index)?;
        let (c, h, w) = self.transforms.chw;
        if let Some(CropFlip { padding, seed }) = self.transforms.crop_flip {
            let epoch = self.epoch.load(Ordering::SeqCst);
            let r = mix(mix(mix(seed) ^ epoch) ^ index as u64);
            let span = 2 * padding as u64 + 1;
            let (dy, dx) = ((r % span) as usize, ((r / span) % span) as usize);
            let flip = (r >> 63) == 1;
            ex.features = crop_flip(&ex.features, (c, h, w), padding, dy, dx, flip);
        }
        if let Some((mean, std)) = &self.transforms.normalize {
            let plane = h * w;
            for (ch, values) in ex.features.chunks_exact_mut(plane).enumerate() {
                values.iter_mut().for_each(|v| *v = (*v - mean[ch]) / std[ch]);
            }
        }
        Ok(ex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn images() -> InMemoryDataset {
        // 4 images of 2x3x3, pixel value = 100 * image + 10 * channel + position.
        let mut f = Vec::new();
        for i in 0..4 {
            for c in 0..2 {
                for p in 0..9 {
                    f.push((100 * i + 10 * c + p) as f32);
                }
            }
        }
        InMemoryDataset::new("img", f, vec![0, 1, 0, 1], 18, 2).unwrap()
    }

    #[test]
    fn crop_shifts_with_zero_fill_and_flip_mirrors() {
        let img: Vec<f32> = (0..9).map(|v| v as f32 + 1.0).collect();
        // Offset (0, 0) of a 1-padded image: shifted down-right by one, zeros in row/col 0.
        assert_eq!(
            crop_flip(&img, (1, 3, 3), 1, 0, 0, false),
            [0., 0., 0., 0., 1., 2., 0., 4., 5.]
        );
        // Centre offset = the image; flipped = mirrored rows.
        assert_eq!(crop_flip(&img, (1, 3, 3), 1, 1, 1, false), img);
        assert_eq!(crop_flip(&img, (1, 3, 3), 1, 1, 1, true), [3., 2., 1., 6., 5., 4., 9., 8., 7.]);
    }

    #[test]
    fn draws_depend_on_seed_epoch_and_index_only() {
        let t = ImageTransforms {
            chw: (2, 3, 3),
            normalize: None,
            crop_flip: Some(CropFlip { padding: 1, seed: 5 }),
        };
        let a = Transformed::new(images(), t.clone()).unwrap();
        let b = Transformed::new(images(), t).unwrap();
        // Reading order does not matter (any rank, worker or batch layout).
        let forward: Vec<_> = (0..4).map(|i| a.get(i).unwrap()).collect();
        let backward: Vec<_> = (0..4).rev().map(|i| b.get(i).unwrap()).collect();
        assert_eq!(forward, backward.into_iter().rev().collect::<Vec<_>>());
        // Another epoch draws differently for at least one example.
        let epoch0: Vec<_> = (0..4).map(|i| a.get(i).unwrap()).collect();
        let differs = (1..20).any(|e| {
            a.set_epoch(e);
            (0..4).map(|i| a.get(i).unwrap()).collect::<Vec<_>>() != epoch0
        });
        assert!(differs);
    }

    #[test]
    fn normalisation_uses_the_training_set_channel_statistics() {
        let data = images();
        let (mean, std) = channel_stats(&data, 2).unwrap();
        // Channel 0: values 100 i + p over i < 4, p < 9: mean 150 + 4.
        assert!((mean[0] - 154.0).abs() < 1e-4 && (mean[1] - 164.0).abs() < 1e-4, "{mean:?}");
        let t = ImageTransforms { chw: (2, 3, 3), normalize: Some((mean, std)), crop_flip: None };
        let d = Transformed::new(data, t).unwrap();
        let all: Vec<f32> = (0..4).flat_map(|i| d.get(i).unwrap().features[..9].to_vec()).collect();
        let m = all.iter().sum::<f32>() / all.len() as f32;
        let v = all.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / all.len() as f32;
        assert!(m.abs() < 1e-4 && (v - 1.0).abs() < 1e-4, "mean {m} var {v}");
        assert!(Transformed::new(
            images(),
            ImageTransforms { chw: (3, 3, 3), ..Default::default() }.clone()
        )
        .is_ok());
        let bad = ImageTransforms {
            chw: (3, 3, 3),
            normalize: Some((vec![0.; 3], vec![1.; 3])),
            crop_flip: None,
        };
        assert!(Transformed::new(images(), bad).is_err());
    }
}
