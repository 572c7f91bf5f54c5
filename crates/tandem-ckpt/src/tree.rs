//! Walking a checkpoint's value tree as tools need it: every leaf by its path
//! (`model/features.0.weight`), a value picked by path, state-dict keys renamed (a wrapper's
//! prefix stripped or added, with an OrderedDict's module versions following), and two trees
//! compared leaf by leaf (`tandem ckpt diff`). What to print is the caller's.
use std::collections::HashMap;

use crate::error::CkptError;
use crate::keys::{detect_wrapping, find_state_dicts, strip_wrappers};
use crate::value::{TensorData, Value};

/// Every leaf of `v` with its path: dict keys and list indices joined by `/` (`misc/3`); an
/// empty container is a leaf.
pub fn leaves(v: &Value) -> Vec<(String, &Value)> {
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

fn walk<'a>(v: &'a Value, path: String, out: &mut Vec<(String, &'a Value)>) {
    let join = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}/{k}") };
    match v {
        Value::Dict(items) | Value::OrderedDict { items, .. } if !items.is_empty() => {
            for (k, x) in items {
                walk(x, join(&key_text(k)), out);
            }
        }
        Value::List(items) | Value::Tuple(items) if !items.is_empty() => {
            for (i, x) in items.iter().enumerate() {
                walk(x, join(&i.to_string()), out);
            }
        }
        _ => out.push((path, v)),
    }
}

/// A value in at most 80 characters, as Python would show a small one (`True`, `'sgd'`) and a
/// summary of a large one (`<dict of 3>`, `tensor f32 [2, 3]`).
pub fn short_repr(v: &Value) -> String {
    let s = match v {
        Value::None => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Int(i) => i.to_string(),
        Value::Float(f) => format!("{f:?}"),
        Value::Str(s) => format!("{s:?}"),
        Value::Bytes(b) => format!("<{} bytes>", b.len()),
        Value::List(v) if v.is_empty() => "[]".into(),
        Value::Tuple(v) if v.is_empty() => "()".into(),
        Value::Dict(v) if v.is_empty() => "{}".into(),
        Value::List(v) | Value::Tuple(v) => format!("<{} items>", v.len()),
        Value::Dict(v) => format!("<dict of {}>", v.len()),
        Value::OrderedDict { items, .. } => format!("<OrderedDict of {}>", items.len()),
        Value::Tensor(t) => format!("tensor {} {:?}", t.dtype, t.shape),
    };
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(77).collect::<String>())
    } else {
        s
    }
}

/// A dict key as text: a string as itself, any other key as [`short_repr`] shows it.
pub fn key_text(k: &Value) -> String {
    match k {
        Value::Str(s) => s.clone(),
        other => short_repr(other),
    }
}

/// The keys of a dict (nothing for any other value).
pub fn keys_of(v: &Value) -> Vec<String> {
    v.as_dict().map(|d| d.iter().map(|(k, _)| key_text(k)).collect()).unwrap_or_default()
}

/// Bytes of every tensor under `v`.
pub fn tensor_bytes(v: &Value) -> usize {
    leaves(v).iter().filter_map(|(_, v)| v.as_tensor()).map(TensorData::nbytes).sum()
}

/// The value at `path` (`model`, `ckpt/model`: dict keys joined by `/`); a missing key is an
/// error listing the keys that are there.
pub fn select<'a>(v: &'a Value, path: &str) -> Result<&'a Value, CkptError> {
    let mut cur = v;
    for part in path.split('/') {
        cur = cur.get(part).ok_or_else(|| CkptError::NoKey {
            path: path.to_string(),
            missing: part.to_string(),
            there: keys_of(cur),
        })?;
    }
    Ok(cur)
}

/// `v` (a dict) with `prefix` removed from every key that starts with it, and how many did. An
/// OrderedDict stays one, and its `_metadata` module paths lose the prefix too (the wrapper's
/// own path becomes the root), as torch's `consume_prefix_in_state_dict_if_present` does, so
/// `load_state_dict` still finds each module's version.
pub fn strip_prefix(v: &Value, prefix: &str) -> Result<(Value, usize), CkptError> {
    let bare = prefix.trim_end_matches('.');
    let mut stripped = 0;
    let out = rename_keys(
        v,
        &mut |k| match k.strip_prefix(prefix) {
            Some(rest) => {
                stripped += 1;
                rest.to_string()
            }
            None => k.to_string(),
        },
        &|k| match k.strip_prefix(prefix) {
            Some(rest) => rest.to_string(),
            None if k == bare => String::new(),
            None => k.to_string(),
        },
    )?;
    Ok((out, stripped))
}

