//! A DCP `.metadata` file as data: read through the allowlisted unpickler (DCP's dataclasses
//! read as plain values, never imported or run) into typed metadata, and written back in the
//! layout `torch.distributed.checkpoint` pickles (protocol 2, the same classes), which
//! `dcp.load`'s `pickle.load` reads.
use std::path::Path;

use crate::error::{CkptError, Result};
use crate::pickle::op;
use crate::pickle::read::unpickle_with;
use crate::pickle::write::Pickler;
use crate::value::{ElemType, Value};

const META: &str = "torch.distributed.checkpoint.metadata";
const FILESYSTEM: &str = "torch.distributed.checkpoint.filesystem";

/// The classes and functions a `.metadata` pickle may name, read as data.
const CLASSES: &[(&str, &str)] = &[
    (META, "Metadata"),
    (META, "TensorStorageMetadata"),
    (META, "BytesStorageMetadata"),
    (META, "TensorProperties"),
    (META, "ChunkStorageMetadata"),
    (META, "MetadataIndex"),
    (META, "StorageMeta"),
    (META, "_MEM_FORMAT_ENCODING"),
    (FILESYSTEM, "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
];

/// Largest `.metadata` read (a million tensors' entries are ~300 MB).
pub(crate) const MAX_METADATA_BYTES: u64 = 1 << 30;

/// One piece of a tensor: where it starts in the whole tensor, and its extent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub offsets: Vec<usize>,
    pub sizes: Vec<usize>,
}

/// What one flattened key holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// A tensor, whole or in chunks (sharded by FSDP or DTensor).
    Tensor { dtype: ElemType, size: Vec<usize>, chunks: Vec<Chunk> },
    /// Any other object (torch.save'd bytes: numbers, strings, lists).
    Bytes,
}

/// A part of a key's path in the original nested state dict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathPart {
    Key(String),
    Index(i64),
}

/// Where one chunk's (or object's) `torch.save` bytes are stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// A file of the checkpoint's directory.
    pub file: String,
    pub offset: u64,
    pub length: u64,
}

/// One stored record: its key (`fqn`, the chunk's offsets, `None` for an object) and place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub fqn: String,
    pub offsets: Option<Vec<usize>>,
    pub stored: Stored,
}

/// A `.metadata` file's content.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Metadata {
    /// Every flattened key, in the file's order.
    pub items: Vec<(String, Item)>,
    /// Each key's path in the nested state dict (`model.0.weight` → `("model", "0.weight")`).
    pub paths: Vec<(String, Vec<PathPart>)>,
    pub records: Vec<Record>,
    pub version: Option<String>,
}

impl Metadata {
    pub fn item(&self, fqn: &str) -> Option<&Item> {
        self.items.iter().find(|(k, _)| k == fqn).map(|(_, v)| v)
    }

    /// The record of `fqn`'s chunk at `offsets` (or its object, for `None`).
    pub fn record(&self, fqn: &str, offsets: Option<&[usize]>) -> Option<&Stored> {
        self.records
            .iter()
            .find(|r| r.fqn == fqn && r.offsets.as_deref() == offsets)
            .map(|r| &r.stored)
    }
}

/// An instance `class` of the data-read pickle: its state.
fn state_of<'a>(v: &'a Value, class: &str, what: &str) -> std::result::Result<&'a Value, String> {
    let name = v.get("__class__").and_then(Value::as_str);
    match name {
        Some(n) if n.ends_with(&format!(".{class}")) => {
            v.get("__state__").ok_or_else(|| format!("{what}: a {class} without state"))
        }
        Some(n) => Err(format!("{what}: expected a {class}, found a {n}")),
        None => Err(format!("{what}: expected a {class}")),
    }
}

fn field<'a>(state: &'a Value, name: &str, what: &str) -> std::result::Result<&'a Value, String> {
    state.get(name).ok_or_else(|| format!("{what}: no `{name}`"))
}

