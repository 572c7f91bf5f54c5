//! The value tree of a checkpoint: what `torch.save` writes and `torch.load(weights_only=True)`
//! reads back — None, bools, ints, floats, strings, lists, tuples, dicts and tensors, nested to
//! any depth. Tensors keep PyTorch's storage model (storage + offset + strides) so views and
//! tied weights survive a round trip.
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// Element type of a tensor, named as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl ElemType {
    pub const ALL: [ElemType; 10] = [
        ElemType::F64,
        ElemType::F32,
        ElemType::F16,
        ElemType::BF16,
        ElemType::I64,
        ElemType::I32,
        ElemType::I16,
        ElemType::I8,
        ElemType::U8,
        ElemType::Bool,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElemType::F64 | ElemType::I64 => 8,
            ElemType::F32 | ElemType::I32 => 4,
            ElemType::F16 | ElemType::BF16 | ElemType::I16 => 2,
            ElemType::I8 | ElemType::U8 | ElemType::Bool => 1,
        }
    }

    /// PyTorch's name (`torch.float32` prints as `float32`).
    pub fn torch_name(self) -> &'static str {
        match self {
            ElemType::F64 => "float64",
            ElemType::F32 => "float32",
            ElemType::F16 => "float16",
            ElemType::BF16 => "bfloat16",
            ElemType::I64 => "int64",
            ElemType::I32 => "int32",
            ElemType::I16 => "int16",
            ElemType::I8 => "int8",
            ElemType::U8 => "uint8",
            ElemType::Bool => "bool",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, ElemType::F64 | ElemType::F32 | ElemType::F16 | ElemType::BF16)
    }
}

impl fmt::Display for ElemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}

/// Bytes that live outside the checkpoint's own memory (a training tensor's storage, lent to a
/// synchronous save so that the save makes no staging copy). Whoever builds one promises the
/// bytes stay valid and unchanged while it is alive.
pub trait ExternalBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
}

enum StorageBytes {
    Owned(Vec<u8>),
    External(Box<dyn ExternalBytes>),
    Mapped {
        map: Arc<memmap2::Mmap>,
        start: usize,
        len: usize,
    },
    /// A slice of a file read whole into memory (several storages share one buffer).
    Shared {
        buf: Arc<Vec<u8>>,
        start: usize,
        len: usize,
    },
}

/// The raw little-endian bytes of one storage. Cloning shares it: two tensors holding clones
/// of one `StorageData` are tied (the writer stores it once, `StorageData::same` tells).
#[derive(Clone)]
pub struct StorageData {
    bytes: Arc<StorageBytes>,
}

impl StorageData {
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        StorageData { bytes: Arc::new(StorageBytes::Owned(bytes)) }
    }

    /// A storage whose bytes another owner lends (see [`ExternalBytes`]).
    pub fn from_external(bytes: Box<dyn ExternalBytes>) -> Self {
        StorageData { bytes: Arc::new(StorageBytes::External(bytes)) }
    }

    /// A storage that lives in a memory-mapped file (bytes `start..start+len`).
    /// Panics if the range lies outside the map; readers check ranges before calling.
    pub fn from_mmap(map: Arc<memmap2::Mmap>, start: usize, len: usize) -> Self {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= map.len()),
            "storage range outside map"
        );
        StorageData { bytes: Arc::new(StorageBytes::Mapped { map, start, len }) }
    }

    /// A storage that is bytes `start..start+len` of a shared buffer.
    /// Panics if the range lies outside the buffer; readers check ranges before calling.
    pub fn from_shared(buf: Arc<Vec<u8>>, start: usize, len: usize) -> Self {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= buf.len()),
            "storage range outside buffer"
        );
        StorageData { bytes: Arc::new(StorageBytes::Shared { buf, start, len }) }
    }

    /// True when the bytes live in a memory mapping: a mapped file, or the anonymous mapping a
    /// large file was read into.
    pub fn is_mapped(&self) -> bool {
        matches!(&*self.bytes, StorageBytes::Mapped { .. })
    }

    pub fn bytes(&self) -> &[u8] {
        match &*self.bytes {
            StorageBytes::Owned(v) => v,
            StorageBytes::External(e) => e.bytes(),
            StorageBytes::Mapped { map, start, len } => &map[*start..*start + *len],
            StorageBytes::Shared { buf, start, len } => &buf[*start..*start + *len],
        }
    }

    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when both handles point at the very same storage (tied weights).
    pub fn same(&self, other: &StorageData) -> bool {
        Arc::ptr_eq(&self.bytes, &other.bytes)
    }

    /// A stable identity for this storage while it is alive (for deduplication when writing).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.bytes) as *const u8 as usize
    }
}