/// `v` (a dict) with `prefix` put in front of every key (and of every `_metadata` module path,
/// the root becoming the wrapper's own path).
pub fn add_prefix(v: &Value, prefix: &str) -> Result<Value, CkptError> {
    let bare = prefix.trim_end_matches('.');
    rename_keys(v, &mut |k| format!("{prefix}{k}"), &|k| match k.is_empty() {
        true => bare.to_string(),
        false => format!("{prefix}{k}"),
    })
}

/// `v`'s string keys renamed by `key`, and an OrderedDict's `_metadata` paths by `module`.
fn rename_keys(
    v: &Value,
    key: &mut dyn FnMut(&str) -> String,
    module: &dyn Fn(&str) -> String,
) -> Result<Value, CkptError> {
    let Some(items) = v.as_dict() else {
        return Err(CkptError::NoStateDict(format!(
            "renaming keys needs a dict, found a {}",
            v.type_name()
        )));
    };
    let rename = |items: &[(Value, Value)], f: &mut dyn FnMut(&str) -> String| -> Vec<_> {
        let renamed = |k: &Value, f: &mut dyn FnMut(&str) -> String| match k {
            Value::Str(s) => Value::Str(f(s)),
            other => other.clone(),
        };
        items.iter().map(|(k, x)| (renamed(k, f), x.clone())).collect()
    };
    let out = rename(items, key);
    Ok(match v {
        Value::OrderedDict { metadata, .. } => {
            let metadata = metadata.as_deref().map(|m| match m.as_dict() {
                Some(entries) => Box::new(Value::OrderedDict {
                    items: rename(entries, &mut |k| module(k)),
                    metadata: None,
                }),
                None => Box::new(m.clone()),
            });
            Value::OrderedDict { items: out, metadata }
        }
        _ => Value::Dict(out),
    })
}

/// What a checkpoint file holds, as `tandem ckpt inspect` shows it (and as JSON).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Summary {
    /// The top-level dict's keys (nothing when the file is not a dict).
    pub container_keys: Vec<String>,
    /// Every state dict found (bare, or under `model`, `state_dict`, ...).
    pub state_dicts: Vec<StateDictAt>,
    /// Wrappers its keys show (`DistributedDataParallel (module.)`, ...).
    pub wrapping: Vec<String>,
    pub tensors: Vec<TensorLeaf>,
    /// The leaves that are not tensors.
    pub values: Vec<ValueLeaf>,
    pub total_tensor_bytes: usize,
}

/// A state dict inside a checkpoint: where, and how many tensors.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StateDictAt {
    pub at: String,
    pub tensors: usize,
}

/// A tensor leaf: its path, torch dtype name, shape and bytes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TensorLeaf {
    pub key: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub bytes: usize,
}

/// Any other leaf: its path, Python type and [`short_repr`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ValueLeaf {
    pub key: String,
    #[serde(rename = "type")]
    pub type_name: &'static str,
    pub value: String,
}

impl std::fmt::Display for Summary {
    /// The lines `tandem ckpt inspect` prints: container keys, state dicts, wrapping, every
    /// tensor (key, dtype, shape, bytes) and every other value.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.container_keys.is_empty() {
            writeln!(f, "container keys: {}", self.container_keys.join(", "))?;
        }
        for sd in &self.state_dicts {
            writeln!(f, "state dict at {}: {} tensors", sd.at, sd.tensors)?;
        }
        match self.wrapping.is_empty() {
            true => writeln!(f, "wrapping detected: none")?,
            false => writeln!(f, "wrapping detected: {}", self.wrapping.join(", "))?,
        }
        writeln!(f, "tensors ({}, {} bytes):", self.tensors.len(), self.total_tensor_bytes)?;
        let width = self.tensors.iter().map(|t| t.key.len()).max().unwrap_or(0);
        for t in &self.tensors {
            let shape = format!("{:?}", t.shape);
            writeln!(f, "  {:width$}  {:<8}  {shape:<16}  {}", t.key, t.dtype, t.bytes)?;
        }
        if !self.values.is_empty() {
            writeln!(f, "non-tensor values ({}):", self.values.len())?;
            for x in &self.values {
                writeln!(f, "  {} = {}", x.key, x.value)?;
            }
        }
        Ok(())
    }
}

