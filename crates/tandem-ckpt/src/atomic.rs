//! Atomic file replacement: write a temp file in the target's directory, fsync it, rename it over
//! the target, fsync the directory. A crash leaves either the old file or the new one, never a
//! torn one (the torn temp file has a `.tmp` name that readers ignore).
use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::error::{CkptError, Result};

/// Creates `path` atomically with whatever `fill` writes into the file.
pub fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<()> {
    let (dir, mut tmp) = temp_beside(path)?;
    fill(tmp.as_file_mut()).map_err(|e| CkptError::io(path, e))?;
    tmp.as_file_mut().flush().map_err(|e| CkptError::io(path, e))?;
    tmp.as_file().sync_all().map_err(|e| CkptError::io(path, e))?;
    tmp.persist(path).map_err(|e| CkptError::io(path, e.error))?;
    sync_dir(&dir)
}

/// A temp file `.<name>.XXXXXX.tmp` in `path`'s directory (so the final rename stays on one
/// filesystem), and that directory. [`is_temp_for`] recognises these names.
fn temp_beside(path: &Path) -> Result<(std::path::PathBuf, tempfile::NamedTempFile)> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(|e| CkptError::io(&dir, e))?;
    Ok((dir, tmp))
}

/// True when `file_name` is a temp file [`write_atomic`] makes for a target whose name passes
/// `target_name_ok` (what a killed writer leaves behind).
pub fn is_temp_for(file_name: &str, target_name_ok: impl Fn(&str) -> bool) -> bool {
    let Some(inner) = file_name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    // inner = "<target name>.<random>"
    inner
        .rsplit_once('.')
        .is_some_and(|(target, random)| !random.is_empty() && target_name_ok(target))
}

/// fsync of a directory, so a rename inside it survives a crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(|e| CkptError::io(dir, e))?;
    d.sync_all().map_err(|e| CkptError::io(dir, e))
}
