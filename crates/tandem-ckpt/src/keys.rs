//! State-dict keys: finding the state dict inside a checkpoint container, undoing wrapper
//! prefixes (`module.` from DistributedDataParallel/DataParallel, anywhere in the path for
//! DataParallel on a submodule, `_orig_mod.` from torch.compile, Lightning's `model.`), matching
//! against a target model and reporting what did and did not fit.
use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::error::{CkptError, Result};
use crate::value::{ElemType, TensorData, Value};

/// Path segments that wrappers insert and that never belong to a canonical key.
const WRAPPER_SEGMENTS: [&str; 2] = ["module", "_orig_mod"];
/// Container keys under which training scripts keep the model's state dict, most specific first.
pub const CONTAINER_KEYS: [&str; 6] =
    ["state_dict", "model_state_dict", "model", "module", "net", "network"];

/// A renaming applied to one side's keys before matching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renaming {
    /// Keys used as they are.
    None,
    /// `module.` / `_orig_mod.` segments removed wherever they occur.
    StripWrappers,
    /// As `StripWrappers`, then a leading `model.` removed (PyTorch Lightning).
    StripWrappersAndModel,
}

impl Renaming {
    const ALL: [Renaming; 3] =
        [Renaming::None, Renaming::StripWrappers, Renaming::StripWrappersAndModel];

    pub fn apply(self, key: &str) -> String {
        match self {
            Renaming::None => key.to_string(),
            Renaming::StripWrappers => strip_wrappers(key),
            Renaming::StripWrappersAndModel => {
                let s = strip_wrappers(key);
                match s.strip_prefix("model.") {
                    Some(rest) => rest.to_string(),
                    None => s,
                }
            }
        }
    }

    fn cost(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Renaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Renaming::None => "none",
            Renaming::StripWrappers => "removed `module.`/`_orig_mod.` segments",
            Renaming::StripWrappersAndModel => {
                "removed `module.`/`_orig_mod.` segments and a leading `model.`"
            }
        })
    }
}

/// `features.module.0.weight` -> `features.0.weight`, `_orig_mod.module.fc.w` -> `fc.w`.
pub fn strip_wrappers(key: &str) -> String {
    let parts: Vec<&str> = key.split('.').filter(|p| !WRAPPER_SEGMENTS.contains(p)).collect();
    if parts.is_empty() {
        key.to_string()
    } else {
        parts.join(".")
    }
}

/// The wrappings visible in a set of keys, in words (for reports and `tandem ckpt inspect`).
pub fn detect_wrapping<'a>(keys: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut add = |s: String| {
        if !found.contains(&s) {
            found.push(s);
        }
    };
    for k in keys {
        let parts: Vec<&str> = k.split('.').collect();
        for (i, p) in parts.iter().enumerate() {
            if *p == "module" {
                if i == 0 {
                    add("`module.` prefix (DistributedDataParallel / DataParallel)".into());
                } else {
                    add(format!(
                        "`{}.module.` (DataParallel on a submodule)",
                        parts[..i].join(".")
                    ));
                }
            } else if *p == "_orig_mod" {
                add("`_orig_mod.` (torch.compile)".into());
            }
        }
        if parts.first() == Some(&"model") && parts.len() > 1 {
            add("`model.` prefix (PyTorch Lightning, or a `model` attribute)".into());
        }
    }
    found
}

