//! tandem-ckpt: reading and writing `.pt` (torch.save) and safetensors files, key
//! canonicalisation with load reports, atomic writes and the training checkpoint's dict.
//! Knows nothing of process groups (rank-0-only saving takes the caller's barrier) nor of tensor
//! engines or devices: tensors are host bytes with PyTorch's storage/stride model, and
//! `map_location` is validated and handed back, not acted on.
pub mod atomic;
pub mod dcp;
pub mod error;
pub mod keys;
pub mod npy;
mod pickle;
pub mod pt;
pub mod safetensors;
pub mod training;
pub mod tree;
pub mod value;
mod zip_writer;

use std::path::Path;

pub use error::CkptError;
pub use keys::{canonicalize_keys, load_state_dict, LoadReport};
pub use pt::{LoadOptions, MapLocation};
pub use training::TrainingCheckpoint;
pub use value::{ElemType, ExternalBytes, StorageData, TensorData, Value};

/// `torch.load(path, weights_only=True)`: reads a torch.save file (zip or legacy format; a
/// safetensors file works too) into a value tree. Large files are memory-mapped. A directory
/// `dcp.save` wrote (PyTorch's distributed checkpoint) reads whole, its shards put together.
pub fn load(path: impl AsRef<Path>) -> Result<Value, CkptError> {
    load_with(path, &LoadOptions::default())
}

/// [`load`] with options (`map_location`, `mmap`, checksum verification).
pub fn load_with(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Value, CkptError> {
    let path = path.as_ref();
    if dcp::is_dcp_dir(path) {
        return dcp::load(path);
    }
    pt::load_with(path, opts)
}

/// A plain-data pickle (no tensors or storages) as a [`Value`]: dicts, lists, tuples, numbers,
/// strings and bytes, through the same allowlisted reader as `.pt` files (nothing executes).
/// Python 2 `str` objects that are not UTF-8 come back as bytes. `path` names the file in
/// errors.
pub fn read_pickle(path: impl AsRef<Path>) -> Result<Value, CkptError> {
    pt::read_plain_pickle(path.as_ref())
}

/// Writes `value` (no tensors) as one plain pickle (protocol 2), atomically: what Python's
/// `pickle.load` reads back (tuples, lists, dicts, numbers, strings, bytes).
pub fn write_pickle(path: impl AsRef<Path>, value: &Value) -> Result<(), CkptError> {
    pt::write_plain_pickle(path.as_ref(), value)
}

/// `torch.save(value, path)`: writes a zip-format `.pt` that `torch.load(weights_only=True)`
/// reads back with the same values, nesting, dtypes, views and tied storages. Atomic: temp file,
/// fsync, rename, fsync of the directory.
pub fn save(path: impl AsRef<Path>, value: &Value) -> Result<(), CkptError> {
    pt::save(path.as_ref(), value)
}

/// Serialises to an in-memory `.pt` image (what `save` writes).
pub fn to_pt_bytes(value: &Value) -> Result<Vec<u8>, CkptError> {
    pt::write_pt(value, Vec::new())
}