/// What `v` holds ([`Summary`]).
pub fn summarize(v: &Value) -> Summary {
    let all = leaves(v);
    let tensors: Vec<TensorLeaf> = all
        .iter()
        .filter_map(|(p, x)| x.as_tensor().map(|t| (p, t)))
        .map(|(p, t)| TensorLeaf {
            key: p.clone(),
            dtype: t.dtype.torch_name(),
            shape: t.shape.clone(),
            bytes: t.nbytes(),
        })
        .collect();
    let values = all
        .iter()
        .filter(|(_, x)| x.as_tensor().is_none())
        .map(|(p, x)| ValueLeaf { key: p.clone(), type_name: x.type_name(), value: short_repr(x) })
        .collect();
    let found = find_state_dicts(v);
    Summary {
        container_keys: keys_of(v),
        state_dicts: found
            .iter()
            .map(|(at, t)| StateDictAt { at: at.clone(), tensors: t.len() })
            .collect(),
        wrapping: found
            .iter()
            .flat_map(|(_, t)| detect_wrapping(t.iter().map(|(k, _)| k.as_str())))
            .collect(),
        total_tensor_bytes: tensors.iter().map(|t| t.bytes).sum(),
        tensors,
        values,
    }
}

/// A checkpoint file (`.pt`, `.safetensors`) or PyTorch distributed checkpoint directory,
/// inspected: what `tandem ckpt inspect` shows (and as JSON).
#[derive(Clone, Debug, serde::Serialize)]
pub struct FileInspection {
    pub file: String,
    /// The file format by name, or `PyTorch distributed checkpoint (dcp.save)`.
    pub format: &'static str,
    #[serde(flatten)]
    pub summary: Summary,
    /// A distributed checkpoint's tensors: how many chunks each is in, and in which files.
    pub dcp_chunks: Vec<DcpChunks>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DcpChunks {
    pub key: String,
    pub chunks: usize,
    pub files: Vec<String>,
}

/// Inspects the checkpoint `v` read from `path` (a file, or a distributed checkpoint's
/// directory).
pub fn inspect(path: &std::path::Path, v: &Value) -> Result<FileInspection, CkptError> {
    let dcp = crate::dcp::is_dcp_dir(path);
    let format = match dcp {
        true => "PyTorch distributed checkpoint (dcp.save)",
        false => crate::pt::detect_file(path)?.map_or("unknown", |k| k.name()),
    };
    let chunking = if dcp { crate::dcp::chunking(path)? } else { Vec::new() };
    Ok(FileInspection {
        file: path.display().to_string(),
        format,
        summary: summarize(v),
        dcp_chunks: chunking
            .into_iter()
            .map(|(key, chunks, files)| DcpChunks { key, chunks, files })
            .collect(),
    })
}

impl std::fmt::Display for FileInspection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}: {}", self.file, self.format)?;
        write!(f, "{}", self.summary)?;
        if !self.dcp_chunks.is_empty() {
            let sharded: Vec<_> = self.dcp_chunks.iter().filter(|c| c.chunks > 1).collect();
            writeln!(f, "sharded tensors ({}, the rest one chunk each):", sharded.len())?;
            for c in sharded {
                writeln!(f, "  {}: {} chunks in {}", c.key, c.chunks, c.files.join(", "))?;
            }
        }
        Ok(())
    }
}

/// How one leaf differs between two trees.
#[derive(Clone, Debug, PartialEq)]
pub enum LeafDiff {
    /// Tensors of another dtype or shape: `(dtype, shape)` of each side.
    Layout { a: (String, Vec<usize>), b: (String, Vec<usize>) },
    /// Tensors of one layout whose largest element-wise difference is this (NaN where only
    /// one side holds a NaN; both NaN counts as equal).
    Values { max_abs: f64 },
    /// Other values, shown as [`short_repr`] shows them.
    Other { a: String, b: String },
}

/// Two trees compared leaf by leaf, keys taken without wrapper segments (`module.`,
/// `_orig_mod.`), so a DDP save compares with a plain one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TreeDiff {
    /// Whether any key lost a wrapper segment to be compared.
    pub unwrapped: bool,
    pub only_in_a: Vec<String>,
    pub only_in_b: Vec<String>,
    /// The leaves both hold that differ, in `a`'s order.
    pub differing: Vec<(String, LeafDiff)>,
    /// Tensors of one layout compared element by element.
    pub tensors_compared: usize,
    /// The largest element-wise difference over them (NaN when one side had a NaN alone).
    pub max_abs: f64,
}

