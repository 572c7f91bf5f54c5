//! Checkpoint directories of formats other than `tandem-state-1` that read as one: a recipe's
//! earlier layout (the face recipe's `tandem-partial-fc-1`). The recipe that knows a format
//! registers it once per process ([`register_dir_format`]); [`Saved::open`](super::Saved::open)
//! then reads such a directory through the same reader, so old runs resume, inspect and
//! convert as new ones do. This crate knows no format but its own.
use std::path::Path;
use std::sync::{Arc, RwLock};

use tandem_ckpt::Value;

use super::{Manifest, Result};

/// A directory format that reads as `tandem-state-1`.
pub trait DirFormat: Send + Sync {
    /// The `format` its `manifest.json` names.
    fn name(&self) -> &'static str;

    /// Its manifest (`json`, read from `dir`) as a `tandem-state-1` manifest; the reader checks
    /// it as any other (plain file names, one file per rank, slices that tile).
    fn manifest(&self, dir: &Path, json: serde_json::Value) -> Result<Manifest>;

    /// Shard `name` of one of its rank files (`None`: the file has no such shard).
    fn shard(&self, file: &Value, name: &str) -> Option<Value>;

    /// Its replicated dict as `tandem-state-1` names the keys (unchanged by default).
    fn replicated(&self, value: Value) -> Value {
        value
    }
}

static FORMATS: RwLock<Vec<Arc<dyn DirFormat>>> = RwLock::new(Vec::new());

/// Makes `format` readable by every [`Saved::open`](super::Saved::open) in this process. A
/// second registration of the same name replaces the first.
pub fn register_dir_format(format: Arc<dyn DirFormat>) {
    let mut formats = FORMATS.write().unwrap_or_else(|p| p.into_inner());
    formats.retain(|f| f.name() != format.name());
    formats.push(format);
}

/// The registered format named `name`.
pub(crate) fn dir_format(name: &str) -> Option<Arc<dyn DirFormat>> {
    let formats = FORMATS.read().unwrap_or_else(|p| p.into_inner());
    formats.iter().find(|f| f.name() == name).cloned()
}
