//! Trained weights into a sharded model, each rank reading only its rows of each tensor from
//! safetensors files: FSDP2's `set_model_state_dict` with a full state dict, without any rank
//! holding the whole model (PyTorch's answer, `broadcast_from_rank0`, has rank 0 read it all).
//!
//! A file's header is parsed (its announced length bounded, as the safetensors crate bounds
//! it, and every tensor's bytes checked against its shape and the file's length), then each
//! parameter's rows are read at their offset with positioned reads: no file is mapped or read
//! whole. Written here because the safetensors crate parses only a buffer holding the whole
//! file.
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use crate::error::{tensor, FsdpError, Result};
use crate::fsdp::Fsdp;
use crate::meta::is_buffer;

/// The most header bytes a file may announce (the safetensors crate's limit).
const MAX_HEADER: u64 = 100_000_000;

fn bad(file: &Path, why: impl Into<String>) -> FsdpError {
    FsdpError::Weights { file: file.to_path_buf(), why: why.into() }
}

/// The candle dtype of a stored tensor, for the dtypes weights come in.
fn dtype_of(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U32 => DType::U32,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Prefixes a wrapped model's keys carry (DDP's `module.`, `torch.compile`'s `_orig_mod.`),
/// read as the plain model's keys.
const WRAPPER_PREFIXES: [&str; 2] = ["module.", "_orig_mod."];

/// A key without the wrappers' prefixes.
fn plain_key(key: &str) -> &str {
    let mut key = key;
    while let Some(rest) = WRAPPER_PREFIXES.iter().find_map(|p| key.strip_prefix(p)) {
        key = rest;
    }
    key
}

/// Names, a few of them.
fn some(names: &[String]) -> String {
    let shown: Vec<String> = names.iter().take(4).map(|n| format!("`{n}`")).collect();
    let more = names.len().saturating_sub(shown.len());
    let more = if more > 0 { format!(" and {more} more") } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

impl Fsdp {
    /// Loads trained weights into the shards, each rank reading only its rows of each tensor
    /// from `files` (a model saved whole as safetensors, in one file or several): FSDP2's
    /// `set_model_state_dict` with a full state dict, for a model built with
    /// [`Fsdp::from_meta`] too large for one rank. Keys may carry DDP's `module.` or
    /// `torch.compile`'s `_orig_mod.` prefix. Strict, as PyTorch's default: a parameter the
    /// files lack, a tensor of another shape, or a key that is neither a parameter nor a buffer
    /// is an error naming them, and then no shard has changed. Returns the buffers the files
    /// hold (BatchNorm's statistics: FSDP keeps none, they are the caller's), whole, in their
    /// stored dtype. Not a collective: every rank reads the files itself.
    pub fn load_safetensors(&self, files: &[impl AsRef<Path>]) -> Result<Vec<(String, Tensor)>> {
        let paths: Vec<PathBuf> = files.iter().map(|f| f.as_ref().to_path_buf()).collect();
        let weights = Weights::open(&paths)?;
        let first = paths[0].as_path();
        let engine = self.engine();
        let keys = weights.keys();
        let stored = |name: &str| keys.iter().find(|(k, _)| plain_key(k) == name);
        let mut missing = Vec::new();
        for p in &engine.params {
            match stored(&p.name) {
                None => missing.push(p.name.clone()),
                Some((key, file)) => {
                    let shape = weights.shape(key).unwrap_or_default();
                    if shape != p.layout.dims {
                        let why = format!(
                            "`{key}` has shape {shape:?}; the model's `{}` is {:?}",
                            p.name, p.layout.dims
                        );
                        return Err(bad(file, why));
                    }
                }
            }
        }
        if !missing.is_empty() {
            let why = format!("no tensor for the parameter(s) {} in these files", some(&missing));
            return Err(bad(first, why));
        }
        let (mut buffers, mut unknown) = (Vec::new(), Vec::new());
        for (key, _) in &keys {
            let name = plain_key(key);
            if engine.params.iter().any(|p| p.name == name) {
                continue;
            }
            match is_buffer(name) {
                true => buffers.push((key.clone(), name.to_string())),
                false => unknown.push(key.clone()),
            }
        }
        if !unknown.is_empty() {
            let why = format!("{} in no parameter or buffer of the model", some(&unknown));
            return Err(bad(first, why));
        }
        // Every shard read before any is set: a failed read leaves the model as it was.
        let mut rows = Vec::with_capacity(engine.params.len());
        for p in &engine.params {
            let (key, _) = stored(&p.name).expect("checked above");
            let t = weights.read_rows(key, p.layout.my_rows())?;
            let t = t
                .to_dtype(DType::F32)
                .and_then(|t| t.reshape(p.layout.shard_dims()))
                .map_err(tensor(format!("the rows of `{key}`")))?;
            rows.push(t);
        }
        for (p, t) in engine.params.iter().zip(rows) {
            p.shard.set(&t).map_err(tensor(format!("setting the shard of `{}`", p.name)))?;
        }
        let mut out = Vec::with_capacity(buffers.len());
        for (key, name) in buffers {
            let shape = weights.shape(&key).unwrap_or_default();
            let whole = weights.read_rows(&key, 0..shape.first().copied().unwrap_or(1))?;
            out.push((name, whole.reshape(shape).map_err(tensor(format!("`{key}`")))?));
        }
        Ok(out)
    }
}

/// One safetensors file: its header, and where its data starts.
struct WeightsFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    meta: Metadata,
}

impl WeightsFile {
    fn open(path: &Path) -> Result<WeightsFile> {
        let file = File::open(path).map_err(|e| bad(path, format!("cannot open: {e}")))?;
        let len = file.metadata().map_err(|e| bad(path, format!("cannot stat: {e}")))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(|e| bad(path, format!("no header: {e}")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n + 8 > len {
            return Err(bad(
                path,
                format!("a header of {n} bytes in a file of {len}: not safetensors"),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(|e| bad(path, format!("header: {e}")))?;
        let meta: Metadata = serde_json::from_slice(&header)
            .map_err(|e| bad(path, format!("an unreadable header: {e}")))?;
        let data_start = 8 + n;
        for (name, info) in meta.tensors() {
            let (start, end) = info.data_offsets;
            let elems = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let bytes = elems.and_then(|e| e.checked_mul(info.dtype.bitsize() / 8));
            if bytes != Some(end.saturating_sub(start)) || data_start + end as u64 > len {
                return Err(bad(
                    path,
                    format!(
                        "tensor `{name}` ({:?} {:?}) says bytes {start}..{end}, which its shape \
                         or the file's {len} bytes do not hold (truncated?)",
                        info.dtype, info.shape
                    ),
                ));
            }
        }
        Ok(WeightsFile { path: path.to_path_buf(), file, data_start, meta })
    }
}

/// A set of safetensors files read as one state dict (a model saved in several files).
pub(crate) struct Weights {
    files: Vec<WeightsFile>,
}

impl Weights {
    pub fn open(paths: &[PathBuf]) -> Result<Weights> {
        if paths.is_empty() {
            return Err(FsdpError::InvalidOption {
                what: "load_safetensors",
                why: "no file given".into(),
            });
        }
        let files = paths.iter().map(|p| WeightsFile::open(p)).collect::<Result<Vec<_>>>()?;
        for (i, a) in files.iter().enumerate() {
            for b in &files[i + 1..] {
                if let Some(key) = a.meta.tensors().keys().find(|k| b.meta.info(k).is_some()) {
                    return Err(bad(&b.path, format!("`{key}` is also in {}", a.path.display())));
                }
            }
        }
        Ok(Weights { files })
    }

    /// Every key, with its file.
    pub fn keys(&self) -> Vec<(String, &Path)> {
        let mut keys: Vec<(String, &Path)> = self
            .files
            .iter()
            .flat_map(|f| f.meta.tensors().into_keys().map(move |k| (k, f.path.as_path())))
            .collect();
        keys.sort();
        keys
    }

    /// The file holding `name`, and the tensor's header entry.
    fn find(&self, name: &str) -> Option<(&WeightsFile, &TensorInfo)> {
        self.files.iter().find_map(|f| f.meta.info(name).map(|info| (f, info)))
    }

    /// The shape `name` is stored with, if any file holds it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.find(name).map(|(_, info)| info.shape.clone())
    }

    /// Rows `rows` of tensor `name` (a scalar as one row), flat, in its stored dtype.
    pub fn read_rows(&self, name: &str, rows: Range<usize>) -> Result<Tensor> {
        let (f, info) = self.find(name).ok_or_else(|| FsdpError::Unsupported {
            param: name.to_string(),
            why: "in no weights file".into(),
        })?;
        let dtype = dtype_of(info.dtype)
            .ok_or_else(|| bad(&f.path, format!("`{name}` is stored as {:?}", info.dtype)))?;
        let row_elems: usize = info.shape.iter().skip(1).product();
        let row_bytes = row_elems * dtype.size_in_bytes();
        let total = info.shape.first().copied().unwrap_or(1);
        if rows.end > total {
            return Err(bad(&f.path, format!("`{name}` has {total} rows, not {}", rows.end)));
        }
        let mut bytes = vec![0u8; rows.len() * row_bytes];
        let at = f.data_start + (info.data_offsets.0 + rows.start * row_bytes) as u64;
        f.file
            .read_exact_at(&mut bytes, at)
            .map_err(|e| bad(&f.path, format!("reading `{name}`: {e}")))?;
        Tensor::from_raw_buffer(&bytes, dtype, &[rows.len() * row_elems], &Device::Cpu)
            .map_err(|e| bad(&f.path, format!("`{name}`: {e}")))
    }
}