/// A `torch.Size` (a tuple of non-negative ints) as usizes.
fn dims(v: &Value, what: &str) -> std::result::Result<Vec<usize>, String> {
    let items = match v {
        Value::Tuple(t) | Value::List(t) => t,
        _ => return Err(format!("{what}: not a size")),
    };
    items
        .iter()
        .map(|d| {
            d.as_int()
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| format!("{what}: a size holds {d:?}"))
        })
        .collect()
}

fn dtype(v: &Value, what: &str) -> std::result::Result<ElemType, String> {
    let name = v.as_str().ok_or_else(|| format!("{what}: dtype is not a torch dtype"))?;
    let short = name.strip_prefix("torch.").unwrap_or(name);
    ElemType::ALL
        .iter()
        .copied()
        .find(|d| d.torch_name() == short)
        .ok_or_else(|| format!("{what}: dtype {name} is not supported"))
}

fn item(fqn: &str, v: &Value) -> std::result::Result<Item, String> {
    let what = format!("`{fqn}`");
    if state_of(v, "BytesStorageMetadata", &what).is_ok() {
        return Ok(Item::Bytes);
    }
    let st = state_of(v, "TensorStorageMetadata", &what)?;
    let props = state_of(field(st, "properties", &what)?, "TensorProperties", &what)?;
    // TensorProperties pickles as a tuple (dtype, layout, requires_grad, memory format, pin
    // memory[, strides]); older writers as a dict.
    let dt = match props {
        Value::Tuple(t) => t.first().ok_or_else(|| format!("{what}: empty tensor properties"))?,
        other => field(other, "dtype", &what)?,
    };
    let size = dims(field(st, "size", &what)?, &what)?;
    let chunks = field(st, "chunks", &what)?
        .as_list()
        .ok_or_else(|| format!("{what}: chunks is not a list"))?
        .iter()
        .map(|c| {
            let cs = state_of(c, "ChunkStorageMetadata", &what)?;
            let chunk = Chunk {
                offsets: dims(field(cs, "offsets", &what)?, &what)?,
                sizes: dims(field(cs, "sizes", &what)?, &what)?,
            };
            check_chunk(&chunk, &size).map_err(|e| format!("{what}: {e}"))?;
            Ok(chunk)
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    Ok(Item::Tensor { dtype: dtype(dt, &what)?, size, chunks })
}

/// A chunk lies inside its tensor (no overflow on hostile sizes).
fn check_chunk(c: &Chunk, size: &[usize]) -> std::result::Result<(), String> {
    if c.offsets.len() != size.len() || c.sizes.len() != size.len() {
        return Err(format!("chunk {:?}+{:?} for a tensor of {size:?}", c.offsets, c.sizes));
    }
    for ((&o, &s), &d) in c.offsets.iter().zip(&c.sizes).zip(size) {
        if o.checked_add(s).is_none_or(|end| end > d) {
            return Err(format!("chunk {:?}+{:?} outside the tensor {size:?}", c.offsets, c.sizes));
        }
    }
    Ok(())
}

fn record(key: &Value, value: &Value) -> std::result::Result<Record, String> {
    let k = state_of(key, "MetadataIndex", "a storage key")?;
    let fqn = field(k, "fqn", "a storage key")?
        .as_str()
        .ok_or("a storage key's fqn is not a string")?
        .to_string();
    let what = format!("`{fqn}`'s storage");
    let offsets = match k.get("offset") {
        None | Some(Value::None) => None,
        Some(v) => Some(dims(v, &what)?),
    };
    let s = state_of(value, "_StorageInfo", &what)?;
    let file = field(s, "relative_path", &what)?.as_str().ok_or(format!("{what}: no file name"))?;
    // A name inside the checkpoint's directory, nothing else.
    if file.is_empty() || file.contains('/') || file.contains('\\') || file == "." || file == ".." {
        return Err(format!("{what}: file `{file}` is not a name inside the checkpoint"));
    }
    let number = |name: &str| -> std::result::Result<u64, String> {
        field(s, name, &what)?
            .as_int()
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| format!("{what}: `{name}` is not a non-negative integer"))
    };
    if let Some(t) = s.get("transform_descriptors") {
        if !matches!(t, Value::None) && t.as_list().is_none_or(|l| !l.is_empty()) {
            return Err(format!(
                "{what}: stored through transforms {t:?} (compression?), which tandem does not read"
            ));
        }
    }
    let stored =
        Stored { file: file.to_string(), offset: number("offset")?, length: number("length")? };
    Ok(Record { fqn, offsets, stored })
}

fn key_path(fqn: &str, v: &Value) -> std::result::Result<Vec<PathPart>, String> {
    let parts = match v {
        Value::Tuple(t) | Value::List(t) => t,
        _ => return Err(format!("`{fqn}`: its path is not a tuple")),
    };
    parts
        .iter()
        .map(|p| match p {
            Value::Str(s) => Ok(PathPart::Key(s.clone())),
            Value::Int(i) => Ok(PathPart::Index(*i)),
            other => Err(format!("`{fqn}`: a path part {other:?}")),
        })
        .collect()
}

/// Parses a `.metadata` file's bytes; `path` names it in errors.
pub(crate) fn parse(path: &Path, bytes: &[u8]) -> Result<Metadata> {
    let bad = |msg: String| CkptError::format(path, msg);
    let up = unpickle_with(bytes, CLASSES).map_err(|e| match e {
        crate::pickle::read::PickleError::Forbidden(global) => {
            CkptError::ForbiddenGlobal { path: path.into(), global }
        }
        crate::pickle::read::PickleError::Unsupported(g) => bad(format!("uses `{g}`")),
        crate::pickle::read::PickleError::Msg(m) => bad(m),
    })?;
    let value =
        up.to_value(&mut |s| Err(format!("a storage ({}) in DCP metadata", s.key))).map_err(bad)?;
    let st = state_of(&value, "Metadata", "the file").map_err(bad)?;
    let dict = |name: &str| -> Result<&[(Value, Value)]> {
        match st.get(name) {
            None | Some(Value::None) => Ok(&[]),
            Some(v) => v.as_dict().ok_or_else(|| bad(format!("`{name}` is not a dict"))),
        }
    };
    let key = |k: &Value| -> Result<String> {
        k.as_str().map(str::to_string).ok_or_else(|| bad(format!("a key {k:?} is not a string")))
    };
    let mut md = Metadata::default();
    for (k, v) in dict("state_dict_metadata")? {
        let fqn = key(k)?;
        md.items.push((fqn.clone(), item(&fqn, v).map_err(bad)?));
    }
    for (k, v) in dict("planner_data")? {
        let fqn = key(k)?;
        md.paths.push((fqn.clone(), key_path(&fqn, v).map_err(bad)?));
    }
    for (k, v) in dict("storage_data")? {
        md.records.push(record(k, v).map_err(bad)?);
    }
    md.version = st.get("version").and_then(Value::as_str).map(str::to_string);
    Ok(md)
}

/// Pickles `md` as `torch.distributed.checkpoint` does (protocol 2; its classes by name).
pub(crate) fn to_pickle(md: &Metadata) -> Vec<u8> {
    let mut p = Pickler::new();
    object_start(&mut p, META, "Metadata");
    p.out.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
    p.str("state_dict_metadata");
    dict(&mut p, &md.items, |p, (fqn, item)| {
        p.str(fqn);
        match item {
            Item::Bytes => {
                object_start(p, META, "BytesStorageMetadata");
                p.out.extend_from_slice(&[op::EMPTY_DICT, op::BUILD]);
            }
            Item::Tensor { dtype, size, chunks } => {
                object_start(p, META, "TensorStorageMetadata");
                p.out.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
                p.str("properties");
                properties(p, *dtype);
                p.str("size");
                torch_size(p, size);
                p.str("chunks");
                p.out.extend_from_slice(&[op::EMPTY_LIST, op::MARK]);
                for c in chunks {
                    object_start(p, META, "ChunkStorageMetadata");
                    p.out.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
                    p.str("offsets");
                    torch_size(p, &c.offsets);
                    p.str("sizes");
                    torch_size(p, &c.sizes);
                    p.out.extend_from_slice(&[op::SETITEMS, op::BUILD]);
                }
                p.out.extend_from_slice(&[op::APPENDS, op::SETITEMS, op::BUILD]);
            }
        }
    });
    p.str("planner_data");
    dict(&mut p, &md.paths, |p, (fqn, parts)| {
        p.str(fqn);
        p.out.push(op::MARK);
        for part in parts {
            match part {
                PathPart::Key(k) => p.str(k),
                PathPart::Index(i) => p.int(*i),
            }
        }
        p.out.push(op::TUPLE);
    });
    p.str("storage_data");
    dict(&mut p, &md.records, |p, r| {
        object_start(p, META, "MetadataIndex");
        p.out.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
        p.str("fqn");
        p.str(&r.fqn);
        p.str("offset");
        match &r.offsets {
            Some(o) => torch_size(p, o),
            None => p.out.push(op::NONE),
        }
        p.str("index");
        match &r.offsets {
            Some(_) => p.int(0),
            None => p.out.push(op::NONE),
        }
        p.out.extend_from_slice(&[op::SETITEMS, op::BUILD]);
        object_start(p, FILESYSTEM, "_StorageInfo");
        p.out.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
        p.str("relative_path");
        p.str(&r.stored.file);
        p.str("offset");
        p.int(r.stored.offset as i64);
        p.str("length");
        p.int(r.stored.length as i64);
        p.str("transform_descriptors");
        p.out.push(op::NONE);
        p.out.extend_from_slice(&[op::SETITEMS, op::BUILD]);
    });
    // `dcp.load` fills in a StorageMeta when the file has none.
    p.str("storage_meta");
    p.out.push(op::NONE);
    p.str("version");
    p.str(md.version.as_deref().unwrap_or("1.0.0"));
    p.out.extend_from_slice(&[op::SETITEMS, op::BUILD]);
    p.finish().0
}

/// `cls.__new__(cls)` (the object's state follows, then BUILD).
fn object_start(p: &mut Pickler, module: &str, class: &str) {
    p.global(module, class);
    p.out.extend_from_slice(&[op::EMPTY_TUPLE, op::NEWOBJ]);
}

/// A dict of `items`, each written (key then value) by `entry`.
fn dict<T>(p: &mut Pickler, items: &[T], mut entry: impl FnMut(&mut Pickler, &T)) {
    p.out.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
    for it in items {
        entry(p, it);
    }
    p.out.push(op::SETITEMS);
}

/// `torch.Size((dims...))`.
fn torch_size(p: &mut Pickler, dims: &[usize]) {
    p.global("torch", "Size");
    p.out.extend_from_slice(&[op::MARK, op::MARK]);
    for &d in dims {
        p.int(d as i64);
    }
    p.out.extend_from_slice(&[op::TUPLE, op::TUPLE, op::REDUCE]);
}

/// TensorProperties' pickled state: (dtype, torch.strided, requires_grad False, contiguous
/// format, pin_memory False).
fn properties(p: &mut Pickler, dtype: ElemType) {
    object_start(p, META, "TensorProperties");
    p.out.push(op::MARK);
    p.global("torch", dtype.torch_name());
    p.global("torch.serialization", "_get_layout");
    p.out.push(op::MARK);
    p.str("torch.strided");
    p.out.extend_from_slice(&[op::TUPLE, op::REDUCE, op::NEWFALSE]);
    p.global(META, "_MEM_FORMAT_ENCODING");
    p.out.push(op::MARK);
    p.int(0);
    p.out.extend_from_slice(&[op::TUPLE, op::REDUCE, op::NEWFALSE, op::TUPLE, op::BUILD]);
}
