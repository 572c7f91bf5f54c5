//! Training checkpoints in a directory: one torch-loadable `.pt` per save, written atomically,
//! `keep_last` retention, a `latest` pointer, and resume from the newest file that verifies
//! (every zip entry's CRC-32), skipping corrupt ones with a warning.
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{CkptError, Result};
use crate::keys::canonicalize_keys;
use crate::pt::LoadOptions;
use crate::value::Value;

const PREFIX: &str = "checkpoint-";
const SUFFIX: &str = ".pt";
/// Name of the pointer file holding the newest checkpoint's file name.
pub const LATEST: &str = "latest";

/// The fields of a training checkpoint, as one dict PyTorch can open:
/// `{epoch, global_step, model, optimizer, scheduler, sampler, rng, world_size, config, tandem_version}`.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingCheckpoint {
    pub epoch: i64,
    pub global_step: i64,
    /// The model's state dict (saved with canonical keys).
    pub model: Value,
    /// `optimizer.state_dict()` layout.
    pub optimizer: Value,
    pub scheduler: Value,
    pub sampler: Value,
    pub rng: Value,
    pub world_size: i64,
    pub config: Value,
    /// `GradScaler.state_dict()` of a float16 mixed-precision run (torch's recipe saves it
    /// under `scaler`); `Value::None` otherwise, and then not written.
    pub scaler: Value,
}

impl TrainingCheckpoint {
    pub fn to_value(&self) -> Result<Value> {
        let mut v = Value::dict_from([
            ("epoch", Value::Int(self.epoch)),
            ("global_step", Value::Int(self.global_step)),
            ("model", canonicalize_keys(&self.model)?),
            ("optimizer", self.optimizer.clone()),
            ("scheduler", self.scheduler.clone()),
            ("sampler", self.sampler.clone()),
            ("rng", self.rng.clone()),
            ("world_size", Value::Int(self.world_size)),
            ("config", self.config.clone()),
            ("tandem_version", Value::Str(env!("CARGO_PKG_VERSION").to_string())),
        ]);
        if !matches!(self.scaler, Value::None) {
            if let Value::Dict(items) = &mut v {
                items.push((Value::Str("scaler".into()), self.scaler.clone()));
            }
        }
        Ok(v)
    }

    /// Reads the fields back; a missing or mistyped field is an error naming it.
    pub fn from_value(v: &Value) -> Result<Self> {
        let field = |k: &str| {
            v.get(k).ok_or_else(|| CkptError::TrainingField {
                field: k.to_string(),
                problem: "missing".into(),
            })
        };
        let int = |k: &str| {
            let value = field(k)?;
            value.as_int().ok_or_else(|| CkptError::TrainingField {
                field: k.to_string(),
                problem: format!("expected an int, found a {}", value.type_name()),
            })
        };
        Ok(TrainingCheckpoint {
            epoch: int("epoch")?,
            global_step: int("global_step")?,
            model: field("model")?.clone(),
            optimizer: field("optimizer")?.clone(),
            scheduler: v.get("scheduler").cloned().unwrap_or(Value::None),
            sampler: v.get("sampler").cloned().unwrap_or(Value::None),
            rng: v.get("rng").cloned().unwrap_or(Value::None),
            world_size: int("world_size")?,
            config: v.get("config").cloned().unwrap_or(Value::None),
            scaler: v.get("scaler").cloned().unwrap_or(Value::None),
        })
    }
}

/// A directory of checkpoints `checkpoint-<name>.pt` plus a `latest` pointer.
#[derive(Clone, Debug)]
pub struct CheckpointManager {
    dir: PathBuf,
    keep_last: usize,
}

impl CheckpointManager {
    /// `keep_last == 0` keeps every checkpoint. Nothing touches the disk until the first save.
    pub fn new(dir: impl Into<PathBuf>, keep_last: usize) -> Self {
        CheckpointManager { dir: dir.into(), keep_last }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file a save under `name` (e.g. `step-1200`, `epoch-3`) writes.
    pub fn path_for(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{PREFIX}{name}{SUFFIX}"))
    }

    /// Names become file names: non-empty, no path separators, not hidden.
    pub(crate) fn check_name(&self, name: &str) -> Result<()> {
        if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(self.err(format!(
                "checkpoint name `{name}` must be non-empty, without `/` and not start with `.`"
            )));
        }
        Ok(())
    }

