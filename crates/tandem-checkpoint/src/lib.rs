//! tandem-checkpoint: one API for a run's training state, replicated and sharded (what
//! `torch.distributed.checkpoint` is to PyTorch): a [`TrainingStateDict`] is the replicated
//! part (model, its optimizer state, schedulers, GradScaler, sampler, counters: one torch dict,
//! the same on every rank) plus this rank's [`ShardDict`]s, each saying which slice of a global
//! object it holds ([`ShardSlice`]: rows of a matrix such as PartialFC's class centres with
//! their optimizer state, entries of an index-keyed state such as ZeRO-1's optimizer shards,
//! or state of the rank itself such as per-rank BatchNorm statistics).
//!
//! A [`Checkpointer`] saves it (a collective) and finds the newest complete save to load:
//!
//! ```text
//! no shards        DIR/checkpoint-NAME.pt     rank 0's replicated dict, the file torch.load
//!                                             opens (`weights_only=True`)
//! with shards      DIR/NAME/replicated.pt     rank 0: the replicated dict
//!                  DIR/NAME/rank-0000R-of-0000W.pt   every rank: {shard name: value}
//!                  DIR/NAME/manifest.json     rank 0, last, once every file is durable: the
//!                                             world size, step, and each rank's slices
//! ```
//!
//! Every file is written atomically (temp file, fsync, rename, directory fsync), every rank's
//! shards in parallel, synchronously or in the background ([`Checkpointer::background`]:
//! the values are host copies, so training goes on while a thread writes; the save is
//! committed at the next save or [`Checkpointer::settle`], where a failed write is every
//! rank's error, naming the file). Retention (`keep_last`) prunes only after the new
//! checkpoint is complete, durable and in place, and only complete checkpoints count; a
//! re-save under an existing name is written beside it and swapped in, so one complete copy is
//! on disk at every moment. A `latest` file names the newest save (for people; loading does
//! not trust it).
//!
//! Loading ([`Checkpointer::latest`] → [`Saved`]) picks the newest complete checkpoint that
//! reads (a file whose checksums fail is skipped with a warning) and reads only what a rank
//! asks for: [`Saved::read_rows`] opens only the rank files whose rows overlap the range (the
//! head is re-split on another world size, never assembled on one rank),
//! [`Saved::read_entries`] only the files holding the wanted indices. Directories of a format
//! a recipe wrote before this API load through the same reader once that recipe registers it
//! ([`register_dir_format`]).
//!
//! ```ignore
//! let mut ckpt = Checkpointer::new("run/checkpoints", 3).background(true);
//! let state = TrainingStateDict::new(step, epoch, replicated)
//!     .shard(ShardDict::rows("head", split.start, split.len, split.classes, head.state_dict()?));
//! ckpt.save(&group, &format!("step-{step:08}"), state)?;
//! // ... on any world size:
//! if let Some(saved) = ckpt.latest()? {
//!     let replicated = saved.replicated()?;
//!     head.load_state_dict(&saved.read_row_parts("head", my_rows)?.iter().collect::<Vec<_>>())?;
//! }
//! ```
mod error;
mod formats;
mod inspect;
mod manifest;
mod policy;
mod reader;
mod rows;
mod writer;

use std::path::Path;

use tandem_ckpt::{CkptError, Value};

pub use error::{CheckpointError, Result};
pub use formats::{register_dir_format, DirFormat};
pub use inspect::{Inspection, RankInspection, ShardInspection};
pub use manifest::{rank_file_name, Manifest, RankFile, ShardEntry, FORMAT, MANIFEST, REPLICATED};
pub use policy::{CheckpointPolicy, Never, Periodic, KEEP_LAST};
pub use reader::Saved;
pub use rows::slice_rows;
pub use writer::{resolve_latest, write_sharded, Checkpointer, LATEST};

/// Which slice of a global object a shard holds.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ShardSlice {
    /// Rows `start .. start + len` of an object with `total` rows: every tensor in the value
    /// whose first dimension is `len` holds those rows; anything else (a step count) is the
    /// same on every rank.
    Rows { start: usize, len: usize, total: usize },
    /// Entries of an index-keyed state (the value is a dict keyed by these indices).
    Entries { indices: Vec<usize> },
    /// This rank's own state, with no global counterpart.
    Rank,
}

impl std::fmt::Display for ShardSlice {
    /// `rows 0..500 of 1000`, `entries [0, 2]`, `this rank's own`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardSlice::Rows { start, len, total } => {
                write!(f, "rows {start}..{} of {total}", start + len)
            }
            ShardSlice::Entries { indices } => write!(f, "entries {indices:?}"),
            ShardSlice::Rank => f.write_str("this rank's own"),
        }
    }
}

/// One sharded item of a rank's training state.
#[derive(Clone, Debug)]
pub struct ShardDict {
    /// Names the item in every rank's file (the same name on every rank).
    pub name: String,
    pub slice: ShardSlice,
    pub value: Value,
}

impl ShardDict {
    pub fn rows(name: &str, start: usize, len: usize, total: usize, value: Value) -> Self {
        ShardDict { name: name.into(), slice: ShardSlice::Rows { start, len, total }, value }
    }
    /// `value` must be a dict keyed by the (integer) indices.
    pub fn entries(name: &str, indices: Vec<usize>, value: Value) -> Self {
        ShardDict { name: name.into(), slice: ShardSlice::Entries { indices }, value }
    }
    pub fn rank(name: &str, value: Value) -> Self {
        ShardDict { name: name.into(), slice: ShardSlice::Rank, value }
    }
}

/// A rank's training state for [`Checkpointer::save`]. Every rank passes the same shard
/// names (or none); only rank 0's `replicated` is written (other ranks may pass `Value::None`).
#[derive(Clone, Debug)]
pub struct TrainingStateDict {
    pub global_step: u64,
    pub epoch: u64,
    pub replicated: Value,
    pub shards: Vec<ShardDict>,
}

impl TrainingStateDict {
    pub fn new(global_step: u64, epoch: u64, replicated: Value) -> Self {
        TrainingStateDict { global_step, epoch, replicated, shards: Vec::new() }
    }
    pub fn shard(mut self, shard: ShardDict) -> Self {
        self.shards.push(shard);
        self
    }
}

pub(crate) use error::{comm, io};

fn file(path: &Path) -> impl FnOnce(CkptError) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::File { path, source }
}

fn invalid(path: &Path, why: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt { path: path.to_path_buf(), why: why.into() }
}
