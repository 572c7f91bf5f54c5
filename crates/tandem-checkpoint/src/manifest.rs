//! `manifest.json` of a sharded checkpoint: what each rank's file holds. Written last; a
//! directory without one is an unfinished save. Read back with every name and slice checked.
use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{file, invalid, io, Result, ShardSlice};

pub const FORMAT: &str = "tandem-state-1";
pub const MANIFEST: &str = "manifest.json";
pub const REPLICATED: &str = "replicated.pt";
/// A manifest larger than this is not ours (it lists a few entries per rank).
const MAX_MANIFEST_BYTES: u64 = 256 << 20;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `tandem-state-1`.
    pub format: String,
    pub world_size: usize,
    pub global_step: u64,
    pub epoch: u64,
    pub replicated: String,
    /// One per rank, in rank order.
    pub ranks: Vec<RankFile>,
}

/// One rank's file and the shards in it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankFile {
    pub file: String,
    pub shards: Vec<ShardEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub name: String,
    #[serde(flatten)]
    pub slice: ShardSlice,
}

pub fn rank_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.pt")
}

/// A file name that stays inside the checkpoint's directory.
pub(crate) fn plain_name(name: &str) -> bool {
    Path::new(name).file_name().is_some_and(|f| f == name) && name != ".." && name != "."
}

pub(crate) fn write(dir: &Path, manifest: &Manifest) -> Result<()> {
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| invalid(&path, e.to_string()))?;
    tandem_ckpt::atomic::write_atomic(&path, |f| std::io::Write::write_all(f, &json))
        .map_err(file(&path))
}

/// Reads `dir/manifest.json` as JSON (any format), bounded in size.
pub(crate) fn read_json(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join(MANIFEST);
    let len = std::fs::metadata(&path).map_err(io("reading", &path))?.len();
    if len > MAX_MANIFEST_BYTES {
        return Err(invalid(&path, format!("{len} bytes, more than a manifest holds")));
    }
    let bytes = std::fs::read(&path).map_err(io("reading", &path))?;
    serde_json::from_slice(&bytes).map_err(|e| invalid(&path, format!("not JSON: {e}")))
}

/// Parses a `tandem-state-1` manifest and [`check`]s it.
pub(crate) fn parse(dir: &Path, json: serde_json::Value) -> Result<Manifest> {
    let m: Manifest = serde_json::from_value(json)
        .map_err(|e| invalid(&dir.join(MANIFEST), format!("not a checkpoint manifest: {e}")))?;
    check(dir, m)
}

/// The manifest of `ranks[r]`'s shard lists (every rank's file named as a save names it).
pub(crate) fn build(global_step: u64, epoch: u64, ranks: Vec<Vec<ShardEntry>>) -> Manifest {
    let world = ranks.len();
    Manifest {
        format: FORMAT.into(),
        world_size: world,
        global_step,
        epoch,
        replicated: REPLICATED.into(),
        ranks: ranks
            .into_iter()
            .enumerate()
            .map(|(r, shards)| RankFile { file: rank_file_name(r, world), shards })
            .collect(),
    }
}

/// Checks a manifest (read, converted from an earlier format, or about to be written): plain
/// file names, one file per rank, the same shard names and kinds on every rank, row slices
/// that tile their object, entries held once. Errors name `dir`'s manifest.
pub(crate) fn check(dir: &Path, m: Manifest) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bad = |why: String| invalid(&path, why);
    if m.format != FORMAT {
        return Err(bad(format!("format `{}`, expected `{FORMAT}`", m.format)));
    }
    if m.ranks.len() != m.world_size || m.world_size == 0 {
        return Err(bad(format!("{} rank files for world size {}", m.ranks.len(), m.world_size)));
    }
    for name in std::iter::once(&m.replicated).chain(m.ranks.iter().map(|r| &r.file)) {
        if !plain_name(name) {
            return Err(bad(format!(
                "file name {name:?} is not a plain name inside the checkpoint"
            )));
        }
    }
    let names: Vec<&str> = m.ranks[0].shards.iter().map(|s| s.name.as_str()).collect();
    let mut rows: BTreeMap<&str, Vec<(usize, usize, usize)>> = BTreeMap::new();
    let mut entries: BTreeMap<(&str, usize), usize> = BTreeMap::new();
    for (r, rank) in m.ranks.iter().enumerate() {
        let here: Vec<&str> = rank.shards.iter().map(|s| s.name.as_str()).collect();
        if here != names {
            return Err(bad(format!("rank {r} holds shards {here:?}, rank 0 {names:?}")));
        }
        for s in &rank.shards {
            match &s.slice {
                ShardSlice::Rows { start, len, total } => {
                    rows.entry(&s.name).or_default().push((*start, *len, *total))
                }
                ShardSlice::Entries { indices } => {
                    for &i in indices {
                        if let Some(other) = entries.insert((&s.name, i), r) {
                            return Err(bad(format!(
                                "shard `{}`: entry {i} held by ranks {other} and {r}",
                                s.name
                            )));
                        }
                    }
                }
                ShardSlice::Rank => {}
            }
        }
        let kinds = |sh: &[super::ShardEntry]| -> Vec<std::mem::Discriminant<ShardSlice>> {
            sh.iter().map(|s| std::mem::discriminant(&s.slice)).collect()
        };
        if kinds(&rank.shards) != kinds(&m.ranks[0].shards) {
            return Err(bad(format!("rank {r}'s shards are of other kinds than rank 0's")));
        }
    }
    for (name, mut slices) in rows {
        slices.sort();
        let total = slices[0].2;
        let mut next = 0;
        for (start, len, t) in slices {
            let end = start.checked_add(len).filter(|&end| end <= t);
            let Some(end) = end.filter(|_| t == total && start == next) else {
                return Err(bad(format!(
                    "shard `{name}`: rows {start} (+{len}) of {t} do not follow rows ..{next} of \
                     {total}"
                )));
            };
            next = end;
        }
        if next != total {
            return Err(bad(format!("shard `{name}`: rows cover 0..{next} of {total}")));
        }
    }
    Ok(m)
}
