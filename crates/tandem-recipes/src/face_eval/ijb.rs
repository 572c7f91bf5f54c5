//! IJB-B/C 1:1 verification as insightface's `eval_ijbc.py` scores it, from image embeddings:
//! each image's feature is its embedding plus its mirror's (the flip test), unnormalised (norm
//! weighting) and times its detector score; a template's feature is the sum over its media of
//! each media's mean feature, L2-normalised; a pair's score is the cosine of its templates.
//! TAR at FAR 1e-6 … 1e-1 are read off scikit-learn's `roc_curve` (its thresholds, the
//! collinear points dropped) at the false-positive rate nearest each target, the larger TAR
//! among equals, as the script reads them.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use tandem_comm::ProcessGroup;
use tandem_data::datasets::faces::FACE_SIDE;
use tandem_data::datasets::ijb::IjbSet;
use tandem_train::{Result, TrainError};

/// IJB inputs that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum IjbError {
    #[error("rank {rank} sent {values} values, short of its images' embeddings")]
    ShortEmbeddings { rank: usize, values: usize },
    #[error("{what}: {got} values for {images} images")]
    Count { what: &'static str, got: usize, images: usize },
    #[error("pair {pair}: template {template} has no image")]
    EmptyTemplate { pair: usize, template: i64 },
    #[error("scores: {scores} values for {pairs} pairs")]
    Scores { scores: usize, pairs: usize },
    #[error("the pairs hold no {missing} pair: TAR@FAR needs genuine and impostor pairs")]
    OneKindOfPair { missing: &'static str },
}

impl From<IjbError> for TrainError {
    fn from(e: IjbError) -> Self {
        TrainError::Recipe(Box::new(e))
    }
}

/// The false-acceptance rates of insightface's table.
pub const FARS: [f64; 6] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1];

/// What an IJB evaluation found (rank 0's, from [`evaluate`]).
#[derive(Clone, Debug)]
pub struct IjbResult {
    pub images: usize,
    pub templates: usize,
    /// Every pair's score, in the pair file's order.
    pub scores: Vec<f64>,
    pub roc: Roc,
    /// TAR at each of [`FARS`].
    pub tars: Vec<f64>,
}

