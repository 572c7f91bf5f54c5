//! safetensors files (weights only), through the `safetensors` crate. A file is a flat
//! `name -> tensor` map: nested dicts are flattened with `.` on save; tied tensors are written
//! once per name (the format has no sharing). [`RowReader`] reads runs of rows where they lie.
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

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
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, t)| TensorSpec { name: name.clone(), dtype: t.dtype, shape: t.shape.clone() })
        .collect();
    save_streaming(path, &specs, |i, w| w.write_all(&tensors[i].1.contiguous_bytes()))
}

/// A tensor of a file [`save_streaming`] writes.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: ElemType,
    pub shape: Vec<usize>,
}

/// Writes a safetensors file one tensor at a time, atomically (a crash leaves the old file or
/// none): the header from each tensor's name, dtype and shape, then `write(i, out)` for each
/// tensor `i` of `tensors` in the file's order, which must write exactly that tensor's bytes
/// (row-major, little-endian) — for a writer that holds one tensor at a time, such as a sharded
/// model gathered parameter by parameter. The layout is safetensors' own writer's (descending
/// dtype alignment, then name; the header the crate's `Metadata`, padded to 8 bytes), written
/// straight into the atomic temp file.
pub fn save_streaming(
    path: &Path,
    tensors: &[TensorSpec],
    mut write: impl FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&l, &r| {
        let (l, r) = (&tensors[l], &tensors[r]);
        to_st(r.dtype).cmp(&to_st(l.dtype)).then(l.name.cmp(&r.name))
    });
    let size = |t: &TensorSpec| t.shape.iter().product::<usize>() * t.dtype.size();
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0;
    for &i in &order {
        let t = &tensors[i];
        let n = size(t);
        let info = safetensors::tensor::TensorInfo {
            dtype: to_st(t.dtype),
            shape: t.shape.clone(),
            data_offsets: (offset, offset + n),
        };
        infos.push((t.name.clone(), info));
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
        let mut w = Counted { inner: std::io::BufWriter::with_capacity(1 << 20, f), bytes: 0 };
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for &i in &order {
            let before = w.bytes;
            write(i, &mut w)?;
            let (wrote, want) = (w.bytes - before, size(&tensors[i]));
            if wrote != want {
                let name = &tensors[i].name;
                let why = format!("tensor `{name}`: {wrote} bytes written for {want}");
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
            }
        }
        w.flush()
    })
}

/// A writer counting the bytes through it.
struct Counted<W> {
    inner: W,
    bytes: usize,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
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

/// The most header bytes a file may announce (the safetensors crate's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// One file of a [`RowReader`]: its header, and where its data starts.
struct RowFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    meta: safetensors::tensor::Metadata,
}

impl RowFile {
    fn open(path: &Path) -> Result<RowFile> {
        let file = File::open(path).map_err(|e| CkptError::io(path, e))?;
        let len = file.metadata().map_err(|e| CkptError::io(path, e))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(|e| CkptError::io(path, e))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n + 8 > len {
            let why = format!("a header of {n} bytes in a file of {len}: not safetensors");
            return Err(CkptError::format(path, why));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(|e| CkptError::io(path, e))?;
        let meta: safetensors::tensor::Metadata = serde_json::from_slice(&header)
            .map_err(|e| CkptError::format(path, format!("an unreadable header: {e}")))?;
        let data_start = 8 + n;
        for (name, info) in meta.tensors() {
            let (start, end) = info.data_offsets;
            let elems = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let bytes = elems.and_then(|e| e.checked_mul(info.dtype.bitsize() / 8));
            if bytes != Some(end.saturating_sub(start)) || data_start + end as u64 > len {
                let why = format!(
                    "tensor `{name}` ({:?} {:?}) says bytes {start}..{end}, which its shape or \
                     the file's {len} bytes do not hold (truncated?)",
                    info.dtype, info.shape
                );
                return Err(CkptError::format(path, why));
            }
        }
        Ok(RowFile { path: path.to_path_buf(), file, data_start, meta })
    }
}

/// Rows of the tensors of safetensors files, read where they lie: each file's header is
/// parsed (its announced length bounded, every tensor's bytes checked against its shape and
/// the file's length) and a run of rows is one positioned read — no file is mapped or read
/// whole. For a rank that needs only its rows of a model too large for it (tandem-fsdp's
/// `Fsdp::load_safetensors`). Written here because the `safetensors` crate parses only a
/// buffer holding the whole file. Several files read as one state dict (a model saved in
/// shards); a key in two of them is an error.
pub struct RowReader {
    files: Vec<RowFile>,
}

impl RowReader {
    pub fn open(paths: &[PathBuf]) -> Result<RowReader> {
        let files = paths.iter().map(|p| RowFile::open(p)).collect::<Result<Vec<_>>>()?;
        for (i, a) in files.iter().enumerate() {
            for b in &files[i + 1..] {
                if let Some(key) = a.meta.tensors().keys().find(|k| b.meta.info(k).is_some()) {
                    let why = format!("`{key}` is also in {}", a.path.display());
                    return Err(CkptError::format(&b.path, why));
                }
            }
        }
        Ok(RowReader { files })
    }

