//! IJB-B / IJB-C as insightface's `eval_ijbc.py` reads them: `DIR/meta/{target}_face_tid_mid.txt`
//! (`image template media` per line), `{target}_name_5pts_score.txt` (`image x1 y1 … x5 y5
//! score`, the same images in the same order), `{target}_template_pair_label.txt` (`template
//! template label`), and the images under `DIR/loose_crop/`. Every line is checked: a missing
//! file, a short or non-numeric line, or the two image lists disagreeing is an error naming the
//! file and line. [`write_synthetic_ijb`] writes a small set in the same layout.
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::face_align::{align_face, ARCFACE_TEMPLATE};
use crate::DataError;

/// Longest meta line read (IJB-C's are under 200 bytes).
const MAX_LINE: u64 = 4096;

/// One image: its file under `loose_crop/`, five landmarks, the detector's score, and the
/// template and media it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct IjbImage {
    pub name: String,
    pub landmarks: [[f64; 2]; 5],
    pub score: f32,
    pub template: i64,
    pub media: i64,
}

/// A parsed IJB set.
#[derive(Debug, Clone)]
pub struct IjbSet {
    pub root: PathBuf,
    /// `IJBB` or `IJBC`.
    pub target: String,
    pub images: Vec<IjbImage>,
    /// `(template, template, genuine)`.
    pub pairs: Vec<(i64, i64, bool)>,
}

fn bad(path: &Path, line: usize, why: impl std::fmt::Display) -> DataError {
    DataError::Malformed { path: path.to_path_buf(), reason: format!("line {line}: {why}") }
}

