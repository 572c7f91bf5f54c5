//! Face evaluation, apart from training: [`verification`] scores `.bin` pair sets (LFW, CFP-FP,
//! AgeDB-30) with every rank embedding its share, as arcface_torch's verification does;
//! [`ijb`] scores IJB-B/C 1:1 verification (templates, pair scores, the ROC, TAR at each FAR,
//! its table and SVG plot). The face recipe calls the first during training; `tandem eval ijb`
//! the second.
pub mod ijb;
pub mod verification;