/// Rewrites the keys of every state dict in `value` to canonical form (wrapper segments
/// removed), as checkpoints are saved. A bare state dict, or the state dicts under the usual
/// container keys, are rewritten; other values pass through unchanged.
pub fn canonicalize_keys(value: &Value) -> Result<Value> {
    if is_state_dict(value) {
        let items = value.as_dict().unwrap_or_default();
        let mut seen = HashSet::new();
        let mut out = Vec::with_capacity(items.len());
        for (k, v) in items {
            let new_key = match k {
                Value::Str(s) => {
                    let c = strip_wrappers(s);
                    if !seen.insert(c.clone()) {
                        return Err(CkptError::Unsupported {
                            what: format!("key `{s}`"),
                            msg: format!("it becomes `{c}` after removing wrapper prefixes, which another key already is"),
                        });
                    }
                    Value::Str(c)
                }
                other => other.clone(),
            };
            out.push((new_key, v.clone()));
        }
        return Ok(Value::Dict(out));
    }
    match value {
        Value::Dict(items) | Value::OrderedDict { items, .. } => {
            let mut out = Vec::with_capacity(items.len());
            for (k, v) in items {
                let is_container =
                    matches!(k, Value::Str(s) if CONTAINER_KEYS.contains(&s.as_str()));
                out.push((k.clone(), if is_container { canonicalize_keys(v)? } else { v.clone() }));
            }
            Ok(Value::Dict(out))
        }
        other => Ok(other.clone()),
    }
}

/// A dict with str keys whose values are tensors (non-tensor entries such as `_metadata` aside)
/// and at least one tensor.
pub fn is_state_dict(v: &Value) -> bool {
    match v.as_dict() {
        Some(items) => {
            let mut tensors = 0;
            for (k, v) in items {
                match (k, v) {
                    (Value::Str(_), Value::Tensor(_)) => tensors += 1,
                    (
                        _,
                        Value::Dict(_)
                        | Value::OrderedDict { .. }
                        | Value::List(_)
                        | Value::Tuple(_),
                    ) => return false,
                    _ => {}
                }
            }
            tensors > 0
        }
        None => false,
    }
}

/// Every state dict the source may hold: (container path, its tensors), bare first.
pub fn find_state_dicts(source: &Value) -> Vec<(String, Vec<(String, TensorData)>)> {
    fn tensors_of(v: &Value) -> Vec<(String, TensorData)> {
        v.as_dict()
            .unwrap_or(&[])
            .iter()
            .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v.as_tensor()?.clone())))
            .collect()
    }
    fn walk(
        v: &Value,
        path: &str,
        depth: usize,
        out: &mut Vec<(String, Vec<(String, TensorData)>)>,
    ) {
        if is_state_dict(v) {
            out.push((
                if path.is_empty() { "(bare)".to_string() } else { path.to_string() },
                tensors_of(v),
            ));
            return;
        }
        if depth >= 3 {
            return;
        }
        for key in CONTAINER_KEYS {
            if let Some(inner) = v.get(key) {
                let p = if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
                walk(inner, &p, depth + 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(source, "", 0, &mut out);
    out
}

#[derive(Clone, Debug, PartialEq)]
pub struct ShapeMismatch {
    /// The target's name.
    pub name: String,
    pub checkpoint_key: String,
    pub checkpoint: Vec<usize>,
    pub model: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct DTypeConversion {
    pub name: String,
    pub checkpoint: ElemType,
    pub model: ElemType,
}

/// What a `load_state_dict` did: PyTorch's `missing_keys` / `unexpected_keys` plus the shape
/// and dtype differences and the renaming that made the keys fit.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadReport {
    /// Where the state dict was found: `(bare)`, `model`, `state_dict`, ...
    pub container: String,
    /// Wrappings seen in the checkpoint's keys, in words.
    pub wrappings: Vec<String>,
    pub source_renaming: Renaming,
    pub target_renaming: Renaming,
    /// Target names that received a tensor.
    pub matched: Vec<String>,
    /// Target names with no tensor in the checkpoint.
    pub missing: Vec<String>,
    /// Checkpoint keys that fit no target name.
    pub unexpected: Vec<String>,
    /// Same name, different shape: never loaded.
    pub shape_mismatches: Vec<ShapeMismatch>,
    /// Same name and shape, different dtype: converted to the model's dtype (as `copy_` does).
    pub dtype_conversions: Vec<DTypeConversion>,
    pub strict: bool,
}

impl LoadReport {
    /// Every target name matched and every checkpoint key used.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.shape_mismatches.is_empty()
    }
}

fn list(f: &mut fmt::Formatter<'_>, title: &str, items: &[String]) -> fmt::Result {
    if items.is_empty() {
        return Ok(());
    }
    writeln!(f, "  {title} ({}):", items.len())?;
    const SHOW: usize = 20;
    for k in items.iter().take(SHOW) {
        writeln!(f, "    {k}")?;
    }
    if items.len() > SHOW {
        writeln!(f, "    ... and {} more", items.len() - SHOW)?;
    }
    Ok(())
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "load report ({}): {} matched, {} missing, {} unexpected, {} shape mismatches, {} dtype conversions",
            if self.strict { "strict" } else { "non-strict" },
            self.matched.len(),
            self.missing.len(),
            self.unexpected.len(),
            self.shape_mismatches.len(),
            self.dtype_conversions.len()
        )?;
        writeln!(f, "  state dict found at: {}", self.container)?;
        if !self.wrappings.is_empty() {
            writeln!(f, "  wrapping detected: {}", self.wrappings.join(", "))?;
        }
        writeln!(f, "  checkpoint keys renaming: {}", self.source_renaming)?;
        if self.target_renaming != Renaming::None {
            writeln!(f, "  model keys renaming: {}", self.target_renaming)?;
        }
        list(f, "missing keys (in the model, not in the checkpoint)", &self.missing)?;
        list(f, "unexpected keys (in the checkpoint, not in the model)", &self.unexpected)?;
        if !self.shape_mismatches.is_empty() {
            writeln!(f, "  shape mismatches ({}):", self.shape_mismatches.len())?;
            for m in &self.shape_mismatches {
                writeln!(
                    f,
                    "    {}: checkpoint {:?} ({}) vs model {:?}",
                    m.name, m.checkpoint, m.checkpoint_key, m.model
                )?;
            }
        }
        if !self.dtype_conversions.is_empty() {
            writeln!(f, "  dtype conversions ({}):", self.dtype_conversions.len())?;
            for c in &self.dtype_conversions {
                writeln!(f, "    {}: {} -> {}", c.name, c.checkpoint, c.model)?;
            }
        }
        Ok(())
    }
}