/// Calls `f(line_number, fields)` for each non-empty line of `path`.
fn each_line(
    path: &Path,
    mut f: impl FnMut(usize, &[&str]) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let file = std::fs::File::open(path)
        .map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    let mut reader = BufReader::new(file);
    let mut line = String::new();
    for number in 1.. {
        line.clear();
        let read = (&mut reader)
            .take(MAX_LINE + 1)
            .read_line(&mut line)
            .map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
        if read == 0 {
            break;
        }
        if read as u64 > MAX_LINE {
            return Err(bad(path, number, format!("longer than {MAX_LINE} bytes")));
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        if !fields.is_empty() {
            f(number, &fields)?;
        }
    }
    Ok(())
}

fn number<T: std::str::FromStr>(
    path: &Path,
    line: usize,
    what: &str,
    s: &str,
) -> Result<T, DataError> {
    s.parse().map_err(|_| bad(path, line, format!("{what} {s:?} is not a number")))
}

impl IjbSet {
    /// Reads `root/meta`'s three files for `target` (`IJBB` or `IJBC`).
    pub fn open(root: &Path, target: &str) -> Result<IjbSet, DataError> {
        if target != "IJBB" && target != "IJBC" {
            return Err(DataError::Malformed {
                path: root.to_path_buf(),
                reason: format!("target {target:?}: IJBB or IJBC"),
            });
        }
        let meta = root.join("meta");
        let t = target.to_lowercase();
        let tid_mid = meta.join(format!("{t}_face_tid_mid.txt"));
        let pts = meta.join(format!("{t}_name_5pts_score.txt"));
        let pair_file = meta.join(format!("{t}_template_pair_label.txt"));
        let mut membership = Vec::new();
        each_line(&tid_mid, |n, f| {
            if f.len() < 3 {
                return Err(bad(&tid_mid, n, "expected `image template media`"));
            }
            let template = number(&tid_mid, n, "template", f[1])?;
            let media = number(&tid_mid, n, "media", f[2])?;
            membership.push((f[0].to_string(), template, media));
            Ok(())
        })?;
        let mut images = Vec::with_capacity(membership.len());
        each_line(&pts, |n, f| {
            if f.len() != 12 {
                return Err(bad(
                    &pts,
                    n,
                    format!("expected `image x1 y1 .. x5 y5 score`, got {} fields", f.len()),
                ));
            }
            let Some((name, template, media)) = membership.get(images.len()) else {
                return Err(bad(&pts, n, format!("more images than {} lists", tid_mid.display())));
            };
            if name != f[0] {
                return Err(bad(
                    &pts,
                    n,
                    format!("image {} where {} lists {name}", f[0], tid_mid.display()),
                ));
            }
            let mut landmarks = [[0f64; 2]; 5];
            for (i, p) in landmarks.iter_mut().enumerate() {
                // eval_ijbc.py reads them as float32.
                let x: f32 = number(&pts, n, "landmark", f[1 + 2 * i])?;
                let y: f32 = number(&pts, n, "landmark", f[2 + 2 * i])?;
                *p = [f64::from(x), f64::from(y)];
            }
            let score: f32 = number(&pts, n, "score", f[11])?;
            images.push(IjbImage {
                name: name.clone(),
                landmarks,
                score,
                template: *template,
                media: *media,
            });
            Ok(())
        })?;
        if images.len() != membership.len() {
            return Err(DataError::Malformed {
                path: pts,
                reason: format!(
                    "{} images, {} lists {}",
                    images.len(),
                    tid_mid.display(),
                    membership.len()
                ),
            });
        }
        let mut pairs = Vec::new();
        each_line(&pair_file, |n, f| {
            if f.len() < 3 {
                return Err(bad(&pair_file, n, "expected `template template label`"));
            }
            let label: i64 = number(&pair_file, n, "label", f[2])?;
            if label != 0 && label != 1 {
                return Err(bad(&pair_file, n, format!("label {label}: 0 or 1")));
            }
            pairs.push((
                number(&pair_file, n, "template", f[0])?,
                number(&pair_file, n, "template", f[1])?,
                label == 1,
            ));
            Ok(())
        })?;
        Ok(IjbSet { root: root.to_path_buf(), target: target.to_string(), images, pairs })
    }

    /// Image `i` aligned to the arcface template: `side` x `side` interleaved RGB.
    pub fn aligned(&self, i: usize, side: usize) -> Result<Vec<u8>, DataError> {
        let image = &self.images[i];
        let path = self.root.join("loose_crop").join(&image.name);
        let bytes =
            std::fs::read(&path).map_err(|source| DataError::Io { path: path.clone(), source })?;
        let rgb = image::load_from_memory(&bytes)
            .map_err(|e| DataError::Malformed {
                path: path.clone(),
                reason: format!("cannot decode the image: {e}"),
            })?
            .to_rgb8();
        let (w, h) = rgb.dimensions();
        align_face(rgb.as_raw(), w as usize, h as usize, &image.landmarks, side).ok_or_else(|| {
            DataError::Malformed { path, reason: "its five landmarks coincide".into() }
        })
    }
}

impl IjbSet {
    /// Image `i` aligned at 112x112 and normalised as arcface_torch feeds it (`[3, 112, 112]`),
    /// and its mirror image: `eval_ijbc.py`'s two inputs per face.
    pub fn face_and_mirror(&self, i: usize) -> Result<[Vec<f32>; 2], DataError> {
        use super::faces::{normalised, FACE_SIDE};
        let rgb = self.aligned(i, FACE_SIDE)?;
        let img = image::RgbImage::from_raw(FACE_SIDE as u32, FACE_SIDE as u32, rgb)
            .expect("an aligned face is side x side RGB");
        Ok([normalised(&img, FACE_SIDE, false), normalised(&img, FACE_SIDE, true)])
    }
}

/// What [`write_synthetic_ijb`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticIjb {
    pub images: usize,
    pub templates: usize,
    pub pairs: usize,
}

