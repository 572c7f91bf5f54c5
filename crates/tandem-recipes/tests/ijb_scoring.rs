//! IJB scoring against insightface's `eval_ijbc.py` steps run with numpy and scikit-learn
//! (fixtures/ijb/make_fixture.py): template features, pair scores, scikit-learn's `roc_curve`
//! (every point, threshold and tie) and `auc`, and the TAR@FAR the script's table reads.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use tandem_recipes::face_eval::ijb::{
    auc, image_features, pair_scores, roc_curve, tar_at_far, template_features, FARS,
};

fn fixture() -> HashMap<String, Tensor> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ijb/ijb_scoring.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol || x == y, "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn scoring_equals_eval_ijbc_with_scikit_learn() {
    let f = fixture();
    let rows = |k: &str| f[k].to_vec2::<f32>().unwrap();
    let ints = |k: &str| f[k].to_vec1::<i64>().unwrap();
    let floats = |k: &str| f[k].to_vec1::<f64>().unwrap();
    let faceness = f["faceness"].to_vec1::<f32>().unwrap();
    let feats = image_features(&rows("emb"), &rows("flip"), &faceness).unwrap();
    let (ids, tfeats) = template_features(&feats, &ints("templates"), &ints("medias")).unwrap();
    assert_eq!(ids, ints("template_ids"));
    let want = f["template_feats"].to_vec2::<f64>().unwrap();
    for (t, (ours, theirs)) in tfeats.iter().zip(&want).enumerate() {
        // numpy sums in float32 where the script's inputs are float32.
        close(ours, theirs, 1e-6, &format!("template {t}"));
    }
    let pairs: Vec<(i64, i64)> = ints("p1").into_iter().zip(ints("p2")).collect();
    let scores = pair_scores(&ids, &tfeats, &pairs).unwrap();
    close(&scores, &floats("score"), 1e-6, "pair scores");

    let labels: Vec<bool> = ints("label").iter().map(|&l| l == 1).collect();
    let roc = roc_curve(&labels, &floats("roc_scores")).unwrap();
    assert_eq!(roc.fpr, floats("fpr"), "fpr: every point scikit-learn keeps, and only those");
    assert_eq!(roc.tpr, floats("tpr"));
    assert_eq!(roc.thresholds, floats("thresholds"));
    assert!((auc(&roc) - floats("auc")[0]).abs() < 1e-12);
    assert_eq!(tar_at_far(&roc, &FARS), floats("tars"));
}
