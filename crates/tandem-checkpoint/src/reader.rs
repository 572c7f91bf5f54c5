//! A saved checkpoint, found by [`Checkpointer::latest`](super::Checkpointer::latest) or
//! opened by path: its replicated dict and, read on demand, the slices of its shards.
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_ckpt::{LoadOptions, Value};

use super::formats::{dir_format, DirFormat};
use super::manifest::{self, Manifest};
use super::rows::{self, RowPart};
use super::{file, invalid, Result, ShardSlice};

/// A complete checkpoint: a single file, or a directory with its manifest.
pub struct Saved {
    path: PathBuf,
    global_step: u64,
    epoch: u64,
    world_size: usize,
    source: Source,
}

enum Source {
    File(Value),
    /// `format`: a registered earlier format it is read as (`None`: `tandem-state-1`).
    Dir {
        manifest: Manifest,
        format: Option<Arc<dyn DirFormat>>,
    },
}

impl std::fmt::Debug for Saved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saved")
            .field("path", &self.path)
            .field("format", &self.format())
            .field("global_step", &self.global_step)
            .field("world_size", &self.world_size)
            .finish()
    }
}

fn load_verified(path: &Path) -> Result<Value> {
    let opts = LoadOptions { verify_checksums: true, ..Default::default() };
    tandem_ckpt::load_with(path, &opts).map_err(file(path))
}

impl Saved {
    /// A checkpoint file (`checkpoint-NAME.pt`) or directory (with `manifest.json`, of this
    /// format or one registered with [`register_dir_format`](super::register_dir_format)).
    pub fn open(path: &Path) -> Result<Saved> {
        if path.is_dir() {
            Self::open_dir(path)
        } else {
            Self::open_file(path)
        }
    }

    fn open_file(path: &Path) -> Result<Saved> {
        let value = load_verified(path)?;
        let int = |k: &str| value.get(k).and_then(Value::as_int).unwrap_or(0).max(0) as u64;
        Ok(Saved {
            path: path.to_path_buf(),
            global_step: int("global_step"),
            epoch: int("epoch"),
            world_size: int("world_size").max(1) as usize,
            source: Source::File(value),
        })
    }