impl fmt::Debug for StorageData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageData({} bytes)", self.len())
    }
}

/// A tensor as PyTorch stores it: a view (`shape`, `stride`, `storage_offset`, all in elements)
/// into a shared storage of `dtype` elements.
#[derive(Clone, Debug)]
pub struct TensorData {
    pub dtype: ElemType,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
    pub storage_offset: usize,
    pub storage: StorageData,
}

/// Row-major (C-contiguous) strides for `shape`.
pub fn contiguous_stride(shape: &[usize]) -> Vec<usize> {
    let mut stride = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        stride[i] = stride[i + 1] * shape[i + 1].max(1);
    }
    stride
}

impl TensorData {
    /// A contiguous tensor owning `bytes` (little-endian, `numel * dtype.size()` bytes).
    pub fn from_bytes(dtype: ElemType, shape: &[usize], bytes: Vec<u8>) -> Self {
        Self::from_storage(dtype, shape, StorageData::from_vec(bytes))
    }

    /// A contiguous tensor over `storage`, whose length must be the shape's bytes.
    pub fn from_storage(dtype: ElemType, shape: &[usize], storage: StorageData) -> Self {
        debug_assert_eq!(storage.len(), shape.iter().product::<usize>() * dtype.size());
        TensorData {
            dtype,
            shape: shape.to_vec(),
            stride: contiguous_stride(shape),
            storage_offset: 0,
            storage,
        }
    }

    pub fn from_f32(shape: &[usize], data: &[f32]) -> Self {
        Self::from_bytes(ElemType::F32, shape, bytemuck::cast_slice(data).to_vec())
    }

    pub fn from_f64(shape: &[usize], data: &[f64]) -> Self {
        Self::from_bytes(ElemType::F64, shape, bytemuck::cast_slice(data).to_vec())
    }

    pub fn from_i64(shape: &[usize], data: &[i64]) -> Self {
        Self::from_bytes(ElemType::I64, shape, bytemuck::cast_slice(data).to_vec())
    }

    /// A 0-d float32 tensor (what `torch.tensor(1.0)` is).
    pub fn scalar_f32(v: f32) -> Self {
        Self::from_f32(&[], &[v])
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    pub fn is_contiguous(&self) -> bool {
        self.numel() <= 1 || self.stride == contiguous_stride(&self.shape)
    }

    /// The tensor's elements in row-major order as little-endian bytes (borrowed when the view
    /// is already contiguous).
    pub fn contiguous_bytes(&self) -> Cow<'_, [u8]> {
        let es = self.dtype.size();
        let n = self.numel();
        let all = self.storage.bytes();
        if self.is_contiguous() {
            let start = self.storage_offset * es;
            return Cow::Borrowed(&all[start..start + n * es]);
        }
        let mut out = Vec::with_capacity(n * es);
        let mut index = vec![0usize; self.shape.len()];
        for _ in 0..n {
            let off = self.storage_offset
                + index.iter().zip(&self.stride).map(|(i, s)| i * s).sum::<usize>();
            out.extend_from_slice(&all[off * es..off * es + es]);
            for d in (0..index.len()).rev() {
                index[d] += 1;
                if index[d] < self.shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Cow::Owned(out)
    }

    /// Rows `rows` of the tensor (its first dimension; a scalar is one row) as a contiguous
    /// tensor of its dtype, copying only those rows' bytes when the rows lie contiguously in the
    /// storage (a mapped file's other pages are never touched). `None` past the last row.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Option<TensorData> {
        let total = self.shape.first().copied().unwrap_or(1);
        if rows.start > rows.end || rows.end > total {
            return None;
        }
        let mut shape = self.shape.clone();
        match shape.first_mut() {
            Some(first) => *first = rows.len(),
            None => shape.push(rows.len()),
        }
        let es = self.dtype.size();
        let row = self.shape.iter().skip(1).product::<usize>();
        let bytes = match self.is_contiguous() {
            true => {
                let start = (self.storage_offset + rows.start * row) * es;
                self.storage.bytes()[start..start + rows.len() * row * es].to_vec()
            }
            false => self.contiguous_bytes()[rows.start * row * es..rows.end * row * es].to_vec(),
        };
        Some(TensorData::from_bytes(self.dtype, &shape, bytes))
    }

    /// Elements converted to f64 (any dtype; bool is 0/1).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let b = self.contiguous_bytes();
        match self.dtype {
            ElemType::F64 => {
                b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
            }
            ElemType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            ElemType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64())
                .collect(),
            ElemType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
                .collect(),
            ElemType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            ElemType::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            ElemType::I16 => b
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            ElemType::I8 => b.iter().map(|&x| x as i8 as f64).collect(),
            ElemType::U8 | ElemType::Bool => b.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Elements converted to f32 (exact for f32/f16/bf16 sources).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        if self.dtype == ElemType::F32 {
            return bytemuck::pod_collect_to_vec(&self.contiguous_bytes());
        }
        self.to_f64_vec().into_iter().map(|v| v as f32).collect()
    }