    fn err(&self, msg: impl Into<String>) -> CkptError {
        CkptError::Manager { path: self.dir.clone(), msg: msg.into() }
    }

    /// Saves `value` (state dicts inside it get canonical keys) atomically, moves `latest` to it
    /// and deletes the oldest checkpoints beyond `keep_last`. Call it on one rank only; see
    /// [`save_on_rank`](Self::save_on_rank).
    pub fn save(&self, name: &str, value: &Value) -> Result<PathBuf> {
        self.check_name(name)?;
        std::fs::create_dir_all(&self.dir).map_err(|e| CkptError::io(&self.dir, e))?;
        self.remove_stale_temps();
        let path = self.path_for(name);
        crate::pt::save(&path, &canonicalize_keys(value)?)?;
        let file_name = format!("{PREFIX}{name}{SUFFIX}\n");
        crate::atomic::write_atomic(&self.dir.join(LATEST), |f| {
            std::io::Write::write_all(f, file_name.as_bytes())
        })?;
        self.apply_retention(&path)?;
        Ok(path)
    }

    /// The distributed save: rank 0 writes, then every rank (rank 0 included, even when its write
    /// failed) calls `barrier`, so no rank can leave the others waiting. Ranks other than 0
    /// return `Ok(None)`; rank 0 returns its write's result after the barrier. The barrier is
    /// the caller's (tandem-ckpt knows nothing of process groups).
    pub fn save_on_rank<E: std::fmt::Display>(
        &self,
        rank: usize,
        name: &str,
        value: &Value,
        barrier: impl FnOnce() -> std::result::Result<(), E>,
    ) -> Result<Option<PathBuf>> {
        let written = if rank == 0 { self.save(name, value).map(Some) } else { Ok(None) };
        let synced = barrier().map_err(|e| {
            self.err(format!("barrier after saving `{name}` failed on rank {rank}: {e}"))
        });
        let written = written?;
        synced?;
        Ok(written)
    }