    fn open_dir(dir: &Path) -> Result<Saved> {
        let json = manifest::read_json(dir)?;
        let format = json.get("format").and_then(|f| f.as_str()).unwrap_or("").to_string();
        let known = (format != manifest::FORMAT).then(|| dir_format(&format)).flatten();
        if known.is_none() && format != manifest::FORMAT && !format.is_empty() {
            return Err(invalid(
                &dir.join(manifest::MANIFEST),
                format!(
                    "format `{format}` is neither `{}` nor one registered in this program \
                     (checkpoint::register_dir_format)",
                    manifest::FORMAT
                ),
            ));
        }
        let manifest = match &known {
            Some(f) => manifest::check(dir, f.manifest(dir, json)?)?,
            None => manifest::parse(dir, json)?,
        };
        Ok(Saved {
            path: dir.to_path_buf(),
            global_step: manifest.global_step,
            epoch: manifest.epoch,
            world_size: manifest.world_size,
            source: Source::Dir { manifest, format: known },
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn global_step(&self) -> u64 {
        self.global_step
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// The world size that wrote it.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// The manifest of a sharded checkpoint (`None` for a single file).
    pub fn manifest(&self) -> Option<&Manifest> {
        match &self.source {
            Source::Dir { manifest, .. } => Some(manifest),
            Source::File(_) => None,
        }
    }
    /// `tandem-state-1`, a registered earlier format (read as the first) or `file`.
    pub fn format(&self) -> &'static str {
        match &self.source {
            Source::File(_) => "file",
            Source::Dir { format: Some(f), .. } => f.name(),
            Source::Dir { format: None, .. } => manifest::FORMAT,
        }
    }

    /// The replicated dict (the whole file of a single-file checkpoint).
    pub fn replicated(&self) -> Result<Value> {
        match &self.source {
            Source::File(v) => Ok(v.clone()),
            Source::Dir { manifest, format } => {
                let value = load_verified(&self.path.join(&manifest.replicated))?;
                Ok(match format {
                    Some(f) => f.replicated(value),
                    None => value,
                })
            }
        }
    }

    /// The shard names, in the order rank 0 saved them.
    pub fn shard_names(&self) -> Vec<&str> {
        self.manifest()
            .map_or(Vec::new(), |m| m.ranks[0].shards.iter().map(|s| s.name.as_str()).collect())
    }

    /// Each rank's slice of shard `name`, in rank order (`None` when there is no such shard).
    pub fn slices(&self, name: &str) -> Option<Vec<&ShardSlice>> {
        let m = self.manifest()?;
        m.ranks.iter().map(|r| r.shards.iter().find(|s| s.name == name).map(|s| &s.slice)).collect()
    }

    /// The rows of row shard `name` (`None`: no such shard).
    pub fn rows_total(&self, name: &str) -> Option<usize> {
        match self.slices(name)?.first()? {
            ShardSlice::Rows { total, .. } => Some(*total),
            _ => None,
        }
    }

    /// Saved rank `rank`'s whole file.
    pub fn read_rank_file(&self, rank: usize) -> Result<Value> {
        let m = self.manifest().ok_or_else(|| invalid(&self.path, "a single-file checkpoint"))?;
        let r = m.ranks.get(rank).ok_or_else(|| {
            invalid(&self.path, format!("no rank {rank} (saved by {} ranks)", m.world_size))
        })?;
        load_verified(&self.path.join(&r.file))
    }

    fn shard_of(&self, file_value: &Value, rank: usize, name: &str) -> Result<Value> {
        let found = match &self.source {
            Source::Dir { format: Some(f), .. } => f.shard(file_value, name),
            _ => file_value.get(name).cloned(),
        };
        found.ok_or_else(|| {
            let file = &self.manifest().expect("a directory").ranks[rank].file;
            invalid(&self.path.join(file), format!("no shard `{name}`"))
        })
    }

    fn need(&self, name: &str) -> Result<Vec<&ShardSlice>> {
        self.slices(name)
            .ok_or_else(|| invalid(&self.path, format!("the checkpoint has no shard `{name}`")))
    }

    /// The saved blocks of row shard `name` that overlap `range`, whole, with the rows wanted
    /// from each: only their files are read.
    fn row_blocks(&self, name: &str, range: &Range<usize>) -> Result<Vec<RowPart>> {
        let mut parts = Vec::new();
        for (r, slice) in self.need(name)?.into_iter().enumerate() {
            let ShardSlice::Rows { start, len, total } = *slice else {
                return Err(invalid(&self.path, format!("shard `{name}` is not a row shard")));
            };
            if range.end > total {
                return Err(invalid(
                    &self.path,
                    format!(
                        "shard `{name}` has {total} rows, asked for {}..{}",
                        range.start, range.end
                    ),
                ));
            }
            let overlap = start.max(range.start)..(start + len).min(range.end);
            if overlap.is_empty() {
                continue;
            }
            let file_value = self.read_rank_file(r)?;
            let path = self.path.join(&self.manifest().expect("a directory").ranks[r].file);
            let rows = overlap.start - start..overlap.end - start;
            parts.push(RowPart { value: self.shard_of(&file_value, r, name)?, len, rows, path });
        }
        Ok(parts)
    }

    /// Rows `range` of row shard `name`, read only from the rank files that hold them: every
    /// tensor of the shard's value cut to those rows and stacked (anything else from the first
    /// file that holds some).
    pub fn read_rows(&self, name: &str, range: Range<usize>) -> Result<Value> {
        let parts = self.row_blocks(name, &range)?;
        if parts.is_empty() && !range.is_empty() {
            return Err(invalid(
                &self.path,
                format!("shard `{name}`: no rank holds rows {range:?}"),
            ));
        }
        rows::merge(&parts, name)
    }

    /// The whole saved blocks of row shard `name` that overlap `range` (for loaders that pick
    /// their rows themselves, as `PartialFc::load_state_dict`).
    pub fn read_row_parts(&self, name: &str, range: Range<usize>) -> Result<Vec<Value>> {
        Ok(self.row_blocks(name, &range)?.into_iter().map(|p| p.value).collect())
    }

    /// Saved rank `rank`'s value of rank shard `name` (`None` when the saved world had no
    /// such rank).
    pub fn read_rank(&self, name: &str, rank: usize) -> Result<Option<Value>> {
        let slices = self.need(name)?;
        if rank >= slices.len() {
            return Ok(None);
        }
        let file_value = self.read_rank_file(rank)?;
        Ok(Some(self.shard_of(&file_value, rank, name)?))
    }

    /// The entries `wanted` (all with `None`) of entry shard `name`, read only from the files
    /// that hold them, as one dict keyed by index in increasing order. A wanted index nobody
    /// saved is absent (an optimizer that had no state for it yet).
    pub fn read_entries(&self, name: &str, wanted: Option<&[usize]>) -> Result<Value> {
        let mut out: Vec<(i64, Value)> = Vec::new();
        for (r, slice) in self.need(name)?.into_iter().enumerate() {
            let ShardSlice::Entries { indices } = slice else {
                return Err(invalid(&self.path, format!("shard `{name}` is not an entry shard")));
            };
            let take = |i: &usize| wanted.is_none_or(|w| w.contains(i));
            if !indices.iter().any(take) {
                continue;
            }
            let value = self.shard_of(&self.read_rank_file(r)?, r, name)?;
            for (k, v) in value.as_dict().unwrap_or(&[]) {
                let i = k.as_int().filter(|&i| i >= 0).ok_or_else(|| {
                    invalid(&self.path, format!("shard `{name}` of rank {r}: a non-index key"))
                })?;
                if indices.contains(&(i as usize)) && take(&(i as usize)) {
                    out.push((i, v.clone()));
                }
            }
        }
        out.sort_by_key(|(i, _)| *i);
        Ok(Value::Dict(out.into_iter().map(|(i, v)| (Value::Int(i), v)).collect()))
    }

    /// The whole state as one dict (what `tandem ckpt convert` writes): the replicated dict
    /// with every shard put in at its name read as a `/`-separated path (`optimizer/state`
    /// goes under `optimizer` → `state`): row shards stacked whole, entry shards as one dict,
    /// rank shards as a list in rank order.
    pub fn consolidated(&self) -> Result<Value> {
        let mut whole = self.replicated()?;
        for name in self.shard_names() {
            let value = match self.need(name)?[0] {
                ShardSlice::Rows { total, .. } => self.read_rows(name, 0..*total)?,
                ShardSlice::Entries { .. } => self.read_entries(name, None)?,
                ShardSlice::Rank => {
                    let mut all = Vec::new();
                    for r in 0..self.world_size {
                        all.push(self.read_rank(name, r)?.unwrap_or(Value::None));
                    }
                    Value::List(all)
                }
            };
            put(&mut whole, name, value);
        }
        Ok(whole)
    }
}

/// Sets `path` (`a/b/c`) inside dict `v`, creating dicts on the way.
fn put(v: &mut Value, path: &str, value: Value) {
    let mut parts = path.split('/').peekable();
    let mut here = v;
    while let Some(key) = parts.next() {
        if here.as_dict().is_none() {
            *here = Value::new_dict();
        }
        if parts.peek().is_none() {
            match key.parse::<i64>() {
                // One entry of an optimizer's state (`optimizer/state/3`, an Fsdp model's rows):
                // torch keys them by int, and a parameter without state has no entry.
                Ok(index) if !matches!(value, Value::None) => here.insert(Value::Int(index), value),
                Ok(_) => {}
                Err(_) => here.insert(key, value),
            }
            return;
        }
        if here.get(key).is_none() {
            here.insert(key, Value::new_dict());
        }
        here = here.get_mut(key).expect("inserted above");
    }
}
