//! Checkpoint saves that do not stop training: the caller hands over a [`Value`] (which owns host
//! copies of the tensors: building it is the only part training waits for), and a background
//! thread writes it with [`CheckpointManager::save`] — temp file, fsync, rename, directory fsync,
//! `latest`, keep-last retention, exactly as a synchronous save.
//!
//! At most one save is in flight: a new save first waits for the previous one. A failed write is
//! not lost: it is returned by the next [`save`](AsyncCheckpointManager::save) (which then does
//! not start) or by [`wait`](AsyncCheckpointManager::wait), naming the file; dropping the manager
//! with a save in flight waits for it and logs a failure. One plain thread per save (not a pool):
//! saves are minutes apart, and a fresh thread cannot carry state from a failed one.
use std::path::PathBuf;
use std::thread::JoinHandle;

use crate::error::{CkptError, Result};
use crate::manager::CheckpointManager;
use crate::value::Value;

/// A [`CheckpointManager`] whose saves run on a background thread.
#[derive(Debug)]
pub struct AsyncCheckpointManager {
    manager: CheckpointManager,
    in_flight: Option<InFlight>,
}

#[derive(Debug)]
struct InFlight {
    path: PathBuf,
    writer: JoinHandle<Result<PathBuf>>,
}

impl AsyncCheckpointManager {
    pub fn new(manager: CheckpointManager) -> Self {
        AsyncCheckpointManager { manager, in_flight: None }
    }

    pub fn manager(&self) -> &CheckpointManager {
        &self.manager
    }

    /// Starts saving `value` under `name` and returns the file it will write. Waits for the
    /// previous save first; if that one failed, its error is returned and this save does not
    /// start (the caller learns of the failure at the first chance, the value is not written
    /// over a broken directory). A bad `name` is an error here, not in the background.
    pub fn save(&mut self, name: &str, value: Value) -> Result<PathBuf> {
        self.wait()?;
        self.manager.check_name(name)?;
        let path = self.manager.path_for(name);
        let (manager, name_owned) = (self.manager.clone(), name.to_string());
        let writer = std::thread::Builder::new()
            .name("tandem-ckpt-writer".into())
            .spawn(move || manager.save(&name_owned, &value))
            .map_err(|e| CkptError::io(&path, e))?;
        self.in_flight = Some(InFlight { path: path.clone(), writer });
        Ok(path)
    }

    /// True while a save is being written.
    pub fn in_flight(&self) -> bool {
        self.in_flight.as_ref().is_some_and(|f| !f.writer.is_finished())
    }

    /// Waits for the save in flight, if any: `Ok(Some(path))` when it was written, `Ok(None)`
    /// when nothing was in flight, its error when it failed.
    pub fn wait(&mut self) -> Result<Option<PathBuf>> {
        let Some(InFlight { path, writer }) = self.in_flight.take() else { return Ok(None) };
        match writer.join() {
            Ok(written) => written.map(Some),
            Err(panic) => Err(CkptError::Manager {
                path,
                msg: format!(
                    "the background checkpoint writer panicked: {}",
                    panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default()
                ),
            }),
        }
    }
}

impl Drop for AsyncCheckpointManager {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!("an asynchronous checkpoint save failed and nobody waited for it: {e}");
        }
    }
}
