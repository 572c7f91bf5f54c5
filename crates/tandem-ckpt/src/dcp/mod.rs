//! PyTorch's distributed checkpoints (`torch.distributed.checkpoint`, DCP), both ways.
//!
//! A `dcp.save` directory holds `.metadata` (a pickle: every flattened key's type, shape and
//! chunks, each key's path in the nested state dict, and where each chunk's bytes are) and
//! `__<rank>_<n>.distcp` files in which every chunk (or non-tensor object) is a complete
//! `torch.save` image at the byte range the metadata names. [`load`] reads such a directory
//! into the nested value `dcp.save` was given, each tensor assembled from its chunks (FSDP and
//! DTensor shards included); [`load_rows`] reads part of one tensor, only the chunks it
//! overlaps (resharding over any world size); [`save`] writes a value as a directory that
//! `dcp.load` reads.
//!
//! The metadata is read as data by the allowlisted unpickler (DCP's classes by name, nothing
//! imported or run), every byte range is checked against its file before it is read, and
//! chunks are checked against their tensor's shape, so a hostile directory is an error naming
//! the file, never a panic or an allocation it asked for.
mod metadata;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::Path;

pub use metadata::{Chunk, Item, Metadata, PathPart, Record, Stored};

use crate::error::{CkptError, Result};
use crate::value::{TensorData, Value};

/// The metadata file of a DCP directory.
pub const METADATA_FILE: &str = ".metadata";
/// The one data file [`save`] writes (rank 0's first file, as a single-process `dcp.save`).
pub const DATA_FILE: &str = "__0_0.distcp";

/// Whether `path` is a DCP directory (it holds a `.metadata` file).
pub fn is_dcp_dir(path: &Path) -> bool {
    path.is_dir() && path.join(METADATA_FILE).is_file()
}

/// Reads `dir/.metadata`.
pub fn read_metadata(dir: &Path) -> Result<Metadata> {
    let path = dir.join(METADATA_FILE);
    let len = std::fs::metadata(&path).map_err(|e| CkptError::io(&path, e))?.len();
    if len > metadata::MAX_METADATA_BYTES {
        return Err(CkptError::format(
            &path,
            format!("{len} bytes of metadata is beyond the limit"),
        ));
    }
    let bytes = std::fs::read(&path).map_err(|e| CkptError::io(&path, e))?;
    metadata::parse(&path, &bytes)
}

/// How a DCP directory's tensors are stored: each tensor's key, its number of chunks and the
/// files holding them (sorted), in the metadata's order.
pub fn chunking(dir: &Path) -> Result<Vec<(String, usize, Vec<String>)>> {
    let md = read_metadata(dir)?;
    let files_of = |fqn: &str| {
        let mut files: Vec<String> =
            md.records.iter().filter(|r| r.fqn == fqn).map(|r| r.stored.file.clone()).collect();
        files.sort();
        files.dedup();
        files
    };
    Ok(md
        .items
        .iter()
        .filter_map(|(fqn, item)| match item {
            Item::Tensor { chunks, .. } => Some((fqn.clone(), chunks.len(), files_of(fqn))),
            Item::Bytes => None,
        })
        .collect())
}

/// The value stored at `stored` (a complete `torch.save` image), its range checked against
/// the file first.
fn read_stored(dir: &Path, stored: &Stored) -> Result<Value> {
    let path = dir.join(&stored.file);
    let mut f = File::open(&path).map_err(|e| CkptError::io(&path, e))?;
    let len = f.metadata().map_err(|e| CkptError::io(&path, e))?.len();
    let end = stored.offset.checked_add(stored.length);
    if end.is_none_or(|end| end > len) {
        return Err(CkptError::format(
            &path,
            format!(
                "the metadata names bytes {}..+{} of a {len}-byte file",
                stored.offset, stored.length
            ),
        ));
    }
    f.seek(SeekFrom::Start(stored.offset)).map_err(|e| CkptError::io(&path, e))?;
    let mut bytes = vec![0u8; stored.length as usize];
    f.read_exact(&mut bytes).map_err(|e| CkptError::io(&path, e))?;
    let name = format!("{}@{}", path.display(), stored.offset);
    crate::pt::load_from_bytes(&name, bytes, true)
}