impl IjbResult {
    /// Writes the pair scores (`TARGET.npy`), the ROC plot (`TARGET_roc.svg`) and TAR at each
    /// FAR with the AUC (`TARGET_tar_far.json`) into `out`, naming the curve `network`.
    pub fn write(&self, out: &Path, target: &str, network: &str) -> Result<()> {
        fn wrote(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError {
            let what = format!("writing {}", path.display());
            move |e| TrainError::Failed { what, source: Box::new(e) }
        }
        std::fs::create_dir_all(out).map_err(wrote(out))?;
        let t = target.to_lowercase();
        tandem_ckpt::npy::write_f64_vector(&out.join(format!("{t}.npy")), &self.scores)?;
        let svg = out.join(format!("{t}_roc.svg"));
        std::fs::write(&svg, roc_svg(&self.roc, &format!("{network}-{target}")))
            .map_err(wrote(&svg))?;
        let json = out.join(format!("{t}_tar_far.json"));
        let doc = serde_json::json!({
            "network": network,
            "target": target,
            "far": FARS,
            "tar": self.tars,
            "auc": auc(&self.roc),
        });
        std::fs::write(&json, format!("{doc:#}")).map_err(wrote(&json))?;
        Ok(())
    }
}

/// Scores `set` with `embed` (a batch of `n` 112x112 faces, `[n, 3, 112, 112]` flattened, to
/// `n` embedding rows and their width). With a `group`, the ranks split the images round
/// robin, each embeds its share and its mirrors, and rank 0 gathers them and scores (a
/// collective; the other ranks get `None`).
pub fn evaluate(
    set: &IjbSet,
    embed: &mut dyn FnMut(Vec<f32>, usize) -> Result<(Vec<f32>, usize)>,
    batch_size: usize,
    group: Option<&ProcessGroup>,
) -> Result<Option<IjbResult>> {
    let (rank, world) = group.map_or((0, 1), |g| (g.rank(), g.size()));
    let mine: Vec<usize> = (rank..set.images.len()).step_by(world).collect();
    // Per image of `mine`, its embedding then its mirror's.
    let (mut rows, mut width) = (Vec::new(), 0);
    for chunk in mine.chunks(batch_size.max(1)) {
        let mut x = Vec::with_capacity(2 * chunk.len() * 3 * FACE_SIDE * FACE_SIDE);
        for &i in chunk {
            let [face, mirror] = set.face_and_mirror(i)?;
            x.extend(face);
            x.extend(mirror);
        }
        let (e, w) = embed(x, 2 * chunk.len())?;
        width = w;
        rows.extend(e);
    }
    let all: Vec<Vec<f32>> = match group {
        None => vec![rows],
        Some(g) => g
            .all_gather_bytes(bytemuck::cast_slice(&rows))?
            .into_iter()
            .map(|b| bytemuck::pod_collect_to_vec::<u8, f32>(&b))
            .collect(),
    };
    if rank != 0 {
        return Ok(None);
    }
    let width = if width == 0 { all.iter().map(Vec::len).max().unwrap_or(0) / 2 } else { width };
    let n = set.images.len();
    let (mut emb, mut flip) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for (r, rows) in all.iter().enumerate() {
        for (k, i) in (r..n).step_by(world).enumerate() {
            let at = 2 * k * width;
            let (Some(e), Some(f)) =
                (rows.get(at..at + width), rows.get(at + width..at + 2 * width))
            else {
                return Err(IjbError::ShortEmbeddings { rank: r, values: rows.len() }.into());
            };
            (emb[i], flip[i]) = (e.to_vec(), f.to_vec());
        }
    }
    let scores: Vec<f32> = set.images.iter().map(|im| im.score).collect();
    let templates: Vec<i64> = set.images.iter().map(|im| im.template).collect();
    let medias: Vec<i64> = set.images.iter().map(|im| im.media).collect();
    let feats = image_features(&emb, &flip, &scores)?;
    let (ids, tfeats) = template_features(&feats, &templates, &medias)?;
    let pairs: Vec<(i64, i64)> = set.pairs.iter().map(|p| (p.0, p.1)).collect();
    let labels: Vec<bool> = set.pairs.iter().map(|p| p.2).collect();
    let scores = pair_scores(&ids, &tfeats, &pairs)?;
    let roc = roc_curve(&labels, &scores)?;
    let tars = tar_at_far(&roc, &FARS);
    Ok(Some(IjbResult { images: n, templates: ids.len(), scores, roc, tars }))
}

/// Per image: `(embedding + mirrored embedding) · detector score` (`eval_ijbc.py`'s F1, N1, D1).
pub fn image_features(
    embeddings: &[Vec<f32>],
    flipped: &[Vec<f32>],
    detector_scores: &[f32],
) -> Result<Vec<Vec<f64>>> {
    let n = embeddings.len();
    for (what, got) in
        [("flipped embeddings", flipped.len()), ("detector scores", detector_scores.len())]
    {
        if got != n {
            return Err(IjbError::Count { what, got, images: n }.into());
        }
    }
    Ok(embeddings
        .iter()
        .zip(flipped)
        .zip(detector_scores)
        .map(|((e, f), &s)| {
            e.iter().zip(f).map(|(a, b)| (f64::from(*a) + f64::from(*b)) * f64::from(s)).collect()
        })
        .collect())
}

/// Templates (ascending) and their features: per template, the sum over its media (ascending)
/// of the media's mean image feature, L2-normalised (as scikit-learn's `normalize`, a zero
/// vector staying zero).
pub fn template_features(
    features: &[Vec<f64>],
    templates: &[i64],
    medias: &[i64],
) -> Result<(Vec<i64>, Vec<Vec<f64>>)> {
    let n = features.len();
    for (what, got) in [("templates", templates.len()), ("medias", medias.len())] {
        if got != n {
            return Err(IjbError::Count { what, got, images: n }.into());
        }
    }
    let width = features.first().map_or(0, Vec::len);
    let mut groups: BTreeMap<i64, BTreeMap<i64, Vec<usize>>> = BTreeMap::new();
    for (i, (&t, &m)) in templates.iter().zip(medias).enumerate() {
        groups.entry(t).or_default().entry(m).or_default().push(i);
    }
    let mut ids = Vec::with_capacity(groups.len());
    let mut feats = Vec::with_capacity(groups.len());
    for (t, media) in groups {
        let mut sum = vec![0f64; width];
        for images in media.values() {
            let mut mean = vec![0f64; width];
            for &i in images {
                mean.iter_mut().zip(&features[i]).for_each(|(m, v)| *m += v);
            }
            let k = images.len() as f64;
            sum.iter_mut().zip(&mean).for_each(|(s, m)| *s += m / k);
        }
        let norm = sum.iter().map(|v| v * v).sum::<f64>().sqrt();
        if norm > 0.0 {
            sum.iter_mut().for_each(|v| *v /= norm);
        }
        ids.push(t);
        feats.push(sum);
    }
    Ok((ids, feats))
}

/// The cosine of each pair's templates.
pub fn pair_scores(
    templates: &[i64],
    features: &[Vec<f64>],
    pairs: &[(i64, i64)],
) -> Result<Vec<f64>> {
    let index: BTreeMap<i64, usize> = templates.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    pairs
        .iter()
        .enumerate()
        .map(|(pair, &(a, b))| {
            let get = |template: i64| {
                index
                    .get(&template)
                    .map(|&i| &features[i])
                    .ok_or(IjbError::EmptyTemplate { pair, template })
            };
            let (fa, fb) = (get(a)?, get(b)?);
            Ok(fa.iter().zip(fb).map(|(x, y)| x * y).sum())
        })
        .collect()
}

/// scikit-learn's `roc_curve(labels, scores)` (with `drop_intermediate=True`).
#[derive(Debug, Clone, PartialEq)]
pub struct Roc {
    pub fpr: Vec<f64>,
    pub tpr: Vec<f64>,
    /// The first is +inf, as scikit-learn's.
    pub thresholds: Vec<f64>,
}

/// scikit-learn's `roc_curve`: scores sorted descending (stable), one point per distinct
/// score, the points that lie on a straight line between their neighbours dropped, and (0, 0)
/// in front.
pub fn roc_curve(labels: &[bool], scores: &[f64]) -> Result<Roc> {
    if labels.len() != scores.len() {
        return Err(IjbError::Scores { scores: scores.len(), pairs: labels.len() }.into());
    }
    let positives = labels.iter().filter(|&&l| l).count();
    if positives == 0 {
        return Err(IjbError::OneKindOfPair { missing: "genuine" }.into());
    }
    if positives == labels.len() {
        return Err(IjbError::OneKindOfPair { missing: "impostor" }.into());
    }
    // numpy's argsort(kind="mergesort")[::-1]: ascending stable, then reversed.
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    order.reverse();
    let (mut tps, mut fps, mut thresholds) = (Vec::new(), Vec::new(), Vec::new());
    let (mut tp, mut fp) = (0f64, 0f64);
    for (k, &i) in order.iter().enumerate() {
        if labels[i] {
            tp += 1.0;
        } else {
            fp += 1.0;
        }
        let last = k + 1 == order.len();
        if last || scores[order[k + 1]] != scores[i] {
            tps.push(tp);
            fps.push(fp);
            thresholds.push(scores[i]);
        }
    }
    if fps.len() > 2 {
        // Keep the ends and every point where either count bends (second difference ≠ 0).
        let keep: Vec<usize> = (0..fps.len())
            .filter(|&i| {
                i == 0
                    || i + 1 == fps.len()
                    || fps[i + 1] - 2.0 * fps[i] + fps[i - 1] != 0.0
                    || tps[i + 1] - 2.0 * tps[i] + tps[i - 1] != 0.0
            })
            .collect();
        tps = keep.iter().map(|&i| tps[i]).collect();
        fps = keep.iter().map(|&i| fps[i]).collect();
        thresholds = keep.iter().map(|&i| thresholds[i]).collect();
    }
    let (p, n) = (*tps.last().unwrap_or(&0.0), *fps.last().unwrap_or(&0.0));
    let fpr = std::iter::once(0.0).chain(fps.iter().map(|f| f / n)).collect();
    let tpr = std::iter::once(0.0).chain(tps.iter().map(|t| t / p)).collect();
    let thresholds = std::iter::once(f64::INFINITY).chain(thresholds).collect();
    Ok(Roc { fpr, tpr, thresholds })
}

/// `eval_ijbc.py`'s reading of the curve: for each target FAR, the TPR at the point whose FPR
/// is nearest, the last such point (the largest TPR) among equals.
pub fn tar_at_far(roc: &Roc, fars: &[f64]) -> Vec<f64> {
    fars.iter()
        .map(|&far| {
            let mut best = (f64::INFINITY, 0.0);
            // The script scans the curve reversed and keeps the first minimum: here, forwards,
            // the last one.
            for (f, t) in roc.fpr.iter().zip(&roc.tpr) {
                let d = (f - far).abs();
                if d <= best.0 {
                    best = (d, *t);
                }
            }
            best.1
        })
        .collect()
}

/// The area under the curve (trapezoids, as scikit-learn's `auc`).
pub fn auc(roc: &Roc) -> f64 {
    roc.fpr
        .windows(2)
        .zip(roc.tpr.windows(2))
        .map(|(f, t)| (f[1] - f[0]) * (t[1] + t[0]) / 2.0)
        .sum()
}

/// The table `eval_ijbc.py` prints: a header of the FARs and one row, `method-TARGET` then
/// each TAR in percent with two decimals.
pub fn table(method: &str, target: &str, tars: &[f64]) -> String {
    // Python's str() of each FAR, as the script's PrettyTable header prints them.
    let header = ["1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1"];
    let row: Vec<String> = tars.iter().map(|t| format!("{:.2}", t * 100.0)).collect();
    let name = format!("{method}-{target}");
    let width = name.len().max(7);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| {:<width$} | {} |",
        "Methods",
        header.iter().map(|h| format!("{h:>6}")).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(
        out,
        "| {name:<width$} | {} |",
        row.iter().map(|r| format!("{r:>6}")).collect::<Vec<_>>().join(" | ")
    );
    out
}

/// The ROC plot of `eval_ijbc.py` (FPR on a log axis from 1e-6 to 0.1, TPR from 0.3 to 1) as
/// an SVG document.
pub fn roc_svg(roc: &Roc, label: &str) -> String {
    let (w, h, left, bottom) = (640.0, 480.0, 70.0, 50.0);
    let (pw, ph) = (w - left - 20.0, h - bottom - 30.0);
    let x = |f: f64| left + (f.max(1e-6).log10() + 6.0) / 5.0 * pw;
    let y = |t: f64| 30.0 + (1.0 - (t.clamp(0.3, 1.0) - 0.3) / 0.7) * ph;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n<text x=\"{}\" y=\"20\" text-anchor=\"middle\">ROC on IJB</text>\n",
        w / 2.0
    );
    for (i, far) in FARS.iter().enumerate() {
        let gx = x(*far);
        let _ = writeln!(s, "<line x1=\"{gx:.1}\" y1=\"30\" x2=\"{gx:.1}\" y2=\"{:.1}\" stroke=\"#ccc\" stroke-dasharray=\"4\"/><text x=\"{gx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">1e-{}</text>", 30.0 + ph, 30.0 + ph + 16.0, 6 - i);
    }
    for k in 0..8 {
        let t = 0.3 + 0.1 * k as f64;
        let gy = y(t);
        let _ = writeln!(s, "<line x1=\"{left}\" y1=\"{gy:.1}\" x2=\"{:.1}\" y2=\"{gy:.1}\" stroke=\"#ccc\" stroke-dasharray=\"4\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{t:.1}</text>", left + pw, left - 6.0, gy + 4.0);
    }
    let points: Vec<String> = roc
        .fpr
        .iter()
        .zip(&roc.tpr)
        .filter(|(f, _)| **f >= 1e-6 && **f <= 0.1)
        .map(|(f, t)| format!("{:.2},{:.2}", x(*f), y(*t)))
        .collect();
    let _ = writeln!(
        s,
        "<polyline fill=\"none\" stroke=\"#66c2a5\" stroke-width=\"1.5\" points=\"{}\"/>",
        points.join(" ")
    );
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{label} (AUC = {:.4} %)</text>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">False Positive Rate</text>\n\
         <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">True Positive Rate</text>\n</svg>",
        left + pw - 8.0,
        30.0 + ph - 10.0,
        auc(roc) * 100.0,
        left + pw / 2.0,
        h - 8.0,
        30.0 + ph / 2.0,
        30.0 + ph / 2.0
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_class_pairs_and_unknown_templates_are_named() {
        assert!(roc_curve(&[true, true], &[0.1, 0.2])
            .unwrap_err()
            .to_string()
            .contains("no impostor"));
        let e = pair_scores(&[1], &[vec![1.0]], &[(1, 9)]).unwrap_err().to_string();
        assert!(e.contains("template 9"), "{e}");
    }
}
