//! A folder of face images, one sub-folder per identity (arcface_torch's
//! `docs/prepare_custom_dataset.md`), listed as torchvision's `ImageFolder` lists it — what
//! arcface_torch trains on when its data directory holds no `train.rec`: the classes are the
//! sub-folders in sorted order (class i is the i-th name), the images each class folder holds at
//! any depth, walked in sorted order, by extension. [`pack`] writes one as `train.rec` /
//! `train.idx` / `train.lst`, as mxnet's `im2rec --list --recursive --no-shuffle
//! --pass-through` does.
use std::path::{Path, PathBuf};

use crate::recordio::{IndexedRecordWriter, IrHeader};
use crate::DataError;

/// torchvision's `IMG_EXTENSIONS`: files with other extensions are not images (skipped).
const IMAGE_EXTENSIONS: [&str; 9] =
    ["jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"];
/// The encodings tandem decodes.
const DECODED: [&str; 3] = ["jpg", "jpeg", "png"];

fn malformed(path: &Path, reason: String) -> DataError {
    DataError::Malformed { path: path.to_path_buf(), reason }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// An identity folder's listing.
#[derive(Debug)]
pub struct ImageFolder {
    pub root: PathBuf,
    /// Class names (sub-folder names), sorted; class `i` is `classes[i]`.
    pub classes: Vec<String>,
    /// Every image and its class, in `ImageFolder`'s order.
    pub samples: Vec<(PathBuf, usize)>,
    /// Files that are not images by extension (`.txt`, `.DS_Store`), not listed.
    pub not_images: Vec<PathBuf>,
}

impl ImageFolder {
    /// Lists `root`. A file with an image extension tandem does not decode (`.bmp`, `.webp`,
    /// ...), a class folder without images, or a root without class folders is an error naming
    /// it.
    pub fn list(root: &Path) -> Result<ImageFolder, DataError> {
        let mut classes = Vec::new();
        for entry in std::fs::read_dir(root).map_err(io(root))? {
            let entry = entry.map_err(io(root))?;
            // (followlinks, as torchvision: a symlinked class folder counts)
            if entry.path().is_dir() {
                let name = entry.file_name();
                let Some(name) = name.to_str() else {
                    return Err(malformed(&entry.path(), "the folder name is not UTF-8".into()));
                };
                classes.push(name.to_string());
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(malformed(
                root,
                "no class folders: put each identity's images in a sub-folder of its own".into(),
            ));
        }
        let (mut samples, mut not_images) = (Vec::new(), Vec::new());
        for (label, class) in classes.iter().enumerate() {
            let dir = root.join(class);
            let mut files = files_under(&dir)?;
            // torchvision: sorted(os.walk(...)) then sorted(fnames): by folder, then name.
            files.sort_by(|a, b| (a.parent(), a.file_name()).cmp(&(b.parent(), b.file_name())));
            let before = samples.len();
            for f in files {
                let ext = f.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
                match ext.as_deref() {
                    Some(e) if DECODED.contains(&e) => samples.push((f, label)),
                    Some(e) if IMAGE_EXTENSIONS.contains(&e) => {
                        return Err(malformed(
                            &f,
                            format!(".{e} images are not decoded here: convert it to JPEG or PNG"),
                        ))
                    }
                    _ => not_images.push(f),
                }
            }
            if samples.len() == before {
                return Err(malformed(&dir, "the class folder holds no JPEG or PNG images".into()));
            }
        }
        Ok(ImageFolder { root: root.to_path_buf(), classes, samples, not_images })
    }

    /// Leaves out the images that cannot be trained on — they do not decode, or are not `side`
    /// x `side` — and returns them with why: the one rule of [`pack`] and of training straight
    /// from the folder (`--data folder:DIR`), applied before the first step so a run never stops
    /// at a bad file mid-epoch. Each image is read and decoded once.
    pub fn drop_unusable(&mut self, side: usize) -> Result<Vec<(PathBuf, String)>, DataError> {
        let mut skipped = Vec::new();
        let mut kept = Vec::with_capacity(self.samples.len());
        for (path, label) in std::mem::take(&mut self.samples) {
            match usable(&path, side)? {
                Ok(_) => kept.push((path, label)),
                Err(why) => skipped.push((path, why)),
            }
        }
        self.samples = kept;
        if self.samples.is_empty() {
            return Err(malformed(&self.root, "no usable image (every one was skipped)".into()));
        }
        Ok(skipped)
    }
}

/// `path`'s bytes when they are a `side` x `side` image tandem decodes, else why not (the rule
/// [`pack`] and [`ImageFolder::drop_unusable`] share); an unreadable file is an error.
fn usable(path: &Path, side: usize) -> Result<Result<Vec<u8>, String>, DataError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    Ok(super::faces::decode_face(&bytes, side, false).map(|_| bytes))
}

/// Every file under `dir`, following symlinked folders, at most 32 folders deep (so a symlink
/// loop is an error, not a hang); in no particular order.
pub fn files_under(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    walk(dir, &mut out, 0)?;
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) -> Result<(), DataError> {
    if depth > 32 {
        return Err(malformed(dir, "folders nested more than 32 deep (a symlink loop?)".into()));
    }
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            walk(&path, out, depth + 1)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// What [`pack`] wrote and left out.
#[derive(Debug, Default)]
pub struct PackReport {
    pub images: usize,
    pub classes: usize,
    /// Images that did not decode or are not `side` x `side`, with why.
    pub skipped: Vec<(PathBuf, String)>,
    /// Files that are not images by extension.
    pub not_images: usize,
}

/// Writes `folder` as `out/train.rec`, `out/train.idx` and `out/train.lst` (mxnet's im2rec
/// layout, which arcface_torch's `MXFaceDataset` and tandem's `--data rec:` read): record `i`
/// holds image `i` in listing order with the header (flag 0, label = its class, id = i) and
/// the file's own bytes; no header record, so every key is an image. Each image is decoded
/// first: one that fails, or is not `side` x `side` (arcface_torch's aligned crops are
/// 112x112), is skipped and reported, never written — or, when `strict`, ends the packing with
/// an error naming it and the partial files removed. `progress(done, total)` is called after
/// each image.
pub fn pack(
    folder: &ImageFolder,
    out: &Path,
    side: usize,
    strict: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PackReport, DataError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let (idx, rec, lst) = (out.join("train.idx"), out.join("train.rec"), out.join("train.lst"));
    let mut writer = IndexedRecordWriter::create(&idx, &rec)?;
    let mut list = String::new();
    let mut report = PackReport { not_images: folder.not_images.len(), ..Default::default() };
    let mut labels = std::collections::BTreeSet::new();
    let total = folder.samples.len();
    for (i, (path, label)) in folder.samples.iter().enumerate() {
        match usable(path, side)? {
            Err(why) if strict => {
                drop(writer);
                for f in [&idx, &rec, &lst] {
                    std::fs::remove_file(f).ok();
                }
                return Err(malformed(path, format!("{why} (nothing was written)")));
            }
            Err(why) => report.skipped.push((path.clone(), why)),
            Ok(bytes) => {
                let key = report.images as u64;
                let record = IrHeader::scalar(*label as f32, key).pack(&bytes);
                writer.write(key, &record).map_err(io(&rec))?;
                let shown = path.strip_prefix(&folder.root).unwrap_or(path);
                list.push_str(&format!("{key}\t{label}.000000\t{}\n", shown.display()));
                labels.insert(*label);
                report.images += 1;
            }
        }
        progress(i + 1, total);
    }
    writer.finish().map_err(io(&rec))?;
    std::fs::write(&lst, list).map_err(io(&lst))?;
    if report.images == 0 {
        return Err(malformed(
            &folder.root,
            "no image could be packed (every one was skipped)".into(),
        ));
    }
    report.classes = labels.len();
    Ok(report)
}