/// The tensor one chunk's record holds, checked against the chunk's dtype and extent.
fn read_chunk(
    dir: &Path,
    md: &Metadata,
    fqn: &str,
    dtype: crate::ElemType,
    c: &Chunk,
) -> Result<TensorData> {
    let meta = dir.join(METADATA_FILE);
    let Some(stored) = md.record(fqn, Some(&c.offsets)) else {
        return Err(CkptError::format(
            meta,
            format!("`{fqn}`: no record of its chunk at {:?}", c.offsets),
        ));
    };
    let data_file = dir.join(&stored.file);
    match read_stored(dir, stored)? {
        Value::Tensor(t) if t.dtype == dtype && t.shape == c.sizes => Ok(t),
        Value::Tensor(t) => Err(CkptError::format(
            data_file,
            format!(
                "`{fqn}`: the chunk at {:?} is {} {:?}, the metadata says {dtype} {:?}",
                c.offsets, t.dtype, t.shape, c.sizes
            ),
        )),
        _ => Err(CkptError::format(
            data_file,
            format!("`{fqn}`: the chunk at {:?} is not a tensor", c.offsets),
        )),
    }
}

/// Copies `src` (a contiguous `sizes` block) into `dst` (a contiguous tensor of `full`) at
/// `offsets`, whole last-dimension runs at a time; `es` bytes per element.
fn place(
    dst: &mut [u8],
    full: &[usize],
    src: &[u8],
    offsets: &[usize],
    sizes: &[usize],
    es: usize,
) {
    let n = full.len();
    if n == 0 {
        dst.copy_from_slice(&src[..dst.len()]);
        return;
    }
    let mut stride = vec![1usize; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1] * full[d + 1];
    }
    let run = sizes[n - 1] * es;
    let outer: usize = sizes[..n - 1].iter().product();
    let mut idx = vec![0usize; n - 1];
    for o in 0..outer {
        let at: usize =
            (0..n - 1).map(|d| (offsets[d] + idx[d]) * stride[d]).sum::<usize>() + offsets[n - 1];
        dst[at * es..at * es + run].copy_from_slice(&src[o * run..(o + 1) * run]);
        for d in (0..n - 1).rev() {
            idx[d] += 1;
            if idx[d] < sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Tensor `fqn` whole, from every chunk.
fn load_tensor(dir: &Path, md: &Metadata, fqn: &str) -> Result<TensorData> {
    let Some(Item::Tensor { size, .. }) = md.item(fqn) else {
        return Err(CkptError::format(dir.join(METADATA_FILE), format!("`{fqn}` is not a tensor")));
    };
    load_rows(dir, md, fqn, 0..size.first().copied().unwrap_or(1))
}

/// Rows `rows` (along dim 0) of tensor `fqn`, read from the chunks that overlap them only:
/// how a rank takes its shard of a checkpoint written on another number of ranks.
pub fn load_rows(dir: &Path, md: &Metadata, fqn: &str, rows: Range<usize>) -> Result<TensorData> {
    let meta = dir.join(METADATA_FILE);
    let Some(Item::Tensor { dtype, size, chunks }) = md.item(fqn) else {
        return Err(CkptError::format(meta, format!("`{fqn}` is not a tensor of this checkpoint")));
    };
    let (dtype, es) = (*dtype, dtype.size());
    let scalar = size.is_empty();
    let dim0 = size.first().copied().unwrap_or(1);
    if rows.start > rows.end || rows.end > dim0 {
        return Err(CkptError::format(meta, format!("`{fqn}`: rows {rows:?} of {dim0}")));
    }
    let mut shape = size.clone();
    if !scalar {
        shape[0] = rows.len();
    }
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let bytes = numel.and_then(|n| n.checked_mul(es));
    let Some(nbytes) = bytes.filter(|&b| b < (1usize << 40)) else {
        return Err(CkptError::format(
            meta,
            format!("`{fqn}`: a {dtype} tensor of {size:?} is too large"),
        ));
    };
    let mut out = vec![0u8; nbytes];
    let mut covered = 0usize;
    for c in chunks {
        let (start, len) = if scalar { (0, 1) } else { (c.offsets[0], c.sizes[0]) };
        let lo = start.max(rows.start);
        let hi = (start + len).min(rows.end);
        if lo >= hi && !scalar {
            continue;
        }
        let t = read_chunk(dir, md, fqn, dtype, c)?;
        let src = t.contiguous_bytes();
        if scalar {
            place(&mut out, &shape, &src, &[], &[], es);
            covered += 1;
            continue;
        }
        // The chunk's rows lo..hi, placed at (lo - rows.start, offsets[1..]).
        let row_bytes = c.sizes[1..].iter().product::<usize>() * es;
        let part = &src[(lo - start) * row_bytes..(hi - start) * row_bytes];
        let mut sizes = c.sizes.clone();
        sizes[0] = hi - lo;
        let mut offsets = c.offsets.clone();
        offsets[0] = lo - rows.start;
        place(&mut out, &shape, part, &offsets, &sizes, es);
        covered += sizes.iter().product::<usize>();
    }
    if covered != numel.unwrap_or(0) {
        return Err(CkptError::format(
            meta,
            format!(
                "`{fqn}`: its chunks cover {covered} of the {} elements of rows {rows:?}",
                numel.unwrap_or(0)
            ),
        ));
    }
    Ok(TensorData::from_bytes(dtype, &shape, out))
}

/// Sets `value` at `path` in `root`, making dicts (keys) and lists (indices) on the way.
fn set_at(root: &mut Value, path: &[PathPart], value: Value) -> std::result::Result<(), String> {
    let Some((first, rest)) = path.split_first() else {
        *root = value;
        return Ok(());
    };
    let child = match first {
        PathPart::Key(k) => {
            if !matches!(root, Value::Dict(_) | Value::OrderedDict { .. }) {
                *root = Value::new_dict();
            }
            if root.get(k).is_none() {
                root.insert(k.as_str(), Value::None);
            }
            root.get_mut(k).ok_or("a dict key vanished")?
        }
        PathPart::Index(i) => {
            let i = usize::try_from(*i).map_err(|_| format!("list index {i}"))?;
            if i > 1 << 24 {
                return Err(format!("list index {i} is beyond the limit"));
            }
            if !matches!(root, Value::List(_)) {
                *root = Value::List(Vec::new());
            }
            let Value::List(items) = root else { return Err("not a list".into()) };
            if items.len() <= i {
                items.resize(i + 1, Value::None);
            }
            &mut items[i]
        }
    };
    set_at(child, rest, value)
}

/// Object `fqn` (a stored non-tensor value: an optimizer's `param_groups`, a step count).
pub fn load_object(dir: &Path, md: &Metadata, fqn: &str) -> Result<Value> {
    match md.record(fqn, None) {
        Some(stored) => read_stored(dir, stored),
        None => Err(CkptError::format(
            dir.join(METADATA_FILE),
            format!("`{fqn}`: no record of its bytes"),
        )),
    }
}

/// The flattened key of the value at `path` in the nested state dict (`["model", "l1.weight"]`
/// → `model.l1.weight`), if the checkpoint holds one.
pub fn key_at<'a>(md: &'a Metadata, path: &[&str]) -> Option<&'a str> {
    md.paths.iter().find_map(|(key, parts)| {
        let same = parts.len() == path.len()
            && parts.iter().zip(path).all(|(p, want)| matches!(p, PathPart::Key(k) if k == want));
        same.then_some(key.as_str())
    })
}

