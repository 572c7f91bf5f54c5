//! The face recipe's checkpoint directories from before the one checkpoint API
//! (`tandem-partial-fc-1`: `replicated.pt`, `head-rank-R-of-W.pt` = `{rank, start, len, weight,
//! state, buffers}`, `manifest.json` with the class range of each head file), read as a
//! `tandem-state-1` checkpoint with a [`HEAD_SHARD`] row shard (`{weight, state}`) and a
//! [`BUFFERS_SHARD`] rank shard, so old runs resume, inspect and convert as new ones do.
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use tandem_ckpt::Value;
use tandem_train::checkpoint::{
    register_dir_format, CheckpointError, DirFormat, Manifest, RankFile, Result, ShardEntry,
    ShardSlice, FORMAT, MANIFEST,
};

use super::{BUFFERS_SHARD, HEAD_SHARD};

/// The earlier format's name, as its manifests spell it.
pub const FACE_FORMAT: &str = "tandem-partial-fc-1";

/// Makes the face recipe's earlier checkpoints readable in this process (`tandem train`, `tandem
/// ckpt` and [`crate::train`] call it; a program of its own that reads them calls it once).
pub fn register_checkpoint_formats() {
    register_dir_format(Arc::new(FaceCheckpoints));
}

struct FaceCheckpoints;

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

impl DirFormat for FaceCheckpoints {
    fn name(&self) -> &'static str {
        FACE_FORMAT
    }

    fn manifest(&self, dir: &Path, json: serde_json::Value) -> Result<Manifest> {
        let m: FaceManifest =
            serde_json::from_value(json).map_err(|e| CheckpointError::Corrupt {
                path: dir.join(MANIFEST),
                why: format!("not a face checkpoint manifest: {e}"),
            })?;
        let ranks = m
            .heads
            .iter()
            .map(|h| RankFile {
                file: h.file.clone(),
                shards: vec![
                    ShardEntry {
                        name: HEAD_SHARD.into(),
                        slice: ShardSlice::Rows {
                            start: h.start,
                            len: h.len,
                            total: m.num_classes,
                        },
                    },
                    ShardEntry { name: BUFFERS_SHARD.into(), slice: ShardSlice::Rank },
                ],
            })
            .collect();
        Ok(Manifest {
            format: FORMAT.into(),
            world_size: m.world_size,
            global_step: m.global_step,
            epoch: m.epoch,
            replicated: m.replicated,
            ranks,
        })
    }

    fn shard(&self, file: &Value, name: &str) -> Option<Value> {
        match name {
            HEAD_SHARD => Some(Value::dict_from([
                ("weight", file.get("weight")?.clone()),
                ("state", file.get("state").cloned().unwrap_or(Value::None)),
            ])),
            BUFFERS_SHARD => file.get("buffers").cloned(),
            _ => None,
        }
    }

    /// Its writer named the model `backbone`.
    fn replicated(&self, mut value: Value) -> Value {
        if value.get("model").is_none() {
            if let Some(backbone) = value.get("backbone").cloned() {
                value.insert("model", backbone);
            }
        }
        value
    }
}