struct Candidate<'a> {
    container: &'a str,
    tensors: &'a [(String, TensorData)],
    src: Renaming,
    tgt: Renaming,
    /// target index -> source index
    pairs: Vec<(usize, usize)>,
    collisions: usize,
}

fn try_mapping<'a>(
    container: &'a str,
    tensors: &'a [(String, TensorData)],
    target: &[(String, Vec<usize>, ElemType)],
    src: Renaming,
    tgt: Renaming,
) -> Candidate<'a> {
    let mut by_name: HashMap<String, usize> = HashMap::with_capacity(tensors.len());
    let mut collisions = 0;
    for (i, (k, _)) in tensors.iter().enumerate() {
        if by_name.insert(src.apply(k), i).is_some() {
            collisions += 1;
        }
    }
    let pairs = target
        .iter()
        .enumerate()
        .filter_map(|(ti, (name, _, _))| by_name.get(&tgt.apply(name)).map(|&si| (ti, si)))
        .collect();
    Candidate { container, tensors, src, tgt, pairs, collisions }
}

/// Matches the state dict inside `source` against a target model given as
/// `(name, shape, dtype)` triples, trying every container and renaming and keeping the one that
/// matches most names (ties: the least renaming). Returns `(target name, tensor)` pairs — the
/// tensor converted to the target's dtype when they differ — and the report.
///
/// `strict` (PyTorch's default) makes any missing, unexpected or mis-shaped key an error carrying
/// the report. Non-strict returns what fits, skips mis-shaped tensors, and warns (via `tracing`)
/// when anything was left unmatched — the report is never silent.
pub fn load_state_dict(
    source: &Value,
    target: &[(String, Vec<usize>, ElemType)],
    strict: bool,
) -> Result<(Vec<(String, TensorData)>, LoadReport)> {
    let found = find_state_dicts(source);
    if found.is_empty() {
        let keys: Vec<String> = source
            .as_dict()
            .map(|d| d.iter().map(|(k, _)| format!("{k:?}")).collect())
            .unwrap_or_else(|| vec![format!("(a {}, not a dict)", source.type_name())]);
        return Err(CkptError::NoStateDict(format!(
            "expected a dict of tensors, bare or under one of {CONTAINER_KEYS:?}; top level has {}",
            keys.join(", ")
        )));
    }
    let mut best: Option<Candidate> = None;
    for (container, tensors) in &found {
        for src in Renaming::ALL {
            for tgt in Renaming::ALL {
                let c = try_mapping(container, tensors, target, src, tgt);
                let better = match &best {
                    None => true,
                    Some(b) => {
                        // More matches wins; then no collisions; then the least renaming.
                        (
                            c.pairs.len(),
                            std::cmp::Reverse(c.collisions),
                            std::cmp::Reverse(c.src.cost() + c.tgt.cost()),
                        ) > (
                            b.pairs.len(),
                            std::cmp::Reverse(b.collisions),
                            std::cmp::Reverse(b.src.cost() + b.tgt.cost()),
                        )
                    }
                };
                if better {
                    best = Some(c);
                }
            }
        }
    }
    let best = best.expect("found is non-empty, so a candidate was tried");
    let tensors = best.tensors;
    let mut used = vec![false; tensors.len()];
    let mut out = Vec::new();
    let mut report = LoadReport {
        container: best.container.to_string(),
        wrappings: detect_wrapping(tensors.iter().map(|(k, _)| k.as_str())),
        source_renaming: best.src,
        target_renaming: best.tgt,
        matched: Vec::new(),
        missing: Vec::new(),
        unexpected: Vec::new(),
        shape_mismatches: Vec::new(),
        dtype_conversions: Vec::new(),
        strict,
    };
    let pair_of: HashMap<usize, usize> = best.pairs.iter().copied().collect();
    for (ti, (name, shape, dtype)) in target.iter().enumerate() {
        let Some(&si) = pair_of.get(&ti) else {
            report.missing.push(name.clone());
            continue;
        };
        used[si] = true;
        let (skey, t) = &tensors[si];
        if &t.shape != shape {
            report.shape_mismatches.push(ShapeMismatch {
                name: name.clone(),
                checkpoint_key: skey.clone(),
                checkpoint: t.shape.clone(),
                model: shape.clone(),
            });
            continue;
        }
        let t = if t.dtype != *dtype {
            report.dtype_conversions.push(DTypeConversion {
                name: name.clone(),
                checkpoint: t.dtype,
                model: *dtype,
            });
            t.to_dtype(*dtype)
        } else {
            t.clone()
        };
        report.matched.push(name.clone());
        out.push((name.clone(), t));
    }
    report.unexpected =
        tensors.iter().zip(&used).filter(|(_, &u)| !u).map(|((k, _), _)| k.clone()).collect();
    if !report.is_complete() {
        if strict {
            return Err(CkptError::StateDictMismatch(Box::new(report)));
        }
        tracing::warn!("non-strict load_state_dict left keys unmatched:\n{report}");
    }
    Ok((out, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sd(keys: &[&str]) -> Value {
        Value::dict_from(
            keys.iter()
                .map(|k| (k.to_string(), Value::Tensor(TensorData::from_f32(&[2], &[1.0, 2.0])))),
        )
    }

    fn target(keys: &[&str]) -> Vec<(String, Vec<usize>, ElemType)> {
        keys.iter().map(|k| (k.to_string(), vec![2], ElemType::F32)).collect()
    }

    #[test]
    fn strip_wrappers_handles_every_position() {
        assert_eq!(strip_wrappers("module.fc.weight"), "fc.weight");
        assert_eq!(strip_wrappers("features.module.0.weight"), "features.0.weight");
        assert_eq!(strip_wrappers("_orig_mod.module.fc.w"), "fc.w");
        assert_eq!(strip_wrappers("modules.x"), "modules.x");
    }

    #[test]
    fn dataparallel_on_a_submodule_loads_into_the_plain_model() {
        let src =
            Value::dict_from([("model", sd(&["features.module.0.weight", "classifier.weight"]))]);
        let (out, r) =
            load_state_dict(&src, &target(&["features.0.weight", "classifier.weight"]), true)
                .unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(r.container, "model");
        assert_eq!(r.source_renaming, Renaming::StripWrappers);
        assert!(r.wrappings.iter().any(|w| w.contains("features.module.")), "{r}");
    }

    #[test]
    fn lightning_prefix_is_removed_only_when_it_helps() {
        let src = Value::dict_from([("state_dict", sd(&["model.fc.weight", "model.fc.bias"]))]);
        let (_, r) = load_state_dict(&src, &target(&["fc.weight", "fc.bias"]), true).unwrap();
        assert_eq!(r.source_renaming, Renaming::StripWrappersAndModel);
        // A model that really has a `model` submodule keeps the names as they are.
        let (_, r) =
            load_state_dict(&src, &target(&["model.fc.weight", "model.fc.bias"]), true).unwrap();
        assert_eq!(r.source_renaming, Renaming::None);
    }

    #[test]
    fn strict_mismatch_is_an_error_carrying_the_report() {
        let src = sd(&["a.weight", "b.weight"]);
        let e = load_state_dict(&src, &target(&["a.weight", "c.weight"]), true).unwrap_err();
        match e {
            CkptError::StateDictMismatch(r) => {
                assert_eq!(r.missing, vec!["c.weight".to_string()]);
                assert_eq!(r.unexpected, vec!["b.weight".to_string()]);
                let text = r.to_string();
                assert!(text.contains("1 matched, 1 missing, 1 unexpected"), "{text}");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn non_strict_returns_what_fits_and_reports_the_rest() {
        let mut src = sd(&["a.weight", "b.weight"]);
        src.insert("c.weight", Value::Tensor(TensorData::from_f32(&[3], &[0.0; 3])));
        let (out, r) =
            load_state_dict(&src, &target(&["a.weight", "c.weight", "d.weight"]), false).unwrap();
        assert_eq!(out.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["a.weight"]);
        assert_eq!(r.missing, ["d.weight"]);
        assert_eq!(r.unexpected, ["b.weight"]);
        assert_eq!(r.shape_mismatches.len(), 1);
        assert_eq!(r.shape_mismatches[0].checkpoint, vec![3]);
        assert!(!r.is_complete());
    }

    #[test]
    fn dtype_differences_convert_like_copy_() {
        let src =
            Value::dict_from([("w", Value::Tensor(TensorData::from_f64(&[2], &[1.5, -2.25])))]);
        let (out, r) =
            load_state_dict(&src, &[("w".into(), vec![2], ElemType::BF16)], true).unwrap();
        assert_eq!(out[0].1.dtype, ElemType::BF16);
        assert_eq!(out[0].1.to_f64_vec(), vec![1.5, -2.25]);
        assert_eq!(r.dtype_conversions[0].checkpoint, ElemType::F64);
    }

    #[test]
    fn no_state_dict_is_a_clear_error() {
        let src = Value::dict_from([("epoch", Value::Int(1))]);
        let e = load_state_dict(&src, &target(&["a"]), true).unwrap_err();
        assert!(e.to_string().contains("\"epoch\""), "{e}");
    }

    #[test]
    fn canonicalize_rewrites_state_dicts_inside_containers() {
        let v = Value::dict_from([("model", sd(&["module.fc.weight"])), ("epoch", Value::Int(2))]);
        let c = canonicalize_keys(&v).unwrap();
        assert!(c.get("model").unwrap().get("fc.weight").is_some());
        assert_eq!(c.get("epoch"), Some(&Value::Int(2)));
        // Two keys that collapse into one are an error, not a silent overwrite.
        assert!(canonicalize_keys(&sd(&["module.fc.weight", "fc.weight"])).is_err());
    }
}
