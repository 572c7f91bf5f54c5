//! The state dict an export reads: keys with any `module.` / `_orig_mod.` wrapping removed,
//! each tensor taken at most once with its shape checked, and nothing left over (an export is a
//! strict load: a key the graph does not use means the wrong model was named).
use std::collections::BTreeMap;

use tandem_ckpt::keys::strip_wrappers;
use tandem_ckpt::TensorData;

use crate::error::{OnnxError, Result};

/// Keys an inference graph has no use for.
fn is_unused_by_inference(key: &str) -> bool {
    key.ends_with("num_batches_tracked")
}

pub struct StateDict {
    model: &'static str,
    tensors: BTreeMap<String, TensorData>,
    /// The keys in the file's order, for messages.
    order: Vec<String>,
}

/// A float tensor read from the state dict: its shape and values as f32.
pub struct Weight {
    pub name: String,
    pub dims: Vec<usize>,
    pub data: Vec<f32>,
}

impl StateDict {
    /// `model` names the architecture in errors.
    pub fn new(model: &'static str, state: &[(String, TensorData)]) -> Self {
        let order: Vec<String> = state.iter().map(|(k, _)| strip_wrappers(k)).collect();
        let tensors = order.iter().cloned().zip(state.iter().map(|(_, t)| t.clone())).collect();
        StateDict { model, tensors, order }
    }

    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// The shape of `key`, which must have `rank` dimensions (the tensor stays to be taken).
    pub fn dims(&self, key: &str, rank: usize) -> Result<&[usize]> {
        match self.tensors.get(key) {
            None => Err(self.missing(key)),
            Some(t) if t.shape.len() != rank => Err(OnnxError::Shape {
                model: self.model,
                key: key.into(),
                got: t.shape.clone(),
                expected: format!("{rank} dimensions"),
            }),
            Some(t) => Ok(&t.shape),
        }
    }

    fn missing(&self, key: &str) -> OnnxError {
        OnnxError::MissingKey { model: self.model, key: key.into(), present: self.key_list() }
    }

    /// Takes `key`, which must have `rank` dimensions; `expected[i]`, where given, is the
    /// size dimension `i` must have.
    pub fn take(&mut self, key: &str, expected: &[Option<usize>]) -> Result<Weight> {
        let Some(t) = self.tensors.remove(key) else {
            return Err(self.missing(key));
        };
        if !t.dtype.is_float() {
            return Err(OnnxError::NotFloat {
                model: self.model,
                key: key.into(),
                dtype: t.dtype.torch_name(),
            });
        }
        let fits = t.shape.len() == expected.len()
            && t.shape.iter().zip(expected).all(|(&d, e)| e.is_none_or(|e| e == d));
        if !fits {
            let expected = expected
                .iter()
                .map(|e| e.map_or("_".to_string(), |d| d.to_string()))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(OnnxError::Shape {
                model: self.model,
                key: key.into(),
                got: t.shape.clone(),
                expected: format!("[{expected}]"),
            });
        }
        Ok(Weight { name: key.into(), dims: t.shape.clone(), data: t.to_f32_vec() })
    }

    /// Fails when keys other than those an inference graph ignores were not taken.
    pub fn finish(self) -> Result<()> {
        let left = self.left();
        if left.is_empty() {
            return Ok(());
        }
        Err(OnnxError::UnexpectedKeys { model: self.model, keys: abbreviate(&left) })
    }

    /// The keys not taken yet that inference would use, in the file's order.
    fn left(&self) -> Vec<&str> {
        self.order
            .iter()
            .map(String::as_str)
            .filter(|k| self.tensors.contains_key(*k) && !is_unused_by_inference(k))
            .collect()
    }

    fn key_list(&self) -> String {
        let keys = self.left();
        if keys.is_empty() {
            return "none left".into();
        }
        abbreviate(&keys)
    }
}

/// The first few keys and how many more.
fn abbreviate(keys: &[&str]) -> String {
    const SHOWN: usize = 6;
    let mut s = keys.iter().take(SHOWN).copied().collect::<Vec<_>>().join(", ");
    if keys.len() > SHOWN {
        s.push_str(&format!(" and {} more", keys.len() - SHOWN));
    }
    s
}
