//! Row slices of saved tensors: cutting rows out of a rank's block and stacking the pieces of
//! a range held by several saved ranks, over a whole value tree (the centres and every
//! optimizer tensor of the rows alike).
use std::ops::Range;
use std::path::{Path, PathBuf};

use tandem_ckpt::{TensorData, Value};

use super::{invalid, Result};

/// Rows `rows` of a tensor (a row is everything after dimension 0; a scalar is one row of one
/// element, as a sharded model lays it out).
pub fn slice_rows(t: &TensorData, rows: Range<usize>) -> TensorData {
    let mut shape = if t.shape.is_empty() { vec![1] } else { t.shape.clone() };
    let row_bytes = shape[1..].iter().product::<usize>() * t.dtype.size();
    let bytes = t.contiguous_bytes();
    let part = bytes[rows.start * row_bytes..rows.end * row_bytes].to_vec();
    shape[0] = rows.len();
    TensorData::from_bytes(t.dtype, &shape, part)
}

/// Stacks tensors of one dtype and row shape by rows (`path`: the file named if they do not).
pub(crate) fn concat_rows(parts: &[TensorData], path: &Path) -> Result<TensorData> {
    let Some(first) = parts.first() else { return Err(invalid(path, "no rows")) };
    let mut bytes = Vec::new();
    let mut rows = 0;
    for p in parts {
        if p.dtype != first.dtype || p.shape.is_empty() || p.shape[1..] != first.shape[1..] {
            let why = format!(
                "row blocks of different dtypes or shapes ({:?} {:?}, {:?} {:?})",
                first.dtype, first.shape, p.dtype, p.shape
            );
            return Err(invalid(path, why));
        }
        bytes.extend_from_slice(&p.contiguous_bytes());
        rows += p.shape[0];
    }
    let mut shape = first.shape.clone();
    shape[0] = rows;
    Ok(TensorData::from_bytes(first.dtype, &shape, bytes))
}

/// One saved rank's block of a row shard: its value, its row count, the rows wanted from it
/// (relative to its start) and its file (named in errors).
pub(crate) struct RowPart {
    pub value: Value,
    pub len: usize,
    pub rows: Range<usize>,
    pub path: PathBuf,
}

/// The wanted rows of every part stacked, over the value tree of the first part: tensors whose
/// first dimension is the part's row count are cut and stacked; anything else comes from the
/// first part. `at` names the entry in errors.
pub(crate) fn merge(parts: &[RowPart], at: &str) -> Result<Value> {
    let Some(first) = parts.first() else { return Ok(Value::None) };
    merge_at(parts, &|p: &RowPart| Some(&p.value), &first.value, at)
}

fn merge_at<'a>(
    parts: &'a [RowPart],
    get: &dyn Fn(&'a RowPart) -> Option<&'a Value>,
    here: &Value,
    at: &str,
) -> Result<Value> {
    let first = &parts[0];
    match here {
        Value::Tensor(t) if t.shape.first() == Some(&first.len) => {
            let mut pieces = Vec::with_capacity(parts.len());
            for p in parts {
                let t = get(p)
                    .and_then(Value::as_tensor)
                    .filter(|t| t.shape.first() == Some(&p.len))
                    .ok_or_else(|| {
                        invalid(&p.path, format!("`{at}` is missing or not {} rows", p.len))
                    })?;
                pieces.push(slice_rows(t, p.rows.clone()));
            }
            Ok(Value::Tensor(concat_rows(&pieces, &first.path)?))
        }
        Value::Dict(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (key, value) in items {
                let child = move |p: &'a RowPart| get(p).and_then(|v| dict_get(v, key));
                let name = match key {
                    Value::Str(s) => format!("{at}.{s}"),
                    other => format!("{at}.{}", other.as_int().unwrap_or(-1)),
                };
                out.push((key.clone(), merge_at(parts, &child, value, &name)?));
            }
            Ok(Value::Dict(out))
        }
        other => Ok(other.clone()),
    }
}

/// A dict's entry under `key` (string or integer keys alike).
fn dict_get<'v>(v: &'v Value, key: &Value) -> Option<&'v Value> {
    v.as_dict()?.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` rows of two f32 counting up from `from`.
    fn rows(n: usize, from: f32) -> TensorData {
        let data: Vec<f32> = (0..n * 2).map(|i| from + i as f32).collect();
        TensorData::from_f32(&[n, 2], &data)
    }

    #[test]
    fn rows_slice_and_concatenate_back() {
        let t = rows(5, 0.0);
        let parts = [slice_rows(&t, 0..2), slice_rows(&t, 2..5)];
        let path = Path::new("rank-0.pt");
        assert_eq!(concat_rows(&parts, path).unwrap().to_f32_vec(), t.to_f32_vec());
        assert_eq!(slice_rows(&t, 3..4).to_f32_vec(), vec![6.0, 7.0]);
        let odd = TensorData::from_f32(&[1, 3], &[0.0; 3]);
        let err = concat_rows(&[t, odd], path).unwrap_err().to_string();
        assert!(err.starts_with("rank-0.pt: ") && err.contains("shapes"), "{err}");
    }

    #[test]
    fn merging_cuts_every_row_tensor_and_keeps_the_rest_from_the_first_part() {
        let part = |n: usize, from: f32, step: i64| {
            Value::dict_from([
                ("weight", Value::Tensor(rows(n, from))),
                (
                    "state",
                    Value::dict_from([
                        ("exp_avg", Value::Tensor(rows(n, from + 100.0))),
                        ("step", Value::Tensor(TensorData::from_f32(&[], &[step as f32]))),
                    ]),
                ),
            ])
        };
        // Rows 1..5 of an object saved as 3 rows + 3 rows.
        let parts = [
            RowPart { value: part(3, 0.0, 7), len: 3, rows: 1..3, path: "a".into() },
            RowPart { value: part(3, 6.0, 8), len: 3, rows: 0..2, path: "b".into() },
        ];
        let m = merge(&parts, "head").unwrap();
        let w = m.get("weight").unwrap().as_tensor().unwrap();
        assert_eq!(w.shape, [4, 2]);
        assert_eq!(w.to_f32_vec(), [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
        let s = m.get("state").unwrap();
        assert_eq!(s.get("exp_avg").unwrap().as_tensor().unwrap().to_f32_vec()[0], 102.0);
        assert_eq!(s.get("step").unwrap().as_tensor().unwrap().to_f32_vec(), [7.0]);
        // A part whose optimizer tensor is missing is named.
        let broken = RowPart {
            value: Value::dict_from([("weight", Value::Tensor(rows(3, 6.0)))]),
            len: 3,
            rows: 0..1,
            path: "rank-1.pt".into(),
        };
        let e = merge(&[parts.into_iter().next().unwrap(), broken], "head").unwrap_err();
        assert!(e.to_string().contains("rank-1.pt") && e.to_string().contains("head.state"), "{e}");
    }
}