    /// Deletes temp files of checkpoint writes that never finished (a writer killed mid-save
    /// leaves one, as large as a checkpoint). Only the saving rank calls `save`, so no live write
    /// of this job can be hit. Failures are only logged: they cost disk space, not correctness.
    fn remove_stale_temps(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = |target: &str| {
                (target.starts_with(PREFIX) && target.ends_with(SUFFIX)) || target == LATEST
            };
            if crate::atomic::is_temp_for(&name, ours) {
                if let Err(e) = std::fs::remove_file(entry.path()) {
                    tracing::warn!("cannot remove stale temp file {}: {e}", entry.path().display());
                }
            }
        }
    }

    /// Checkpoint files in the directory, newest first (modification time, then name).
    pub fn list(&self) -> Result<Vec<PathBuf>> {
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(CkptError::io(&self.dir, e)),
        };
        let mut files: Vec<(SystemTime, PathBuf)> = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| CkptError::io(&self.dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !(name.starts_with(PREFIX) && name.ends_with(SUFFIX)) {
                continue;
            }
            let mtime =
                entry.metadata().and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
            files.push((mtime, entry.path()));
        }
        files.sort_by(|a, b| b.cmp(a));
        Ok(files.into_iter().map(|(_, p)| p).collect())
    }

    fn apply_retention(&self, just_written: &Path) -> Result<()> {
        if self.keep_last == 0 {
            return Ok(());
        }
        let files = self.list()?;
        let mut kept = 0;
        for f in files {
            if f == just_written || kept < self.keep_last.saturating_sub(1) {
                if f != just_written {
                    kept += 1;
                }
                continue;
            }
            std::fs::remove_file(&f).map_err(|e| CkptError::io(&f, e))?;
        }
        Ok(())
    }

    /// The newest checkpoint (by modification time) that reads and verifies, with its value.
    /// Corrupt or unreadable files are skipped with a warning. `Ok(None)` when there is none (a
    /// fresh start). The `latest` pointer is not trusted for this: a crash between writing a
    /// checkpoint and moving the pointer would leave it naming an older file.
    pub fn latest_valid(&self) -> Result<Option<(PathBuf, Value)>> {
        self.latest_valid_with(&LoadOptions::default())
    }

    pub fn latest_valid_with(&self, opts: &LoadOptions) -> Result<Option<(PathBuf, Value)>> {
        let candidates = self.list()?;
        let opts = LoadOptions { verify_checksums: true, ..opts.clone() };
        for path in candidates {
            match crate::pt::load_with(&path, &opts) {
                Ok(v) => return Ok(Some((path, v))),
                Err(e) => tracing::warn!("skipping checkpoint that does not verify: {e}"),
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::TensorData;

    fn value(step: i64) -> Value {
        Value::dict_from([
            ("global_step", Value::Int(step)),
            (
                "model",
                Value::dict_from([(
                    "module.w",
                    Value::Tensor(TensorData::from_f32(&[2], &[step as f32, 1.0])),
                )]),
            ),
        ])
    }

    fn names(m: &CheckpointManager) -> Vec<String> {
        let mut v: Vec<String> = m
            .list()
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn save_removes_temp_files_of_killed_writes_only() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path(), 2);
        let stale = dir.path().join(".checkpoint-step-3.pt.Ab12Cd.tmp");
        let stale_ptr = dir.path().join(".latest.XyZ987.tmp");
        let foreign = dir.path().join(".notes.txt.Qw34Er.tmp");
        let plain = dir.path().join("checkpoint-step-3.pt.tmp");
        for f in [&stale, &stale_ptr, &foreign, &plain] {
            std::fs::write(f, b"partial").unwrap();
        }
        m.save("step-4", &value(4)).unwrap();
        assert!(!stale.exists() && !stale_ptr.exists(), "temp files of checkpoint writes must go");
        assert!(foreign.exists() && plain.exists(), "files that are not our temp files must stay");
        assert_eq!(names(&m), vec!["checkpoint-step-4.pt"]);
    }

    #[test]
    fn keeps_last_n_moves_latest_and_writes_canonical_keys() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path().join("ckpt"), 2);
        for step in 1..=4 {
            m.save(&format!("step-{step}"), &value(step)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(15)); // distinct mtimes
        }
        assert_eq!(names(&m), ["checkpoint-step-3.pt", "checkpoint-step-4.pt"]);
        let latest = std::fs::read_to_string(m.dir().join(LATEST)).unwrap();
        assert_eq!(latest.trim(), "checkpoint-step-4.pt");
        let (path, v) = m.latest_valid().unwrap().unwrap();
        assert_eq!(path, m.path_for("step-4"));
        assert_eq!(v.get("global_step"), Some(&Value::Int(4)));
        assert!(v.get("model").unwrap().get("w").is_some(), "saved with canonical keys");
        // No temp files are left behind.
        let all: Vec<_> =
            std::fs::read_dir(m.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(all.len(), 3, "{all:?}");
    }

    #[test]
    fn resume_skips_corrupt_and_truncated_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path(), 0);
        for step in 1..=3 {
            m.save(&format!("s{step}"), &value(step)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(15));
        }
        // Newest: one flipped byte inside the tensor data (CRC catches it).
        let p3 = m.path_for("s3");
        let mut b = std::fs::read(&p3).unwrap();
        let i = b.windows(6).position(|w| w == b"data/0").unwrap() + 6;
        let pos = (i + 4 + 63) & !63;
        b[pos] ^= 0xff;
        std::fs::write(&p3, &b).unwrap();
        // Second newest: truncated.
        let p2 = m.path_for("s2");
        let b = std::fs::read(&p2).unwrap();
        std::fs::write(&p2, &b[..b.len() - 30]).unwrap();
        let (path, v) = m.latest_valid().unwrap().unwrap();
        assert_eq!(path, m.path_for("s1"));
        assert_eq!(v.get("global_step"), Some(&Value::Int(1)));
    }

    #[test]
    fn a_stale_latest_pointer_does_not_hide_a_newer_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path(), 0);
        m.save("a", &value(1)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(15));
        m.save("b", &value(2)).unwrap();
        // As if the process died after writing `b` but before moving the pointer.
        std::fs::write(dir.path().join(LATEST), "checkpoint-a.pt\n").unwrap();
        assert_eq!(m.latest_valid().unwrap().unwrap().0, m.path_for("b"));
    }

    #[test]
    fn empty_directory_means_fresh_start() {
        let dir = tempfile::tempdir().unwrap();
        assert!(CheckpointManager::new(dir.path().join("none"), 3)
            .latest_valid()
            .unwrap()
            .is_none());
    }

    #[test]
    fn every_rank_reaches_the_barrier_even_when_rank0_fails() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be makes rank 0's write fail.
        let blocker = dir.path().join("blocked");
        std::fs::write(&blocker, b"x").unwrap();
        let m = CheckpointManager::new(&blocker, 1);
        let mut reached = false;
        let r = m.save_on_rank(0, "s", &value(1), || {
            reached = true;
            Ok::<(), String>(())
        });
        assert!(reached, "rank 0 must reach the barrier after a failed write");
        assert!(r.is_err());
        let good = CheckpointManager::new(dir.path().join("ok"), 1);
        let mut calls = 0;
        assert!(good
            .save_on_rank(1, "s", &value(1), || {
                calls += 1;
                Ok::<(), String>(())
            })
            .unwrap()
            .is_none());
        assert_eq!(calls, 1);
        assert!(good.list().unwrap().is_empty(), "only rank 0 writes");
        let e = good.save_on_rank(0, "s", &value(1), || Err("peer died")).unwrap_err();
        assert!(e.to_string().contains("peer died"), "{e}");
    }

    #[test]
    fn training_checkpoint_round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let t = TrainingCheckpoint {
            epoch: 3,
            global_step: 300,
            model: Value::dict_from([("w", Value::Tensor(TensorData::from_f32(&[1], &[0.5])))]),
            optimizer: Value::dict_from([("state", Value::new_dict())]),
            scheduler: Value::None,
            sampler: Value::dict_from([("epoch", Value::Int(3))]),
            rng: Value::Bytes(vec![1, 2, 3]),
            world_size: 4,
            config: Value::dict_from([("lr", Value::Float(0.1))]),
            scaler: Value::None,
        };
        let m = CheckpointManager::new(dir.path(), 1);
        m.save("epoch-3", &t.to_value().unwrap()).unwrap();
        let (_, v) = m.latest_valid().unwrap().unwrap();
        assert_eq!(TrainingCheckpoint::from_value(&v).unwrap(), t);
        assert_eq!(
            v.get("tandem_version").and_then(Value::as_str),
            Some(env!("CARGO_PKG_VERSION"))
        );
        assert!(TrainingCheckpoint::from_value(&Value::new_dict())
            .unwrap_err()
            .to_string()
            .contains("epoch"));
    }

    #[test]
    fn a_missing_or_mistyped_training_field_is_named() {
        let ck = |epoch: Option<Value>, world_size: Value| {
            let mut items = vec![("global_step", Value::Int(10)), ("model", Value::new_dict())];
            items.push(("optimizer", Value::new_dict()));
            items.push(("world_size", world_size));
            items.extend(epoch.map(|e| ("epoch", e)));
            Value::dict_from(items)
        };
        match TrainingCheckpoint::from_value(&ck(None, Value::Int(2))) {
            Err(CkptError::TrainingField { field, problem }) => {
                assert_eq!((field.as_str(), problem.as_str()), ("epoch", "missing"))
            }
            other => panic!("expected TrainingField, got {other:?}"),
        }
        let err =
            TrainingCheckpoint::from_value(&ck(Some(Value::Int(1)), Value::Str("two".into())))
                .unwrap_err()
                .to_string();
        assert_eq!(err, "training checkpoint field `world_size`: expected an int, found a str");
    }
}