impl TreeDiff {
    /// Keys held by one side only, plus leaves that differ.
    pub fn differences(&self) -> usize {
        self.only_in_a.len() + self.only_in_b.len() + self.differing.len()
    }

    /// The comparison as `tandem ckpt diff` prints it, naming the sides `a` and `b`.
    pub fn report(&self, a: &str, b: &str) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        if self.unwrapped {
            out.push_str(
                "note: keys compared without wrapper segments (`module.`, `_orig_mod.`)\n",
            );
        }
        for (keys, side) in [(&self.only_in_a, a), (&self.only_in_b, b)] {
            if !keys.is_empty() {
                let _ = writeln!(out, "only in {side} ({}):", keys.len());
                keys.iter().for_each(|k| _ = writeln!(out, "  {k}"));
            }
        }
        for (k, how) in &self.differing {
            let _ = match how {
                LeafDiff::Layout { a, b } => {
                    writeln!(out, "{k}: {} {:?} vs {} {:?}", a.0, a.1, b.0, b.1)
                }
                LeafDiff::Values { max_abs } => {
                    writeln!(out, "{k}: max abs difference {max_abs:e}")
                }
                LeafDiff::Other { a, b } => writeln!(out, "{k}: {a} vs {b}"),
            };
        }
        let _ = writeln!(
            out,
            "{} tensors compared, max abs difference {:e}, {} differences",
            self.tensors_compared,
            self.max_abs,
            self.differences()
        );
        out
    }
}

/// Compares `a` and `b` leaf by leaf ([`TreeDiff`]).
pub fn diff(a: &Value, b: &Value) -> TreeDiff {
    let (la, ua) = unwrapped_leaves(a);
    let (lb, ub) = unwrapped_leaves(b);
    let in_a: HashMap<&str, &Value> = la.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let in_b: HashMap<&str, &Value> = lb.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let only = |l: &[(String, &Value)], other: &HashMap<&str, &Value>| -> Vec<String> {
        l.iter().map(|(k, _)| k.clone()).filter(|k| !other.contains_key(k.as_str())).collect()
    };
    let mut out = TreeDiff {
        unwrapped: ua || ub,
        only_in_a: only(&la, &in_b),
        only_in_b: only(&lb, &in_a),
        ..TreeDiff::default()
    };
    for (k, x) in &la {
        let Some(y) = in_b.get(k.as_str()) else { continue };
        let found = match (x, y) {
            (Value::Tensor(s), Value::Tensor(t)) if s.shape != t.shape || s.dtype != t.dtype => {
                Some(LeafDiff::Layout {
                    a: (s.dtype.to_string(), s.shape.clone()),
                    b: (t.dtype.to_string(), t.shape.clone()),
                })
            }
            (Value::Tensor(s), Value::Tensor(t)) => {
                out.tensors_compared += 1;
                let d = max_abs_difference(s, t);
                if d.is_nan() || d > out.max_abs {
                    out.max_abs = d;
                }
                (d != 0.0).then_some(LeafDiff::Values { max_abs: d })
            }
            (x, y) if x != y => Some(LeafDiff::Other { a: short_repr(x), b: short_repr(y) }),
            _ => None,
        };
        out.differing.extend(found.map(|d| (k.clone(), d)));
    }
    out
}

