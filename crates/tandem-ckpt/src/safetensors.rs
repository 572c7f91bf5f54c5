//! safetensors files (weights only), through the `safetensors` crate. A file is a flat
//! `name -> tensor` map: nested dicts are flattened with `.` on save; tied tensors are written
//! once per name (the format has no sharing).
use std::io::Write;
use std::path::Path;

use crate::error::{CkptError, Result};
use crate::pt::{FileBytes, LoadOptions};
use crate::value::{ElemType, TensorData, Value};

fn to_st(d: ElemType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        ElemType::F64 => S::F64,
        ElemType::F32 => S::F32,
        ElemType::F16 => S::F16,
        ElemType::BF16 => S::BF16,
        ElemType::I64 => S::I64,
        ElemType::I32 => S::I32,
        ElemType::I16 => S::I16,
        ElemType::I8 => S::I8,
        ElemType::U8 => S::U8,
        ElemType::Bool => S::BOOL,
    }
}

fn from_st(d: safetensors::Dtype) -> Option<ElemType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::F64 => ElemType::F64,
        S::F32 => ElemType::F32,
        S::F16 => ElemType::F16,
        S::BF16 => ElemType::BF16,
        S::I64 => ElemType::I64,
        S::I32 => ElemType::I32,
        S::I16 => ElemType::I16,
        S::I8 => ElemType::I8,
        S::U8 => ElemType::U8,
        S::BOOL => ElemType::Bool,
        _ => return None,
    })
}

/// `name -> tensor` pairs of a (possibly nested) dict of tensors, names joined with `.`.
/// Anything that is not a tensor or a str-keyed dict is an error naming its key.
pub fn flatten_tensors(value: &Value) -> Result<Vec<(String, TensorData)>> {
    fn walk(v: &Value, prefix: &str, out: &mut Vec<(String, TensorData)>) -> Result<()> {
        match v {
            Value::Tensor(t) => {
                out.push((prefix.to_string(), t.clone()));
                Ok(())
            }
            Value::Dict(items) | Value::OrderedDict { items, .. } => {
                for (k, v) in items {
                    let k = match k {
                        Value::Str(s) => s.clone(),
                        Value::Int(i) => i.to_string(),
                        other => {
                            return Err(CkptError::Unsupported {
                                what: format!("key under `{prefix}`"),
                                msg: format!("a {} key cannot be a tensor name", other.type_name()),
                            })
                        }
                    };
                    let name = if prefix.is_empty() { k } else { format!("{prefix}.{k}") };
                    walk(v, &name, out)?;
                }
                Ok(())
            }
            other => Err(CkptError::Unsupported {
                what: format!("`{prefix}` as safetensors"),
                msg: format!("it is a {}; safetensors holds tensors only (pick a sub-dict, e.g. --key model)", other.type_name()),
            }),
        }
    }
    let mut out = Vec::new();
    walk(value, "", &mut out)?;
    Ok(out)
}