    /// Every key with its file, sorted by key.
    pub fn keys(&self) -> Vec<(String, &Path)> {
        let mut keys: Vec<(String, &Path)> = self
            .files
            .iter()
            .flat_map(|f| f.meta.tensors().into_keys().map(move |k| (k, f.path.as_path())))
            .collect();
        keys.sort();
        keys
    }

    fn find(&self, key: &str) -> Option<(&RowFile, &safetensors::tensor::TensorInfo)> {
        self.files.iter().find_map(|f| f.meta.info(key).map(|info| (f, info)))
    }

    /// The shape `key` is stored with.
    pub fn shape(&self, key: &str) -> Option<Vec<usize>> {
        self.find(key).map(|(_, info)| info.shape.clone())
    }

    /// Rows `rows` of tensor `key` (a scalar is one row) as a contiguous tensor of its stored
    /// dtype, `rows.len()` rows.
    pub fn read_rows(&self, key: &str, rows: Range<usize>) -> Result<TensorData> {
        let Some((f, info)) = self.find(key) else {
            let path = self.files.first().map(|f| f.path.clone()).unwrap_or_default();
            return Err(CkptError::format(path, format!("no tensor `{key}`")));
        };
        let dtype = from_st(info.dtype).ok_or_else(|| {
            CkptError::format(&f.path, format!("`{key}` has dtype {:?}", info.dtype))
        })?;
        let row_elems: usize = info.shape.iter().skip(1).product();
        let row_bytes = row_elems * dtype.size();
        let total = info.shape.first().copied().unwrap_or(1);
        if rows.start > rows.end || rows.end > total {
            let why = format!("`{key}` has {total} rows, not {rows:?}");
            return Err(CkptError::format(&f.path, why));
        }
        let mut bytes = vec![0u8; rows.len() * row_bytes];
        let at = f.data_start + (info.data_offsets.0 + rows.start * row_bytes) as u64;
        f.file.read_exact_at(&mut bytes, at).map_err(|e| CkptError::io(&f.path, e))?;
        let mut shape = info.shape.clone();
        match shape.first_mut() {
            Some(first) => *first = rows.len(),
            None => shape.push(rows.len()),
        }
        Ok(TensorData::from_bytes(dtype, &shape, bytes))
    }
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

    /// Runs of rows read in place are those rows of the whole tensor, in the stored dtype, a
    /// scalar as one row; a header that promises more than the file holds is refused naming
    /// the file and tensor; a header length beyond the bound is not read.
    #[test]
    fn row_reads_are_the_rows_of_the_whole_tensor() {
        let w: Vec<f32> = (0..20).map(|i| i as f32 * 0.5).collect();
        let value = Value::dict_from([
            ("w", Value::Tensor(TensorData::from_f32(&[5, 4], &w))),
            ("n", Value::Tensor(TensorData::from_i64(&[], &[7]))),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        save(&path, &value).unwrap();
        let reader = RowReader::open(std::slice::from_ref(&path)).unwrap();
        let keys: Vec<String> = reader.keys().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["n", "w"]);
        for rows in [0..5, 1..3, 4..5, 2..2] {
            let t = reader.read_rows("w", rows.clone()).unwrap();
            assert_eq!(t.shape, [rows.len(), 4]);
            assert_eq!(t.to_f32_vec(), w[rows.start * 4..rows.end * 4]);
        }
        let n = reader.read_rows("n", 0..1).unwrap();
        assert_eq!((n.dtype, n.to_i64_vec()), (ElemType::I64, vec![7]));
        let err = reader.read_rows("w", 3..6).unwrap_err().to_string();
        assert!(err.contains("m.safetensors") && err.contains("5 rows"), "{err}");

        let bytes = std::fs::read(&path).unwrap();
        let cut = dir.path().join("cut.safetensors");
        std::fs::write(&cut, &bytes[..bytes.len() - 4]).unwrap();
        let err = RowReader::open(&[cut]).err().unwrap().to_string();
        assert!(err.contains("cut.safetensors") && err.contains("truncated"), "{err}");
        let huge = dir.path().join("huge.safetensors");
        std::fs::write(&huge, u64::MAX.to_le_bytes()).unwrap();
        let err = RowReader::open(&[huge]).err().unwrap().to_string();
        assert!(err.contains("huge.safetensors") && err.contains("not safetensors"), "{err}");
        let twice = RowReader::open(&[path.clone(), path]).err().unwrap().to_string();
        assert!(twice.contains("is also in"), "{twice}");
    }
}
