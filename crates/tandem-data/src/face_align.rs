//! Five-point face alignment to arcface's 112x112 template, as insightface's evaluation scripts
//! do it (`eval_ijbc.py`): the similarity transform (rotation, uniform scale, translation) that
//! maps the detected landmarks onto the template in the least-squares sense (scikit-image's
//! `SimilarityTransform.estimate`), then OpenCV's `warpAffine` with bilinear interpolation and
//! a black border.
//!
//! The warp is OpenCV 5's bilinear `warpAffine`, written out because no crate does it and the
//! embeddings of a face set should not depend on which library cropped it: the inverted matrix
//! in float32, each source coordinate in float32, the four taps weighted by the fractional
//! parts and the sum rounded half to even; taps outside the image read 0. Against cv2 5.0 at
//! most a few values in 10⁴ come out one level apart (its vector code rounds a little
//! differently); OpenCV 4's fixed-point warp (coordinates in 1/32 pixel) differs from both by
//! up to a few levels.

/// arcface's 112x112 landmark template (eyes, nose tip, mouth corners): the 96x112 original in
/// float32 with `x` shifted by 8, as `eval_ijbc.py` builds it (its float32 values, not the
/// decimals: the transform differs in the 7th digit otherwise).
pub const ARCFACE_TEMPLATE: [[f64; 2]; 5] = [
    [(30.2946f32 + 8.0) as f64, 51.6963f32 as f64],
    [(65.5318f32 + 8.0) as f64, 51.5014f32 as f64],
    [(48.0252f32 + 8.0) as f64, 71.7366f32 as f64],
    [(33.5493f32 + 8.0) as f64, 92.3655f32 as f64],
    [(62.7299f32 + 8.0) as f64, 92.2041f32 as f64],
];

/// A 2x3 affine matrix `[[a, b, c], [d, e, f]]`: `(x, y) ↦ (a x + b y + c, d x + e y + f)`.
pub type Affine = [[f64; 3]; 2];

/// The least-squares similarity transform taking `src` onto `dst` (Umeyama's, without
/// reflection; in 2-d the complex-number solution `z ↦ c·z + t`). `None` when the source points
/// all coincide.
pub fn similarity_transform(src: &[[f64; 2]], dst: &[[f64; 2]]) -> Option<Affine> {
    let n = src.len().min(dst.len());
    if n == 0 {
        return None;
    }
    let mean = |p: &[[f64; 2]]| {
        let (sx, sy) = p[..n].iter().fold((0.0, 0.0), |(x, y), q| (x + q[0], y + q[1]));
        (sx / n as f64, sy / n as f64)
    };
    let ((smx, smy), (dmx, dmy)) = (mean(src), mean(dst));
    let (mut re, mut im, mut norm) = (0.0, 0.0, 0.0);
    for (s, d) in src[..n].iter().zip(&dst[..n]) {
        let (sx, sy, dx, dy) = (s[0] - smx, s[1] - smy, d[0] - dmx, d[1] - dmy);
        re += sx * dx + sy * dy;
        im += sx * dy - sy * dx;
        norm += sx * sx + sy * sy;
    }
    if norm == 0.0 {
        return None;
    }
    let (a, b) = (re / norm, im / norm);
    Some([[a, -b, dmx - (a * smx - b * smy)], [b, a, dmy - (b * smx + a * smy)]])
}

/// OpenCV's `invertAffineTransform`.
fn invert(m: &Affine) -> Affine {
    let det = m[0][0] * m[1][1] - m[0][1] * m[1][0];
    let d = if det != 0.0 { 1.0 / det } else { 0.0 };
    let (a11, a22) = (m[1][1] * d, m[0][0] * d);
    let (a12, a21) = (-m[0][1] * d, -m[1][0] * d);
    let b1 = -a11 * m[0][2] - a12 * m[1][2];
    let b2 = -a21 * m[0][2] - a22 * m[1][2];
    [[a11, a12, b1], [a21, a22, b2]]
}