/// The whole checkpoint in `dir` as the nested value `dcp.save` was given.
pub fn load(dir: &Path) -> Result<Value> {
    let md = read_metadata(dir)?;
    let mut root = Value::new_dict();
    for (fqn, item) in &md.items {
        let value = match item {
            Item::Tensor { .. } => Value::Tensor(load_tensor(dir, &md, fqn)?),
            Item::Bytes => load_object(dir, &md, fqn)?,
        };
        let path = md
            .paths
            .iter()
            .find(|(k, _)| k == fqn)
            .map(|(_, p)| p.clone())
            .unwrap_or_else(|| vec![PathPart::Key(fqn.clone())]);
        set_at(&mut root, &path, value)
            .map_err(|e| CkptError::format(dir.join(METADATA_FILE), format!("`{fqn}`: {e}")))?;
    }
    Ok(root)
}

/// Whether `v` holds a tensor somewhere (DCP walks into such lists; others are objects).
fn holds_tensor(v: &Value) -> bool {
    match v {
        Value::Tensor(_) => true,
        Value::List(items) | Value::Tuple(items) => items.iter().any(holds_tensor),
        Value::Dict(items) | Value::OrderedDict { items, .. } => {
            items.iter().any(|(_, v)| holds_tensor(v))
        }
        _ => false,
    }
}

/// DCP's flattening: dicts by their keys (as strings), lists that hold tensors by index; every
/// other value is one object. Leaves in order, with their paths.
fn flatten<'a>(
    v: &'a Value,
    path: &mut Vec<PathPart>,
    out: &mut Vec<(Vec<PathPart>, &'a Value)>,
) -> std::result::Result<(), String> {
    match v {
        Value::Dict(items) | Value::OrderedDict { items, .. }
            if !path.is_empty() || !items.is_empty() =>
        {
            for (k, child) in items {
                let key = match k {
                    Value::Str(s) => s.clone(),
                    Value::Int(i) => i.to_string(),
                    other => return Err(format!("a dict key {other:?} (DCP keys are strings)")),
                };
                path.push(PathPart::Key(key));
                flatten(child, path, out)?;
                path.pop();
            }
        }
        Value::List(items) | Value::Tuple(items) if holds_tensor(v) => {
            for (i, child) in items.iter().enumerate() {
                path.push(PathPart::Index(i as i64));
                flatten(child, path, out)?;
                path.pop();
            }
        }
        leaf => out.push((path.clone(), leaf)),
    }
    Ok(())
}