/// The largest `|s - t|` over the elements; NaN against a number is NaN, NaN against NaN 0.
fn max_abs_difference(s: &TensorData, t: &TensorData) -> f64 {
    s.to_f64_vec()
        .iter()
        .zip(t.to_f64_vec())
        .map(|(p, q)| if p.is_nan() && q.is_nan() { 0.0 } else { (p - q).abs() })
        .fold(0f64, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// Every leaf with wrapper segments taken out of its path, and whether any was.
fn unwrapped_leaves(v: &Value) -> (Vec<(String, &Value)>, bool) {
    let mut unwrapped = false;
    let out = leaves(v)
        .into_iter()
        .map(|(p, x)| {
            let c = strip_wrappers(&p);
            unwrapped |= c != p;
            (c, x)
        })
        .collect();
    (out, unwrapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: &[f32]) -> Value {
        Value::Tensor(TensorData::from_f32(&[values.len()], values))
    }

    fn dict(items: Vec<(&str, Value)>) -> Value {
        Value::Dict(items.into_iter().map(|(k, v)| (Value::Str(k.into()), v)).collect())
    }

    #[test]
    fn leaves_are_paths_to_every_non_container_value() {
        let v = dict(vec![
            ("model", dict(vec![("fc.weight", tensor(&[1.0]))])),
            ("misc", Value::List(vec![Value::Int(3), Value::List(vec![])])),
        ]);
        let paths: Vec<String> = leaves(&v).into_iter().map(|(p, _)| p).collect();
        assert_eq!(paths, ["model/fc.weight", "misc/0", "misc/1"]);
        let summary = summarize(&v);
        assert_eq!(summary.container_keys, ["model", "misc"]);
        assert_eq!(summary.state_dicts, [StateDictAt { at: "model".into(), tensors: 1 }]);
        assert_eq!(summary.tensors[0].dtype, "float32");
        assert_eq!((summary.tensors[0].bytes, summary.total_tensor_bytes), (4, 4));
        assert_eq!(summary.values.len(), 2);
        assert_eq!((summary.values[1].type_name, summary.values[1].value.as_str()), ("list", "[]"));
        assert_eq!(tensor_bytes(&v), 4);
        assert_eq!(select(&v, "model/fc.weight").unwrap(), &tensor(&[1.0]));
        let e = select(&v, "model/fc.bias").unwrap_err().to_string();
        assert!(e.contains("no `fc.bias`") && e.contains("fc.weight"), "{e}");
    }

    #[test]
    fn prefixes_come_off_and_go_on_with_the_module_versions() {
        let metadata = Value::OrderedDict {
            items: vec![
                (Value::Str("module".into()), Value::Int(1)),
                (Value::Str("module.fc".into()), Value::Int(2)),
            ],
            metadata: None,
        };
        let wrapped = Value::OrderedDict {
            items: vec![
                (Value::Str("module.fc.weight".into()), tensor(&[1.0])),
                (Value::Str("step".into()), Value::Int(4)),
            ],
            metadata: Some(Box::new(metadata)),
        };
        let (plain, n) = strip_prefix(&wrapped, "module.").unwrap();
        assert_eq!(n, 1);
        assert_eq!(keys_of(&plain), ["fc.weight", "step"]);
        let Value::OrderedDict { metadata: Some(m), .. } = &plain else { panic!("{plain:?}") };
        assert_eq!(keys_of(m), ["", "fc"]);
        let again = add_prefix(&plain, "module.").unwrap();
        assert_eq!(keys_of(&again), ["module.fc.weight", "module.step"]);
        let Value::OrderedDict { metadata: Some(m), .. } = &again else { panic!("{again:?}") };
        assert_eq!(keys_of(m), ["module", "module.fc"]);
        assert!(strip_prefix(&Value::Int(1), "module.").is_err());
    }

    #[test]
    fn a_diff_names_each_difference_and_ignores_wrappers() {
        let a = dict(vec![
            ("module.fc.weight", tensor(&[1.0, 2.0])),
            ("module.fc.bias", tensor(&[0.0])),
            ("lr", Value::Float(0.1)),
            ("gone", Value::Int(1)),
        ]);
        let b = dict(vec![
            ("fc.weight", tensor(&[1.0, 5.0])),
            ("fc.bias", tensor(&[0.0, 0.0])),
            ("lr", Value::Float(0.2)),
            ("new", Value::Int(1)),
        ]);
        let d = diff(&a, &b);
        assert!(d.unwrapped);
        assert_eq!(d.only_in_a, ["gone"]);
        assert_eq!(d.only_in_b, ["new"]);
        assert_eq!(d.tensors_compared, 1);
        assert_eq!(d.max_abs, 3.0);
        assert_eq!(d.differing[0], ("fc.weight".into(), LeafDiff::Values { max_abs: 3.0 }));
        assert!(matches!(d.differing[1].1, LeafDiff::Layout { .. }));
        assert_eq!(d.differing[2].1, LeafDiff::Other { a: "0.1".into(), b: "0.2".into() });
        assert_eq!(d.differences(), 5);
        assert_eq!(diff(&a, &a).differences(), 0);
        let nan = |x: f32| dict(vec![("t", tensor(&[x]))]);
        assert_eq!(diff(&nan(f32::NAN), &nan(f32::NAN)).differences(), 0);
        assert!(diff(&nan(f32::NAN), &nan(1.0)).max_abs.is_nan());
    }
}