    /// Elements converted to i64 (floats truncate).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        if self.dtype == ElemType::I64 {
            return bytemuck::pod_collect_to_vec(&self.contiguous_bytes());
        }
        self.to_f64_vec().into_iter().map(|v| v as i64).collect()
    }
}

/// Equal when dtype, shape and element bytes are equal (strides and storage sharing aside).
impl PartialEq for TensorData {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.contiguous_bytes() == other.contiguous_bytes()
    }
}

/// A node of the value tree. Dicts keep insertion order (Python 3.7+ dicts do) and allow any
/// key value, as optimizer `state` dicts are keyed by int.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// `collections.OrderedDict` with its `_metadata` attribute (what `module.state_dict()`
    /// returns: the module versions `load_state_dict` hands to `_load_from_state_dict`). Only
    /// [`LoadOptions::keep_ordered_dicts`](crate::LoadOptions) reads it (for a faithful
    /// re-save, as `tandem ckpt convert` does); otherwise OrderedDicts read as [`Value::Dict`].
    /// The dict accessors treat both alike.
    OrderedDict {
        items: Vec<(Value, Value)>,
        metadata: Option<Box<Value>>,
    },
    Tensor(TensorData),
}

impl Value {
    pub fn new_dict() -> Value {
        Value::Dict(Vec::new())
    }

    /// Builds a dict from `(str key, value)` pairs.
    pub fn dict_from<K: Into<String>>(items: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Dict(items.into_iter().map(|(k, v)| (Value::Str(k.into()), v)).collect())
    }

