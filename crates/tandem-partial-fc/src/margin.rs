//! `CombinedMarginLoss(s, m1, m2, m3, interclass_filtering_threshold)` as arcface_torch computes
//! it on the clamped cosine logits of a rank's classes, labels being a column or -1 (no
//! positive class on this rank):
//! - **ArcFace** `(1, m2, 0)`: every logit is replaced by `cos(acos(x))` and the target by
//!   `cos(acos(x) + m2)` *without a gradient path* — arcface_torch changes the values in place
//!   under `no_grad`, so the gradient of the scaled logits is `s`, as if no margin were applied;
//! - **CosFace** `(1, 0, m3)`: the target logit minus `m3` (gradient 1);
//! - then everything times `s`.
//!
//! A threshold > 0 first zeroes every logit above it except the targets (arcface_torch's
//! inter-class filtering; rows without a target on this rank are filtered entirely), as a
//! constant mask the gradient passes through. Other `(m1, m2, m3)` are refused: arcface_torch
//! raises for them, and for `m3 > 0` it would silently ignore `m1` and `m2`.
use candle_core::{Device, Tensor};

use crate::error::PartialFcError;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    ArcFace,
    CosFace,
}

/// The margin of margin-based softmax (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CombinedMarginLoss {
    pub s: f64,
    pub m1: f64,
    pub m2: f64,
    pub m3: f64,
    pub interclass_filtering_threshold: f64,
    kind: Kind,
}