/// Writes the tensors of `value` (a dict of tensors, nested dicts flattened) atomically.
pub fn save(path: &Path, value: &Value) -> Result<()> {
    let tensors = flatten_tensors(value)?;
    let mut seen = std::collections::HashSet::new();
    for (name, t) in &tensors {
        if t.shape.len() != t.stride.len() {
            return Err(CkptError::Unsupported {
                what: format!("tensor `{name}`"),
                msg: "size and stride differ in length".into(),
            });
        }
        crate::pickle::read::check_view(
            &t.shape,
            &t.stride,
            t.storage_offset,
            t.dtype,
            t.storage.len(),
        )
        .map_err(|msg| CkptError::Unsupported { what: format!("tensor `{name}`"), msg })?;
        if !seen.insert(name.as_str()) {
            return Err(CkptError::Unsupported {
                what: format!("tensor `{name}`"),
                msg: "the name occurs twice after flattening".into(),
            });
        }
    }
    // The layout safetensors' own writer uses (descending dtype alignment, then name; header
    // from the crate's `Metadata`, padded to 8 bytes), written straight into our atomic temp
    // file: `serialize_to_file` would pre-size a second temp file and rename it over ours.
    let mut order: Vec<&(String, TensorData)> = tensors.iter().collect();
    order.sort_by(|(ln, lt), (rn, rt)| to_st(rt.dtype).cmp(&to_st(lt.dtype)).then(ln.cmp(rn)));
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0;
    for (name, t) in &order {
        let n = t.nbytes();
        infos.push((
            name.clone(),
            safetensors::tensor::TensorInfo {
                dtype: to_st(t.dtype),
                shape: t.shape.clone(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let unsupported =
        |msg: String| CkptError::Unsupported { what: path.display().to_string(), msg };
    let meta = Some(std::collections::HashMap::from([("format".to_string(), "pt".to_string())]));
    let metadata =
        safetensors::tensor::Metadata::new(meta, infos).map_err(|e| unsupported(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| unsupported(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    crate::atomic::write_atomic(path, |f| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for (_, t) in &order {
            w.write_all(&t.contiguous_bytes())?;
        }
        w.flush()
    })
}

/// Reads a safetensors file into a dict `name -> tensor` in file order (memory-mapped when large).
pub fn load(path: &Path) -> Result<Value> {
    let fb = FileBytes::open(path, LoadOptions::default().mmap)?;
    from_bytes(path, &fb)
}

pub(crate) fn from_bytes(path: &Path, fb: &FileBytes) -> Result<Value> {
    let bytes = fb.bytes();
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| CkptError::format(path, format!("not a valid safetensors file: {e}")))?;
    let base = bytes.as_ptr() as usize;
    let mut items: Vec<(usize, String, TensorData)> = Vec::new();
    for (name, view) in st.iter() {
        let dtype = from_st(view.dtype()).ok_or_else(|| {
            CkptError::format(
                path,
                format!(
                    "tensor `{name}` has dtype {:?}, which tandem does not support",
                    view.dtype()
                ),
            )
        })?;
        let data = view.data();
        let start = data.as_ptr() as usize - base;
        let shape = view.shape().to_vec();
        let t = TensorData {
            dtype,
            stride: crate::value::contiguous_stride(&shape),
            shape,
            storage_offset: 0,
            storage: fb.storage(start, data.len()),
        };
        items.push((start, name.to_string(), t));
    }
    items.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    Ok(Value::Dict(items.into_iter().map(|(_, n, t)| (Value::Str(n), Value::Tensor(t))).collect()))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    struct View<'a>(&'a TensorData);

    impl safetensors::View for View<'_> {
        fn dtype(&self) -> safetensors::Dtype {
            to_st(self.0.dtype)
        }
        fn shape(&self) -> &[usize] {
            &self.0.shape
        }
        fn data(&self) -> Cow<'_, [u8]> {
            self.0.contiguous_bytes()
        }
        fn data_len(&self) -> usize {
            self.0.nbytes()
        }
    }

    #[test]
    fn our_writer_writes_the_crates_bytes() {
        let value = Value::dict_from([
            ("b.weight", Value::Tensor(TensorData::from_f32(&[2, 3], &[1., 2., 3., 4., 5., 6.]))),
            ("a.bias", Value::Tensor(TensorData::from_f32(&[3], &[7., 8., 9.]))),
            ("steps", Value::Tensor(TensorData::from_i64(&[2], &[3, 4]))),
            ("z", Value::dict_from([("h", Value::Tensor(TensorData::from_f32(&[1], &[0.5])))])),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        save(&path, &value).unwrap();
        let tensors = flatten_tensors(&value).unwrap();
        let views: Vec<(String, View)> =
            tensors.iter().map(|(n, t)| (n.clone(), View(t))).collect();
        let meta = Some(std::collections::HashMap::from([("format".into(), "pt".into())]));
        let expected = safetensors::serialize(views, meta).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), expected);
    }
}