fn fqn_of(path: &[PathPart]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|p| match p {
            PathPart::Key(k) => k.clone(),
            PathPart::Index(i) => i.to_string(),
        })
        .collect();
    parts.join(".")
}

/// What one rank writes of one flattened key.
#[derive(Clone, Debug)]
pub enum Part {
    /// The whole value (a tensor, or any other object).
    Whole(Value),
    /// Rows `row_offset..row_offset + rows.shape[0]` of a tensor of `size` (its dim 0 split
    /// over the ranks).
    Rows { size: Vec<usize>, row_offset: usize, rows: TensorData },
}

/// What a rank wrote: one record per key, for [`write_metadata`] to put together.
#[derive(Clone, Debug)]
pub struct Piece {
    pub path: Vec<PathPart>,
    pub item: Item,
    pub record: Record,
}

/// Writes this rank's parts into `dir/__<rank>_0.distcp` (each a `torch.save` image) and
/// returns their pieces; rank 0 then writes the metadata of every rank's pieces
/// ([`write_metadata`]): how several ranks write one checkpoint (gathering the pieces is the
/// caller's collective).
pub fn write_rank(dir: &Path, rank: usize, parts: &[(Vec<PathPart>, Part)]) -> Result<Vec<Piece>> {
    std::fs::create_dir_all(dir).map_err(|e| CkptError::io(dir, e))?;
    let file = format!("__{rank}_0.distcp");
    let mut pieces = Vec::with_capacity(parts.len());
    crate::atomic::write_atomic(&dir.join(&file), |f| {
        let mut offset = 0u64;
        for (path, part) in parts {
            let fqn = fqn_of(path);
            let own = |t: &TensorData| {
                TensorData::from_bytes(t.dtype, &t.shape, t.contiguous_bytes().into_owned())
            };
            let (image, item, offsets) = match part {
                Part::Whole(Value::Tensor(t)) => {
                    let chunk = Chunk { offsets: vec![0; t.shape.len()], sizes: t.shape.clone() };
                    let offsets = Some(chunk.offsets.clone());
                    let item =
                        Item::Tensor { dtype: t.dtype, size: t.shape.clone(), chunks: vec![chunk] };
                    (crate::to_pt_bytes(&Value::Tensor(own(t))), item, offsets)
                }
                Part::Whole(other) => (crate::to_pt_bytes(other), Item::Bytes, None),
                Part::Rows { size, row_offset, rows } => {
                    let mut offsets = vec![0; size.len()];
                    if let Some(o) = offsets.first_mut() {
                        *o = *row_offset;
                    }
                    let chunk = Chunk { offsets: offsets.clone(), sizes: rows.shape.clone() };
                    let item =
                        Item::Tensor { dtype: rows.dtype, size: size.clone(), chunks: vec![chunk] };
                    (crate::to_pt_bytes(&Value::Tensor(own(rows))), item, Some(offsets))
                }
            };
            let image = image.map_err(|e| std::io::Error::other(format!("`{fqn}`: {e}")))?;
            f.write_all(&image)?;
            let stored = Stored { file: file.clone(), offset, length: image.len() as u64 };
            offset += image.len() as u64;
            pieces.push(Piece {
                path: path.clone(),
                item,
                record: Record { fqn, offsets, stored },
            });
        }
        Ok(())
    })?;
    Ok(pieces)
}

/// Writes `dir/.metadata` for the pieces every rank wrote: a key's chunks from several ranks
/// become one tensor's chunks (they must agree on its dtype and size); an object is kept once.
pub fn write_metadata(dir: &Path, pieces: Vec<Piece>) -> Result<()> {
    let mut md = Metadata { version: Some("1.0.0".into()), ..Metadata::default() };
    let meta = dir.join(METADATA_FILE);
    for piece in pieces {
        let fqn = piece.record.fqn.clone();
        let known = md.items.iter_mut().find(|(k, _)| *k == fqn);
        match (known, piece.item) {
            (None, item) => {
                md.items.push((fqn.clone(), item));
                md.paths.push((fqn, piece.path));
                md.records.push(piece.record);
            }
            (
                Some((_, Item::Tensor { dtype, size, chunks })),
                Item::Tensor { dtype: d, size: z, chunks: c },
            ) => {
                if (*dtype, &*size) != (d, &z) {
                    return Err(CkptError::format(meta, format!("`{fqn}`: ranks disagree on its dtype and size ({dtype} {size:?} and {d} {z:?})")));
                }
                chunks.extend(c);
                md.records.push(piece.record);
            }
            (Some(_), Item::Bytes) => {}
            (Some(_), _) => {
                return Err(CkptError::format(
                    meta,
                    format!("`{fqn}`: a tensor on one rank, an object on another"),
                ));
            }
        }
    }
    let pickle = metadata::to_pickle(&md);
    crate::atomic::write_atomic(&meta, |f| f.write_all(&pickle))
}