/// `cv2.warpAffine(rgb, m, (side, side), flags=INTER_LINEAR, borderValue=0)` of an interleaved
/// RGB image `width` x `height`; returns `side` x `side` interleaved RGB.
pub fn warp_affine(rgb: &[u8], width: usize, height: usize, m: &Affine, side: usize) -> Vec<u8> {
    let inv = invert(m);
    let k = inv.map(|row| row.map(|v| v as f32));
    let mut out = vec![0u8; side * side * 3];
    let pixel = |sx: i64, sy: i64, c: usize| -> f64 {
        if sx < 0 || sy < 0 || sx as usize >= width || sy as usize >= height {
            0.0
        } else {
            f64::from(rgb[(sy as usize * width + sx as usize) * 3 + c])
        }
    };
    for y in 0..side {
        let (yf, xs) = (y as f32, k[0][1] * y as f32 + k[0][2]);
        let ys = k[1][1] * yf + k[1][2];
        for x in 0..side {
            let sx = k[0][0] * x as f32 + xs;
            let sy = k[1][0] * x as f32 + ys;
            let (x0, y0) = (sx.floor(), sy.floor());
            let (ax, ay) = (f64::from(sx - x0), f64::from(sy - y0));
            let (x0, y0) = (x0 as i64, y0 as i64);
            for c in 0..3 {
                let v = pixel(x0, y0, c) * (1.0 - ax) * (1.0 - ay)
                    + pixel(x0 + 1, y0, c) * ax * (1.0 - ay)
                    + pixel(x0, y0 + 1, c) * (1.0 - ax) * ay
                    + pixel(x0 + 1, y0 + 1, c) * ax * ay;
                out[(y * side + x) * 3 + c] = v.round_ties_even().clamp(0.0, 255.0) as u8;
            }
        }
    }
    out
}

/// The face at `landmarks` (five points in the image's pixels) aligned to
/// [`ARCFACE_TEMPLATE`]: `side` x `side` interleaved RGB. `None` when the landmarks coincide.
pub fn align_face(
    rgb: &[u8],
    width: usize,
    height: usize,
    landmarks: &[[f64; 2]; 5],
    side: usize,
) -> Option<Vec<u8>> {
    let m = similarity_transform(landmarks, &ARCFACE_TEMPLATE)?;
    Some(warp_affine(rgb, width, height, &m, side))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transform_of_a_known_similarity_is_recovered() {
        // dst = 1.3 · R(20°) · src + (5, -7)
        let (s, t) = (1.3f64, 20f64.to_radians());
        let (a, b) = (s * t.cos(), s * t.sin());
        let src = [[10.0, 20.0], [40.0, 22.0], [25.0, 35.0], [15.0, 50.0], [38.0, 49.0]];
        let dst: Vec<[f64; 2]> =
            src.iter().map(|p| [a * p[0] - b * p[1] + 5.0, b * p[0] + a * p[1] - 7.0]).collect();
        let m = similarity_transform(&src, &dst).unwrap();
        let want = [[a, -b, 5.0], [b, a, -7.0]];
        for r in 0..2 {
            for c in 0..3 {
                assert!((m[r][c] - want[r][c]).abs() < 1e-12, "{m:?}");
            }
        }
        assert!(similarity_transform(&[[1.0, 1.0]; 5], &dst).is_none());
    }

    #[test]
    fn the_identity_warp_copies_and_outside_is_black() {
        let (w, h) = (5, 4);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
        let id = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]];
        let out = warp_affine(&rgb, w, h, &id, 4);
        for y in 0..4 {
            for x in 0..4 {
                let want = if x < w { &rgb[(y * w + x) * 3..][..3] } else { &[0, 0, 0][..] };
                assert_eq!(&out[(y * 4 + x) * 3..][..3], want, "({x}, {y})");
            }
        }
        // Shifted by 10 pixels: nothing of the image lands inside.
        let far = [[1.0, 0.0, 10.0], [0.0, 1.0, 0.0]];
        assert!(warp_affine(&rgb, w, h, &far, 4).iter().all(|&v| v == 0));
    }
}
