//! insightface's face-recognition data: a RecordIO identity set (`train.rec` + `train.idx`,
//! [`FaceRecDataset`]), the `.bin` verification pairs ([`VerificationSet`]) and a synthetic
//! identity set in both formats ([`write_synthetic_faces`]), so recipes and tests need no
//! download.
//!
//! Images are decoded (JPEG or PNG) to RGB and normalised as arcface_torch does,
//! `(x / 255 - 0.5) / 0.5`, channel-major `[3, H, W]`.
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::recordio::{IndexedRecordReader, IndexedRecordWriter, IrHeader};
use crate::{DataError, Dataset, Example};

/// The side of arcface_torch's face crops.
pub const FACE_SIDE: usize = 112;

fn malformed(path: &Path, reason: String) -> DataError {
    DataError::Malformed { path: path.to_path_buf(), reason }
}

/// An encoded image as RGB.
fn decode_rgb(bytes: &[u8]) -> Result<image::RgbImage, String> {
    let img =
        image::load_from_memory(bytes).map_err(|e| format!("cannot decode the image: {e}"))?;
    Ok(img.to_rgb8())
}

/// A `side` x `side` RGB image as arcface_torch normalises it, `(x / 255 - 0.5) / 0.5`,
/// channel-major, mirrored left-right when `flip`.
pub(crate) fn normalised(rgb: &image::RgbImage, side: usize, flip: bool) -> Vec<f32> {
    let mut out = vec![0f32; 3 * side * side];
    for (x, y, px) in rgb.enumerate_pixels() {
        let (x, y) = (x as usize, y as usize);
        let col = if flip { side - 1 - x } else { x };
        for c in 0..3 {
            out[c * side * side + y * side + col] = (px[c] as f32 / 255.0 - 0.5) / 0.5;
        }
    }
    out
}

/// Decodes an encoded image to normalised `[3, side, side]` floats, mirrored left-right when
/// `flip`. The error says what is wrong; the caller names the file and record.
pub fn decode_face(bytes: &[u8], side: usize, flip: bool) -> Result<Vec<f32>, String> {
    let rgb = decode_rgb(bytes)?;
    let (w, h) = rgb.dimensions();
    if (w as usize, h as usize) != (side, side) {
        return Err(format!("image is {w}x{h}, expected {side}x{side}"));
    }
    Ok(normalised(&rgb, side, flip))
}

/// [`decode_face`] for an image of any size: resized to `side` x `side` first (bilinear), as
/// arcface_torch's `inference.py` does before its forward pass.
pub fn decode_face_resized(bytes: &[u8], side: usize) -> Result<Vec<f32>, String> {
    let rgb = decode_rgb(bytes)?;
    let rgb = if rgb.dimensions() == (side as u32, side as u32) {
        rgb
    } else {
        use image::imageops::{resize, FilterType};
        resize(&rgb, side as u32, side as u32, FilterType::Triangle)
    };
    Ok(normalised(&rgb, side, false))
}

/// `[3, side, side]` values mirrored left-right.
fn mirror(image: &[f32], side: usize) -> Vec<f32> {
    image.chunks_exact(side).flat_map(|row| row.iter().rev().copied()).collect()
}