/// Writes `value` (a dict: a state dict, or `{"model": ..., "optim": ...}`) to `dir` as one
/// process's `dcp.save` would: every tensor a single chunk in `__0_0.distcp`, every other leaf
/// a pickled object, then `.metadata`. The data file is complete before the metadata appears.
pub fn save(dir: &Path, value: &Value) -> Result<()> {
    if !matches!(value, Value::Dict(_) | Value::OrderedDict { .. }) {
        return Err(CkptError::Unsupported {
            what: dir.display().to_string(),
            msg: "a DCP checkpoint is a dict at its top".into(),
        });
    }
    let mut leaves = Vec::new();
    flatten(value, &mut Vec::new(), &mut leaves)
        .map_err(|msg| CkptError::Unsupported { what: dir.display().to_string(), msg })?;
    let parts: Vec<(Vec<PathPart>, Part)> =
        leaves.into_iter().map(|(p, v)| (p, Part::Whole(v.clone()))).collect();
    let pieces = write_rank(dir, 0, &parts)?;
    write_metadata(dir, pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_placed_by_their_offsets() {
        // A 3x4 tensor from a 2x2 chunk at (1, 2) and the rest.
        let full = [3usize, 4];
        let mut dst = vec![0u8; 12];
        place(&mut dst, &full, &[1, 2, 3, 4], &[1, 2], &[2, 2], 1);
        assert_eq!(dst, [0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 3, 4]);
    }

    #[test]
    fn a_value_round_trips_through_a_dcp_directory() {
        let dir = tempfile::tempdir().unwrap();
        let w = TensorData::from_f32(&[2, 3], &[0., 1., 2., 3., 4., 5.]);
        let v = Value::dict_from([
            ("model", Value::dict_from([("w", Value::Tensor(w.clone()))])),
            ("step", Value::Int(7)),
            ("pair", Value::List(vec![Value::Tensor(TensorData::scalar_f32(1.5)), Value::Int(2)])),
        ]);
        save(dir.path(), &v).unwrap();
        let md = read_metadata(dir.path()).unwrap();
        let keys: Vec<&str> = md.items.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["model.w", "step", "pair.0", "pair.1"]);
        let back = load(dir.path()).unwrap();
        assert_eq!(back.get("step").and_then(Value::as_int), Some(7));
        let got = back.get("model").and_then(|m| m.get("w")).and_then(Value::as_tensor).unwrap();
        assert_eq!((got.shape.clone(), got.to_f32_vec()), (vec![2, 3], w.to_f32_vec()));
        let rows = load_rows(dir.path(), &md, "model.w", 1..2).unwrap();
        assert_eq!(rows.to_f32_vec(), [3., 4., 5.]);
        let pair = back.get("pair").and_then(Value::as_list).unwrap();
        assert_eq!(pair[1].as_int(), Some(2));
    }

    #[test]
    fn a_range_outside_its_file_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let v = Value::dict_from([("w", Value::Tensor(TensorData::from_f32(&[2], &[1., 2.])))]);
        save(dir.path(), &v).unwrap();
        let mut md = read_metadata(dir.path()).unwrap();
        md.records[0].stored.length += 1 << 40;
        std::fs::write(dir.path().join(METADATA_FILE), metadata::to_pickle(&md)).unwrap();
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(err.contains(DATA_FILE) && err.contains("names bytes"), "{err}");
        md.records[0].stored.offset = i64::MAX as u64;
        md.records[0].stored.length = i64::MAX as u64;
        std::fs::write(dir.path().join(METADATA_FILE), metadata::to_pickle(&md)).unwrap();
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("names bytes"), "{err}");
        md.records[0].stored.file = "../outside".into();
        std::fs::write(dir.path().join(METADATA_FILE), metadata::to_pickle(&md)).unwrap();
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(err.contains(".metadata") && err.contains("not a name inside"), "{err}");
    }
}