    /// The value under a string key of a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) | Value::OrderedDict { items, .. } => {
                items.iter().find(|(k, _)| matches!(k, Value::Str(s) if s == key)).map(|(_, v)| v)
            }
            _ => None,
        }
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut Value> {
        match self {
            Value::Dict(items) | Value::OrderedDict { items, .. } => items
                .iter_mut()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The value under an int key of a dict (optimizer `state`).
    pub fn get_int(&self, key: i64) -> Option<&Value> {
        match self {
            Value::Dict(items) | Value::OrderedDict { items, .. } => {
                items.iter().find(|(k, _)| matches!(k, Value::Int(i) if *i == key)).map(|(_, v)| v)
            }
            _ => None,
        }
    }

    /// Inserts into a dict, replacing an existing entry with an equal key. No-op on non-dicts
    /// is never wanted, so that panics in debug builds.
    pub fn insert(&mut self, key: impl Into<Value>, value: impl Into<Value>) {
        let key = key.into();
        let value = value.into();
        match self {
            Value::Dict(items) | Value::OrderedDict { items, .. } => {
                if let Some(slot) = items.iter_mut().find(|(k, _)| *k == key) {
                    slot.1 = value;
                } else {
                    items.push((key, value));
                }
            }
            _ => debug_assert!(false, "insert into a non-dict value"),
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    pub fn as_float(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_tensor(&self) -> Option<&TensorData> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// Items of a list or tuple.
    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// Items of a dict or an OrderedDict.
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(v) | Value::OrderedDict { items: v, .. } => Some(v),
            _ => None,
        }
    }

    /// This value with every OrderedDict made a plain dict (its `_metadata` dropped): what a
    /// reader without `keep_ordered_dicts` returns.
    pub fn into_plain(self) -> Value {
        match self {
            Value::OrderedDict { items, .. } | Value::Dict(items) => Value::Dict(
                items.into_iter().map(|(k, v)| (k.into_plain(), v.into_plain())).collect(),
            ),
            Value::List(v) => Value::List(v.into_iter().map(Value::into_plain).collect()),
            Value::Tuple(v) => Value::Tuple(v.into_iter().map(Value::into_plain).collect()),
            other => other,
        }
    }

    /// Python-ish type name for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::OrderedDict { .. } => "OrderedDict",
            Value::Tensor(_) => "Tensor",
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}
impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::Int(v as i64)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<TensorData> for Value {
    fn from(t: TensorData) -> Self {
        Value::Tensor(t)
    }
}
impl From<Vec<Value>> for Value {
    fn from(v: Vec<Value>) -> Self {
        Value::List(v)
    }
}

impl TensorData {
    /// A contiguous copy converted to `dtype` (what `param.copy_(src)` does across dtypes: floats
    /// round to nearest, floats to ints truncate, anything to bool is `!= 0`).
    pub fn to_dtype(&self, dtype: ElemType) -> TensorData {
        if dtype == self.dtype {
            return TensorData::from_bytes(
                dtype,
                &self.shape,
                self.contiguous_bytes().into_owned(),
            );
        }
        let vals = self.to_f64_vec();
        let mut out = Vec::with_capacity(vals.len() * dtype.size());
        for v in vals {
            match dtype {
                ElemType::F64 => out.extend_from_slice(&v.to_le_bytes()),
                ElemType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
                ElemType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
                ElemType::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
                ElemType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
                ElemType::I32 => out.extend_from_slice(&(v as i64 as i32).to_le_bytes()),
                ElemType::I16 => out.extend_from_slice(&(v as i64 as i16).to_le_bytes()),
                ElemType::I8 => out.push(v as i64 as i8 as u8),
                ElemType::U8 => out.push(v as i64 as u8),
                ElemType::Bool => out.push((v != 0.0) as u8),
            }
        }
        TensorData::from_bytes(dtype, &self.shape, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_view_reads_in_row_major_order() {
        // 2x3 storage [0..6), transposed view 3x2 with strides (1, 3).
        let base = TensorData::from_f32(&[2, 3], &[0., 1., 2., 3., 4., 5.]);
        let t = TensorData { shape: vec![3, 2], stride: vec![1, 3], ..base };
        assert!(!t.is_contiguous());
        assert_eq!(t.to_f32_vec(), vec![0., 3., 1., 4., 2., 5.]);
    }

    #[test]
    fn rows_of_contiguous_offset_and_strided_tensors() {
        let base = TensorData::from_f32(&[4, 2], &[0., 1., 2., 3., 4., 5., 6., 7.]);
        assert_eq!(base.rows(1..3).unwrap().shape, [2, 2]);
        assert_eq!(base.rows(1..3).unwrap().to_f32_vec(), [2., 3., 4., 5.]);
        assert_eq!(base.rows(4..4).unwrap().to_f32_vec(), Vec::<f32>::new());
        assert!(base.rows(3..5).is_none());
        // Rows 1.. of the storage as a 3x2 view, and its transpose (2x3, not contiguous).
        let offset = TensorData { shape: vec![3, 2], storage_offset: 2, ..base.clone() };
        assert_eq!(offset.rows(2..3).unwrap().to_f32_vec(), [6., 7.]);
        let t = TensorData { shape: vec![2, 3], stride: vec![1, 2], storage_offset: 2, ..base };
        assert_eq!(t.rows(1..2).unwrap().to_f32_vec(), [3., 5., 7.]);
        let scalar = TensorData::scalar_f32(2.5);
        assert_eq!(
            (scalar.rows(0..1).unwrap().shape, scalar.rows(0..1).unwrap().to_f32_vec()),
            (vec![1], vec![2.5])
        );
    }

    #[test]
    fn dict_insert_replaces_equal_keys_and_keeps_order() {
        let mut d = Value::new_dict();
        d.insert("a", 1i64);
        d.insert(0i64, "x");
        d.insert("a", 2i64);
        assert_eq!(d.get("a"), Some(&Value::Int(2)));
        assert_eq!(d.get_int(0), Some(&Value::Str("x".into())));
        assert_eq!(d.as_dict().unwrap().len(), 2);
    }

    #[test]
    fn offset_view_and_conversions() {
        let base = TensorData::from_i64(&[4], &[1, -2, 3, 4]);
        let t = TensorData { shape: vec![2], stride: vec![1], storage_offset: 1, ..base };
        assert_eq!(t.to_i64_vec(), vec![-2, 3]);
        assert_eq!(t.to_f32_vec(), vec![-2.0, 3.0]);
    }
}