/// A well-mixed 64-bit hash of `(seed, a, b)` (splitmix64's finaliser): randomness keyed by
/// position rather than drawn from a stream, so it is the same for any world size and after a
/// resume.
pub fn keyed_hash(seed: u64, a: u64, b: u64) -> u64 {
    let mut z = seed ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A deterministic coin from (seed, epoch, index): the same flips for any world size.
fn flip_coin(seed: u64, epoch: u64, index: u64) -> bool {
    keyed_hash(seed, epoch, index) & 1 == 1
}

/// A face identity set: an insightface RecordIO file, as arcface_torch's `MXFaceDataset` reads
/// it — record 0 with `flag > 0` says the image records are keys `1 .. label[0]` and the classes
/// `label[1] - label[0]`; without it every key is an image (and the class count is the largest
/// label + 1); examples in key order — or an image folder, one sub-folder per identity, as
/// torchvision's `ImageFolder` reads it ([`FaceRecDataset::open_folder`]).
pub struct FaceRecDataset {
    source: Source,
    images: Vec<u64>,
    num_classes: usize,
    flip_seed: Option<u64>,
    epoch: AtomicU64,
}

/// Where the images are.
enum Source {
    Rec(IndexedRecordReader),
    Folder(super::image_folder::ImageFolder),
}

impl FaceRecDataset {
    /// An image folder of identities (`DIR/IDENTITY/IMAGE.jpg`): classes in sorted folder
    /// order, each image decoded when read (112x112 aligned crops, JPEG or PNG). Images that do
    /// not decode or are not 112x112 are left out at open, as `tandem data pack` leaves them
    /// out ([`ImageFolder::drop_unusable`](super::image_folder::ImageFolder::drop_unusable)),
    /// and returned with why beside the dataset.
    pub fn open_folder(dir: &Path) -> Result<(Self, Vec<(PathBuf, String)>), DataError> {
        let mut folder = super::image_folder::ImageFolder::list(dir)?;
        let skipped = folder.drop_unusable(FACE_SIDE)?;
        let dataset = FaceRecDataset {
            images: (0..folder.samples.len() as u64).collect(),
            num_classes: folder.classes.len(),
            source: Source::Folder(folder),
            flip_seed: None,
            epoch: AtomicU64::new(0),
        };
        Ok((dataset, skipped))
    }

    /// Opens `dir/train.rec` with `dir/train.idx`.
    pub fn open(dir: &Path) -> Result<Self, DataError> {
        let rec = dir.join("train.rec");
        let reader = IndexedRecordReader::open(&dir.join("train.idx"), &rec)?;
        let header0 = match reader.contains(0) {
            true => {
                let r = reader.read(0)?;
                Some(IrHeader::unpack(&r).map_err(|e| malformed(&rec, format!("record 0: {e}")))?.0)
            }
            false => None,
        };
        let (images, num_classes) = match header0 {
            Some(h) if !h.labels.is_empty() => {
                let (end, ids_end) = (h.labels[0], h.labels.get(1).copied().unwrap_or(h.labels[0]));
                let whole = |x: f32| x.is_finite() && x.fract() == 0.0;
                if !(whole(end) && whole(ids_end) && end >= 1.0 && ids_end >= end) {
                    return Err(malformed(&rec, format!("record 0: header labels {:?} are not (end of images, end of identities)", h.labels)));
                }
                // Images are records 1..end and identities end..ids_end: both ranges must fit in
                // train.idx before anything is sized by them.
                let records = reader.keys().len() as f64;
                let (images, classes) = (f64::from(end) - 1.0, f64::from(ids_end) - f64::from(end));
                if images > records || classes > records {
                    return Err(malformed(
                        &rec,
                        format!(
                            "record 0 claims {images} images and {classes} identities, but \
                             train.idx holds {records} records"
                        ),
                    ));
                }
                ((1..end as u64).collect::<Vec<_>>(), classes as usize)
            }
            _ => (reader.keys().to_vec(), 0),
        };
        if let Some(k) = images.iter().find(|&&k| !reader.contains(k)) {
            return Err(malformed(
                &rec,
                format!("image record {k} (from record 0's header) is not in train.idx"),
            ));
        }
        let mut dataset = FaceRecDataset {
            source: Source::Rec(reader),
            images,
            num_classes,
            flip_seed: None,
            epoch: AtomicU64::new(0),
        };
        if dataset.num_classes == 0 {
            let mut max = -1i64;
            for i in 0..dataset.images.len() {
                max = max.max(dataset.label(i)?);
            }
            dataset.num_classes = (max + 1) as usize;
        }
        Ok(dataset)
    }

    /// Mirror each image left-right with probability 1/2, drawn from `seed`, the epoch
    /// ([`FaceRecDataset::set_epoch`]) and the example's index: the same for any world size.
    pub fn with_flip(mut self, seed: u64) -> Self {
        self.flip_seed = Some(seed);
        self
    }

    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The record key of example `index`.
    pub fn key(&self, index: usize) -> Option<u64> {
        self.images.get(index).copied()
    }

    fn record(
        &self,
        reader: &IndexedRecordReader,
        index: usize,
    ) -> Result<(u64, Vec<u8>), DataError> {
        let key =
            self.key(index).ok_or(DataError::IndexOutOfRange { index, len: self.images.len() })?;
        Ok((key, reader.read(key)?))
    }

    /// Example `index`'s class, read from its header alone.
    pub fn label(&self, index: usize) -> Result<i64, DataError> {
        let reader = match &self.source {
            Source::Rec(reader) => reader,
            Source::Folder(f) => {
                let len = f.samples.len();
                return f
                    .samples
                    .get(index)
                    .map(|(_, l)| *l as i64)
                    .ok_or(DataError::IndexOutOfRange { index, len });
            }
        };
        let (key, r) = self.record(reader, index)?;
        let (h, _) = IrHeader::unpack(&r)
            .map_err(|e| malformed(reader.path(), format!("record {key}: {e}")))?;
        // Labels are class indices: whole, non-negative, within i32 (what a head can index).
        if !(h.label.is_finite()
            && h.label.fract() == 0.0
            && (0.0..2_147_483_648.0).contains(&h.label))
        {
            return Err(malformed(
                reader.path(),
                format!("record {key}: label {} is not a class index", h.label),
            ));
        }
        Ok(h.label as i64)
    }
}

impl Dataset for FaceRecDataset {
    fn len(&self) -> usize {
        self.images.len()
    }
    fn input_dim(&self) -> usize {
        3 * FACE_SIDE * FACE_SIDE
    }
    fn num_classes(&self) -> usize {
        self.num_classes
    }
    fn get(&self, index: usize) -> Result<Example, DataError> {
        let flip = self
            .flip_seed
            .is_some_and(|s| flip_coin(s, self.epoch.load(Ordering::Relaxed), index as u64));
        let (features, label) = match &self.source {
            Source::Rec(reader) => {
                let (key, r) = self.record(reader, index)?;
                let path = reader.path();
                let (h, payload) = IrHeader::unpack(&r)
                    .map_err(|e| malformed(path, format!("record {key}: {e}")))?;
                let features = decode_face(payload, FACE_SIDE, flip)
                    .map_err(|e| malformed(path, format!("record {key}: {e}")))?;
                (features, h.label as i64)
            }
            Source::Folder(f) => {
                let len = f.samples.len();
                let (path, label) =
                    f.samples.get(index).ok_or(DataError::IndexOutOfRange { index, len })?;
                let bytes = std::fs::read(path)
                    .map_err(|source| DataError::Io { path: path.clone(), source })?;
                let features =
                    decode_face(&bytes, FACE_SIDE, flip).map_err(|e| malformed(path, e))?;
                (features, *label as i64)
            }
        };
        if label < 0 || label as usize >= self.num_classes {
            return Err(DataError::LabelOutOfRange { index, label, num_classes: self.num_classes });
        }
        Ok(Example { features, label })
    }
}

/// An insightface `.bin` verification set: a pickle of (encoded images, issame flags), the
/// pairs being images (2i, 2i + 1).
pub struct VerificationSet {
    pub path: PathBuf,
    pub images: Vec<Vec<u8>>,
    pub issame: Vec<bool>,
}

impl VerificationSet {
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let bad = |reason: String| malformed(path, reason);
        let value = tandem_ckpt::read_pickle(path)
            .map_err(|e| bad(format!("not a verification set: {e}")))?;
        use tandem_ckpt::{ElemType, Value};
        let (Value::Tuple(items) | Value::List(items)) = &value else {
            return Err(bad(format!(
                "expected a (images, issame) pair, got a {}",
                value.type_name()
            )));
        };
        let [Value::List(images), flags] = items.as_slice() else {
            return Err(bad("expected a pair (list of images, issame)".into()));
        };
        // insightface's older tools pickle each image as bytes, its current ones as a numpy
        // uint8 array (read as a 1-D u8 tensor); the flags as bools, numpy bools or one numpy
        // bool array.
        let images = images
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::Bytes(b) => Ok(b.clone()),
                Value::Tensor(t) if t.dtype == ElemType::U8 && t.shape.len() == 1 => {
                    Ok(t.contiguous_bytes().into_owned())
                }
                other => Err(bad(format!(
                    "image {i} is a {}, not bytes or a 1-D uint8 array",
                    other.type_name()
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let issame = match flags {
            Value::List(flags) => flags
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_bool().ok_or_else(|| {
                        bad(format!("issame {i} is a {}, not a bool", v.type_name()))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            Value::Tensor(t) if t.dtype == ElemType::Bool && t.shape.len() == 1 => {
                t.contiguous_bytes().iter().map(|&b| b != 0).collect()
            }
            other => {
                return Err(bad(format!(
                    "issame is a {}, not a list of bools or a 1-D bool array",
                    other.type_name()
                )))
            }
        };
        if images.len() != 2 * issame.len() {
            return Err(bad(format!(
                "{} images for {} pairs (needs 2 per pair)",
                images.len(),
                issame.len()
            )));
        }
        Ok(VerificationSet { path: path.to_path_buf(), images, issame })
    }

    /// Image `index` normalised, as-is and mirrored (the two views whose embeddings are summed).
    pub fn image(&self, index: usize, side: usize) -> Result<[Vec<f32>; 2], DataError> {
        let bytes = self
            .images
            .get(index)
            .ok_or(DataError::IndexOutOfRange { index, len: self.images.len() })?;
        let at = |e: String| malformed(&self.path, format!("image {index}: {e}"));
        let plain = decode_face(bytes, side, false).map_err(at)?;
        let flipped = mirror(&plain, side);
        Ok([plain, flipped])
    }

    pub fn pairs(&self) -> usize {
        self.issame.len()
    }
}

/// Image encoding of [`write_synthetic_faces`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaceFormat {
    Jpeg,
    Png,
}

/// What [`write_synthetic_faces`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticFaces {
    pub images: usize,
    pub classes: usize,
    pub pairs: usize,
}

/// One synthetic face: a per-class pattern (smooth colour fields from the class's seed) plus
/// per-image noise and a small shift, so classes are learnable and images within one differ.
pub(crate) fn synthetic_face(class: usize, sample: u64, side: usize) -> image::RgbImage {
    let mut rng = rand_mt::Mt64::new(0x5eed_face ^ ((class as u64) << 20));
    let mut f = || (rng.next_u64() % 10_000) as f32 / 10_000.0;
    let params: Vec<f32> = (0..12).map(|_| f()).collect();
    let mut noise = rand_mt::Mt64::new(sample.wrapping_mul(0x9e37_79b9) ^ class as u64);
    let (dx, dy) = ((noise.next_u64() % 5) as f32 - 2.0, (noise.next_u64() % 5) as f32 - 2.0);
    image::RgbImage::from_fn(side as u32, side as u32, |x, y| {
        let (u, v) = ((x as f32 + dx) / side as f32, (y as f32 + dy) / side as f32);
        let mut px = |c: usize| {
            let p = &params[c * 4..c * 4 + 4];
            let s = (std::f32::consts::TAU * (p[0] * 3.0 * u + p[1] * 3.0 * v + p[2])).sin() * 0.5
                + 0.5;
            let jitter = (noise.next_u64() % 32) as f32 / 255.0;
            ((s * 0.8 + p[3] * 0.2 + jitter).clamp(0.0, 1.0) * 255.0) as u8
        };
        image::Rgb([px(0), px(1), px(2)])
    })
}

fn encode(img: &image::RgbImage, format: FaceFormat) -> Result<Vec<u8>, String> {
    let mut out = Cursor::new(Vec::new());
    let fmt = match format {
        FaceFormat::Jpeg => image::ImageOutputFormat::Jpeg(95),
        FaceFormat::Png => image::ImageOutputFormat::Png,
    };
    img.write_to(&mut out, fmt).map_err(|e| e.to_string())?;
    Ok(out.into_inner())
}

/// Writes a synthetic identity set to `dir`: `train.rec`/`train.idx` laid out as insightface's
/// `rec_builder` does (images 1..=N labelled by class in class order, one identity record per
/// class, record 0 last with (first identity record, end)), and `pairs.bin`, a verification set
/// of `pairs` pairs from held-out images (half same-class), pickled like insightface's.
pub fn write_synthetic_faces(
    dir: &Path,
    classes: usize,
    per_class: usize,
    side: usize,
    format: FaceFormat,
    pairs: usize,
) -> Result<SyntheticFaces, DataError> {
    if classes < 2 || per_class == 0 || side < 8 {
        return Err(malformed(dir, format!("synthetic faces need >= 2 classes, >= 1 image per class and side >= 8 (got {classes}, {per_class}, {side})")));
    }
    std::fs::create_dir_all(dir).map_err(|source| DataError::Io { path: dir.into(), source })?;
    let (idx, rec) = (dir.join("train.idx"), dir.join("train.rec"));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Io { path, source }
    };
    let enc = |e: String| malformed(&rec, e);
    let mut w = IndexedRecordWriter::create(&idx, &rec)?;
    let mut key = 1u64;
    let mut identities = Vec::with_capacity(classes);
    for class in 0..classes {
        let first = key;
        for s in 0..per_class {
            let img = encode(&synthetic_face(class, s as u64, side), format).map_err(enc)?;
            w.write(key, &IrHeader::scalar(class as f32, key).pack(&img)).map_err(io(&rec))?;
            key += 1;
        }
        identities.push([first as f32, key as f32]);
    }
    let first_identity = key;
    for id in identities {
        w.write(key, &IrHeader::vector(id.to_vec(), key).pack(&[])).map_err(io(&rec))?;
        key += 1;
    }
    let mut h0 = IrHeader::vector(vec![first_identity as f32, key as f32], 0);
    h0.id2 = 1;
    w.write(0, &h0.pack(&[])).map_err(io(&rec))?;
    w.finish().map_err(io(&rec))?;

    // Pairs from images the training set does not hold (sample numbers past per_class).
    use tandem_ckpt::Value;
    let mut images = Vec::with_capacity(2 * pairs);
    let mut issame = Vec::with_capacity(pairs);
    for p in 0..pairs {
        let same = p % 2 == 0;
        let a = p % classes;
        let b = if same { a } else { (a + 1 + p / 2 % (classes - 1)) % classes };
        let sample = (per_class + 2 * p) as u64;
        images.push(Value::Bytes(encode(&synthetic_face(a, sample, side), format).map_err(enc)?));
        images
            .push(Value::Bytes(encode(&synthetic_face(b, sample + 1, side), format).map_err(enc)?));
        issame.push(Value::Bool(same));
    }
    let bin = dir.join("pairs.bin");
    tandem_ckpt::write_pickle(&bin, &Value::Tuple(vec![Value::List(images), Value::List(issame)]))
        .map_err(|e| malformed(&bin, e.to_string()))?;
    Ok(SyntheticFaces { images: classes * per_class, classes, pairs })
}

/// insightface's verification accuracy (`eval/verification.py`, `evaluate` with
/// `nrof_folds` folds, no PCA): rows `2i` and `2i + 1` of `embeddings` are pair `i` (each
/// L2-normalised here; callers sum an image's and its mirror's embeddings first), the
/// distance is the squared L2 distance, thresholds `0, 0.01, .., 3.99`; per fold (contiguous,
/// unshuffled, as sklearn's `KFold`) the threshold that is most accurate on the other folds
/// (the first, on ties) is scored on this one. Returns the folds' mean accuracy and their
/// standard deviation (population, numpy's default).
pub fn verification_accuracy(
    embeddings: &[Vec<f32>],
    issame: &[bool],
    folds: usize,
) -> Result<(f64, f64), String> {
    let n = issame.len();
    if embeddings.len() != 2 * n {
        return Err(format!("{} embeddings for {n} pairs", embeddings.len()));
    }
    if folds < 2 || folds > n {
        return Err(format!("{folds} folds for {n} pairs (needs 2 <= folds <= pairs)"));
    }
    let unit = |e: &[f32]| -> Vec<f64> {
        let norm = e.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt().max(1e-12);
        e.iter().map(|&x| x as f64 / norm).collect()
    };
    let dist: Vec<f64> = (0..n)
        .map(|i| {
            let (a, b) = (unit(&embeddings[2 * i]), unit(&embeddings[2 * i + 1]));
            a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum()
        })
        .collect();
    let accuracy = |threshold: f64, idx: &[usize]| -> f64 {
        let right = idx.iter().filter(|&&i| (dist[i] < threshold) == issame[i]).count();
        right as f64 / idx.len() as f64
    };
    let thresholds: Vec<f64> = (0..400).map(|i| i as f64 * 0.01).collect();
    let mut accs = Vec::with_capacity(folds);
    let mut start = 0;
    for f in 0..folds {
        let size = n / folds + usize::from(f < n % folds);
        let test: Vec<usize> = (start..start + size).collect();
        let train: Vec<usize> = (0..n).filter(|i| !(start..start + size).contains(i)).collect();
        start += size;
        let mut best = (0, f64::NEG_INFINITY);
        for (t, &th) in thresholds.iter().enumerate() {
            let a = accuracy(th, &train);
            if a > best.1 {
                best = (t, a);
            }
        }
        accs.push(accuracy(thresholds[best.0], &test));
    }
    let mean = accs.iter().sum::<f64>() / folds as f64;
    let var = accs.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / folds as f64;
    Ok((mean, var.sqrt()))
}