/// A small IJB set in insightface's layout under `dir`: `identities` identities, each with two
/// templates of `per_template` images in two media; every image a synthetic face
/// ([`super::faces`]'s patterns, under a random colour cast, contrast and noise) placed in a
/// 160x160 loose crop by a random similarity, with
/// its landmarks (the template's points moved the same way, plus noise) and a detector score in
/// [0.6, 1). Pairs: each identity's two templates (genuine), and each template against the next
/// identity's (impostor).
pub fn write_synthetic_ijb(
    dir: &Path,
    target: &str,
    identities: usize,
    per_template: usize,
    seed: u64,
) -> Result<SyntheticIjb, DataError> {
    if identities < 2 || per_template == 0 {
        return Err(DataError::Malformed {
            path: dir.to_path_buf(),
            reason: format!("a synthetic IJB set needs >= 2 identities and >= 1 image per template (got {identities}, {per_template})"),
        });
    }
    let t = target.to_lowercase();
    let (meta, crops) = (dir.join("meta"), dir.join("loose_crop"));
    for d in [&meta, &crops] {
        std::fs::create_dir_all(d).map_err(|source| DataError::Io { path: d.clone(), source })?;
    }
    let mut mt = rand_mt::Mt64::new(seed);
    let mut uniform =
        |lo: f64, hi: f64| lo + (hi - lo) * (mt.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let (mut tid_mid, mut pts, mut pairs) = (String::new(), String::new(), String::new());
    let side = 160usize;
    let mut images = 0;
    for id in 0..identities {
        for k in 0..2 {
            let template = (2 * id + k) as i64 + 1;
            for j in 0..per_template {
                let media = template * 100 + (j % 2) as i64;
                let mut face = super::faces::synthetic_face(id, (k * per_template + j) as u64, 112);
                // Capture conditions: a colour cast and contrast per image, and sensor noise,
                // so that verifying takes more than matching colours.
                let gains = [uniform(0.55, 1.45), uniform(0.55, 1.45), uniform(0.55, 1.45)];
                let offset = uniform(-40.0, 40.0);
                for px in face.pixels_mut() {
                    for (c, v) in px.0.iter_mut().enumerate() {
                        let noisy = f64::from(*v) * gains[c] + offset + uniform(-45.0, 45.0);
                        *v = noisy.clamp(0.0, 255.0) as u8;
                    }
                }
                // A similarity from the 112x112 face into the loose crop.
                let (s, a) = (uniform(0.9, 1.2), uniform(-0.3, 0.3));
                let (tx, ty) = (uniform(10.0, 30.0), uniform(10.0, 30.0));
                let fwd = [[s * a.cos(), -s * a.sin(), tx], [s * a.sin(), s * a.cos(), ty]];
                let crop = crate::face_align::warp_affine(face.as_raw(), 112, 112, &fwd, side);
                let name = format!("{template}_{j}.png");
                let img = image::RgbImage::from_raw(side as u32, side as u32, crop)
                    .expect("side x side RGB");
                let path = crops.join(&name);
                img.save(&path).map_err(|e| DataError::Malformed {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
                tid_mid.push_str(&format!("{name} {template} {media}\n"));
                pts.push_str(&name);
                for p in ARCFACE_TEMPLATE {
                    let x = fwd[0][0] * p[0] + fwd[0][1] * p[1] + fwd[0][2] + uniform(-0.8, 0.8);
                    let y = fwd[1][0] * p[0] + fwd[1][1] * p[1] + fwd[1][2] + uniform(-0.8, 0.8);
                    pts.push_str(&format!(" {x:.3} {y:.3}"));
                }
                pts.push_str(&format!(" {:.4}\n", uniform(0.6, 1.0)));
                images += 1;
            }
        }
        let (a, b) = (2 * id as i64 + 1, 2 * id as i64 + 2);
        let other = (2 * ((id + 1) % identities)) as i64 + 1;
        pairs.push_str(&format!("{a} {b} 1\n{a} {other} 0\n{b} {} 0\n", other + 1));
    }
    for (name, text) in [
        (format!("{t}_face_tid_mid.txt"), tid_mid),
        (format!("{t}_name_5pts_score.txt"), pts),
        (format!("{t}_template_pair_label.txt"), pairs),
    ] {
        let path = meta.join(name);
        std::fs::write(&path, text).map_err(|source| DataError::Io { path, source })?;
    }
    Ok(SyntheticIjb { images, templates: 2 * identities, pairs: 3 * identities })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synthetic_set_reads_back_and_bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let w = write_synthetic_ijb(dir.path(), "IJBC", 3, 2, 1).unwrap();
        assert_eq!(w, SyntheticIjb { images: 12, templates: 6, pairs: 9 });
        let set = IjbSet::open(dir.path(), "IJBC").unwrap();
        assert_eq!(set.images.len(), 12);
        assert_eq!(set.pairs.iter().filter(|p| p.2).count(), 3);
        let face = set.aligned(0, 112).unwrap();
        assert_eq!(face.len(), 112 * 112 * 3);
        assert!(
            face.iter().filter(|&&v| v == 0).count() < face.len() / 10,
            "the face fills the crop"
        );
        let pts = dir.path().join("meta/ijbc_name_5pts_score.txt");
        let text = std::fs::read_to_string(&pts).unwrap();
        std::fs::write(&pts, text.replacen(" 0.", " x.", 1)).unwrap();
        let e = IjbSet::open(dir.path(), "IJBC").unwrap_err().to_string();
        assert!(e.contains("ijbc_name_5pts_score.txt") && e.contains("line 1"), "{e}");
        let e = IjbSet::open(dir.path(), "IJBA").unwrap_err().to_string();
        assert!(e.contains("IJBB or IJBC"), "{e}");
    }
}
