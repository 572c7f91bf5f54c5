//! The face recipe's checkpoint directories from before the one checkpoint API
//! (`tandem-partial-fc-1`: `replicated.pt`, `head-rank-R-of-W.pt` = `{rank, start, len, weight,
//! state, buffers}`, `manifest.json` with the class range of each head file), read as a
//! `tandem-state-1` checkpoint with a `head` row shard (`{weight, state}`) and a `buffers` rank
//! shard, so old runs resume and convert as new ones do.
use std::path::Path;

use serde::Deserialize;
use tandem_ckpt::Value;

use super::manifest::{plain_name, Manifest, RankFile, ShardEntry, MANIFEST};
use super::{invalid, Result, ShardSlice};

pub const FACE_FORMAT: &str = "tandem-partial-fc-1";

#[derive(Deserialize)]
struct FaceManifest {
    world_size: usize,
    global_step: u64,
    epoch: u64,
    num_classes: usize,
    replicated: String,
    heads: Vec<HeadFile>,
}

#[derive(Deserialize)]
struct HeadFile {
    file: String,
    start: usize,
    len: usize,
}

/// The old manifest as the new one (checked by the caller as any other).
pub(crate) fn face_manifest(dir: &Path, json: serde_json::Value) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let m: FaceManifest = serde_json::from_value(json)
        .map_err(|e| invalid(&path, format!("not a face checkpoint manifest: {e}")))?;
    if let Some(bad) = m.heads.iter().map(|h| &h.file).find(|f| !plain_name(f)) {
        return Err(invalid(
            &path,
            format!("file name {bad:?} is not a plain name inside the checkpoint"),
        ));
    }
    let ranks = m
        .heads
        .iter()
        .map(|h| RankFile {
            file: h.file.clone(),
            shards: vec![
                ShardEntry {
                    name: "head".into(),
                    slice: ShardSlice::Rows { start: h.start, len: h.len, total: m.num_classes },
                },
                ShardEntry { name: "buffers".into(), slice: ShardSlice::Rank },
            ],
        })
        .collect();
    Ok(Manifest {
        format: super::FORMAT.into(),
        world_size: m.world_size,
        global_step: m.global_step,
        epoch: m.epoch,
        replicated: m.replicated,
        ranks,
    })
}

/// Shard `name` of an old head file.
pub(crate) fn face_shard(file: &Value, name: &str) -> Option<Value> {
    match name {
        "head" => Some(Value::dict_from([
            ("weight", file.get("weight")?.clone()),
            ("state", file.get("state").cloned().unwrap_or(Value::None)),
        ])),
        "buffers" => file.get("buffers").cloned(),
        _ => None,
    }
}
