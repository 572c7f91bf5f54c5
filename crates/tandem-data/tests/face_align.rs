//! Face alignment against insightface's (fixtures/face_align/make_fixture.py: scikit-image's
//! similarity estimate and OpenCV's warpAffine on a random image): the same matrix to float32
//! rounding, and the same pixels but for a few values in 10^4 one level apart (cv2 5.0's
//! vector rounding), end to end too.
use std::path::Path;

use candle_core::{Device, Tensor};
use tandem_data::face_align::{align_face, similarity_transform, warp_affine, ARCFACE_TEMPLATE};

fn fixture() -> std::collections::HashMap<String, Tensor> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/face_align/face_align.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap()
}

#[test]
fn alignment_equals_skimage_and_opencv() {
    let f = fixture();
    let image = f["image"].flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let (h, w) = (f["image"].dim(0).unwrap(), f["image"].dim(1).unwrap());
    let landmarks = f["landmarks"].to_vec3::<f64>().unwrap();
    let matrices = f["matrices"].to_vec3::<f64>().unwrap();
    let aligned = f["aligned"].flatten_from(1).unwrap().to_vec2::<u8>().unwrap();
    for (k, lmk) in landmarks.iter().enumerate() {
        let lmk: Vec<[f64; 2]> = lmk.iter().map(|p| [p[0], p[1]]).collect();
        let m = similarity_transform(&lmk, &ARCFACE_TEMPLATE).unwrap();
        for r in 0..2 {
            for c in 0..3 {
                let want = matrices[k][r][c];
                // skimage works in float32 on eval_ijbc.py's float32 points (its SVD too): the
                // two agree to float32's precision — scale and rotation to 1e-6, the
                // translation, in pixels, to 1e-4.
                let tol = if c == 2 { 1e-4 } else { 1e-6 };
                let off = (m[r][c] - want).abs();
                assert!(off <= tol, "set {k} [{r}][{c}] off by {off}: {m:?} vs {:?}", matrices[k]);
            }
        }
        // The warp itself, from skimage's own matrix: at most 2 values in 10^4 one level off.
        let want = &matrices[k];
        let skimage_m =
            [[want[0][0], want[0][1], want[0][2]], [want[1][0], want[1][1], want[1][2]]];
        let ours = warp_affine(&image, w, h, &skimage_m, 112);
        let differ = ours.iter().zip(&aligned[k]).filter(|(a, b)| a != b).count();
        let most = ours.iter().zip(&aligned[k]).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
        assert!(
            differ * 5000 <= ours.len() && most <= 1,
            "set {k}: {differ} values differ from cv2, by up to {most}"
        );
        // And end to end from the landmarks.
        let lmk5: [[f64; 2]; 5] = std::array::from_fn(|i| lmk[i]);
        let end = align_face(&image, w, h, &lmk5, 112).unwrap();
        let off = end.iter().zip(&aligned[k]).filter(|(a, b)| a != b).count();
        assert!(off * 1000 <= end.len(), "set {k}: {off} values differ end to end");
    }
}