impl CombinedMarginLoss {
    /// Whether this is ArcFace's margin (else CosFace's).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn is_arcface(&self) -> bool {
        self.kind == Kind::ArcFace
    }

    /// arcface_torch's `CombinedMarginLoss(s, m1, m2, m3, interclass_filtering_threshold)`.
    pub fn new(s: f64, m1: f64, m2: f64, m3: f64, threshold: f64) -> Result<Self, PartialFcError> {
        let kind = if m1 == 1.0 && m3 == 0.0 {
            Kind::ArcFace
        } else if m3 > 0.0 && m1 == 1.0 && m2 == 0.0 {
            Kind::CosFace
        } else {
            return Err(PartialFcError::Config(format!(
                "margin (m1, m2, m3) = ({m1}, {m2}, {m3}) is neither ArcFace (1, m2, 0) nor \
                 CosFace (1, 0, m3 > 0), the two arcface_torch computes"
            )));
        };
        if !(s.is_finite() && s > 0.0 && (0.0..1.0).contains(&threshold)) {
            return Err(PartialFcError::Config(format!(
                "scale s = {s} must be positive and the inter-class filtering threshold \
                 {threshold} in [0, 1)"
            )));
        }
        Ok(CombinedMarginLoss { s, m1, m2, m3, interclass_filtering_threshold: threshold, kind })
    }

    /// ArcFace `(s, 1, m, 0)`: arcface_torch's default is `(64, 0.5)`.
    pub fn arcface(s: f64, m: f64) -> Self {
        CombinedMarginLoss {
            s,
            m1: 1.0,
            m2: m,
            m3: 0.0,
            interclass_filtering_threshold: 0.0,
            kind: Kind::ArcFace,
        }
    }

    /// CosFace `(s, 1, 0, m)`: arcface_torch's configs use `(64, 0.4)`.
    pub fn cosface(s: f64, m: f64) -> Self {
        CombinedMarginLoss {
            s,
            m1: 1.0,
            m2: 0.0,
            m3: m,
            interclass_filtering_threshold: 0.0,
            kind: Kind::CosFace,
        }
    }

    /// The scaled, margin-adjusted logits of `logits` `[N, K]` (cosines), where `labels[i]` is
    /// row `i`'s target column or -1.
    pub fn forward(&self, logits: &Tensor, labels: &[i64]) -> candle_core::Result<Tensor> {
        let (n, k) = logits.dims2()?;
        if labels.len() != n {
            candle_core::bail!("margin: {} labels for {n} rows", labels.len());
        }
        #[cfg(feature = "cuda")]
        if logits.device().is_cuda() {
            return crate::cuda::margin(self, logits, labels);
        }
        let target = |i: usize| usize::try_from(labels[i]).ok().filter(|&c| c < k);
        let dev = logits.device().clone();
        // At most one copy to the host: the filter mask and ArcFace's values are computed from it
        // (CosFace needs neither).
        let filter = self.interclass_filtering_threshold > 0.0;
        let mut x = if filter || self.kind == Kind::ArcFace {
            logits.flatten_all()?.to_vec1::<f32>()?
        } else {
            Vec::new()
        };
        let mut logits = logits.clone();
        if filter {
            let thr = self.interclass_filtering_threshold as f32;
            let keep: Vec<f32> = (0..n * k)
                .map(|j| {
                    let dirty = x[j] > thr && target(j / k) != Some(j % k);
                    if dirty {
                        0.0
                    } else {
                        1.0
                    }
                })
                .collect();
            x.iter_mut().zip(&keep).for_each(|(v, m)| *v *= m);
            logits = logits.mul(&Tensor::from_vec(keep, (n, k), &Device::Cpu)?.to_device(&dev)?)?;
        }
        let adjusted = match self.kind {
            Kind::ArcFace => {
                // Computed in f32 as torch does it in place: acos, + m2 on targets, cos.
                let m2 = self.m2 as f32;
                let new: Vec<f32> = (0..n * k)
                    .map(|j| {
                        let a = x[j].acos();
                        if target(j / k) == Some(j % k) {
                            (a + m2).cos()
                        } else {
                            a.cos()
                        }
                    })
                    .collect();
                let new = Tensor::from_vec(new, (n, k), &Device::Cpu)?.to_device(&dev)?;
                // New values, the gradient of the identity.
                (&logits + (new - &logits)?.detach())?
            }
            Kind::CosFace => {
                let m3 = self.m3 as f32;
                let shift: Vec<f32> = (0..n * k)
                    .map(|j| if target(j / k) == Some(j % k) { m3 } else { 0.0 })
                    .collect();
                (&logits - Tensor::from_vec(shift, (n, k), &Device::Cpu)?.to_device(&dev)?)?
            }
        };
        adjusted * self.s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn only_arcface_and_cosface_are_accepted() {
        assert!(CombinedMarginLoss::new(64.0, 1.0, 0.5, 0.0, 0.0).is_ok());
        assert!(CombinedMarginLoss::new(64.0, 1.0, 0.0, 0.4, 0.0).is_ok());
        for (m1, m2, m3) in [(0.9, 0.4, 0.15), (1.0, 0.3, 0.2), (1.0, 0.0, -0.1), (2.0, 0.0, 0.0)] {
            let e = CombinedMarginLoss::new(64.0, m1, m2, m3, 0.0).unwrap_err().to_string();
            assert!(e.contains(&format!("({m1}, {m2}, {m3})")), "{e}");
        }
        assert!(CombinedMarginLoss::new(64.0, 1.0, 0.5, 0.0, 1.5).is_err());
    }

    #[test]
    fn arcface_moves_the_target_without_a_gradient_path_and_cosface_shifts_it() {
        let x = Var::new(&[[0.5f32, 0.2], [0.1, -0.3]], &Device::Cpu).unwrap();
        let labels = [1, -1];
        let arc = CombinedMarginLoss::arcface(2.0, 0.5).forward(x.as_tensor(), &labels).unwrap();
        let v = arc.to_vec2::<f32>().unwrap();
        assert!((v[0][1] - 2.0 * (0.2f32.acos() + 0.5).cos()).abs() < 1e-6);
        assert!((v[0][0] - 1.0).abs() < 1e-6 && (v[1][1] + 0.6).abs() < 1e-6);
        let g = arc.sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(&x).unwrap().to_vec2::<f32>().unwrap(), [[2.0, 2.0], [2.0, 2.0]]);

        let cos = CombinedMarginLoss::cosface(2.0, 0.4).forward(x.as_tensor(), &labels).unwrap();
        let v = cos.to_vec2::<f32>().unwrap();
        assert!((v[0][1] + 0.4).abs() < 1e-6 && (v[0][0] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn the_filter_zeroes_non_targets_above_the_threshold() {
        let x = Var::new(&[[0.5f32, 0.2, 0.05], [0.4, -0.3, 0.0]], &Device::Cpu).unwrap();
        let m = CombinedMarginLoss::new(1.0, 1.0, 0.0, 0.1, 0.1).unwrap();
        let y = m.forward(x.as_tensor(), &[0, -1]).unwrap();
        // Row 0: target 0.5 kept (minus m3), 0.2 zeroed, 0.05 kept; row 1 (no target): 0.4 zeroed.
        let v = y.to_vec2::<f32>().unwrap();
        let want = [[0.4f32, 0.0, 0.05], [0.0, -0.3, 0.0]];
        for (a, b) in v.iter().flatten().zip(want.iter().flatten()) {
            assert!((a - b).abs() < 1e-6, "{v:?}");
        }
        let g = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(
            g.get(&x).unwrap().to_vec2::<f32>().unwrap(),
            [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
        );
    }
}
