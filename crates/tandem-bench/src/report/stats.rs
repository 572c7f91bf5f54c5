//! Summaries of repeated measurements (min / median / max) and the number formatting the report
//! uses everywhere, so that a ratio printed in the report can be re-derived from printed figures.

/// min, median and max of the repeated runs of one measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    pub runs: usize,
}

impl Summary {
    /// None when there are no finite samples.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Some(Summary { min: v[0], median, max: v[n - 1], runs: n })
    }

    /// (max - min) / median: how far apart the repeated runs landed.
    pub fn spread(&self) -> f64 {
        if self.median > 0.0 {
            (self.max - self.min) / self.median
        } else {
            f64::NAN
        }
    }
}

/// A figure: measured, or the reason there is none ("PyTorch not available", "failed: ...").
#[derive(Clone, Debug)]
pub enum Figure {
    Measured(Summary),
    Missing(String),
}

impl Figure {
    pub fn from_samples(samples: &[f64], why_missing: impl FnOnce() -> String) -> Figure {
        match Summary::of(samples) {
            Some(s) => Figure::Measured(s),
            None => Figure::Missing(why_missing()),
        }
    }
    pub fn median(&self) -> Option<f64> {
        match self {
            Figure::Measured(s) => Some(s.median),
            Figure::Missing(_) => None,
        }
    }
}

/// Four significant digits (at least), without exponent notation: 1234, 12.34, 0.001234.
pub fn sig(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    if x == 0.0 {
        return "0".into();
    }
    let magnitude = x.abs().log10().floor() as i32;
    let decimals = (3 - magnitude).max(0) as usize;
    format!("{x:.decimals$}")
}

/// Axis labels: like `sig`, without trailing zeros (0.001, 2.5, 100).
pub fn short(x: f64) -> String {
    let s = sig(x);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Ratios with three decimals, or three significant digits below 0.1 (a ratio's own precision,
/// independent of the figures').
pub fn ratio(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    if x == 0.0 || x.abs() >= 0.1 {
        return format!("{x:.3}");
    }
    let decimals = (2 - x.abs().log10().floor() as i32).max(3) as usize;
    format!("{x:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_odd_and_even_counts() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max, s.runs), (1.0, 2.0, 3.0, 3));
        let s = Summary::of(&[4.0, 1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!((s.spread() - 1.2).abs() < 1e-12);
        assert!(Summary::of(&[f64::NAN]).is_none());
    }

    #[test]
    fn sig_keeps_four_significant_digits() {
        assert_eq!(sig(1234.56), "1235");
        assert_eq!(sig(12.3456), "12.35");
        assert_eq!(sig(0.00123456), "0.001235");
        assert_eq!(ratio(0.12345), "0.123");
        assert_eq!(ratio(12.3456), "12.346");
        assert_eq!(ratio(0.012345), "0.0123");
        assert_eq!(ratio(0.00041849), "0.000418");
        assert_eq!(short(0.001), "0.001");
        assert_eq!(short(100.0), "100");
        assert_eq!(short(2.5), "2.5");
    }
}
