//! Saving: the collective protocol (where the files go, every rank writes, all agree, rank 0
//! commits and prunes), synchronous or with the writing on a background thread, and the
//! directory's list of checkpoints, complete and not.
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::SystemTime;

use tandem_ckpt::keys::canonicalize_keys;
use tandem_ckpt::Value;
use tandem_comm::{ProcessGroup, ReduceOp};

use super::manifest::{self, rank_file_name, Manifest, ShardEntry, MANIFEST, REPLICATED};
use super::reader::Saved;
use super::{comm, file, invalid, io, CheckpointError, Result, ShardDict, TrainingStateDict};

/// Name of the file holding the newest checkpoint's name (for people and scripts; loading
/// looks at the checkpoints themselves).
pub const LATEST: &str = "latest";
const FILE_PREFIX: &str = "checkpoint-";
const FILE_SUFFIX: &str = ".pt";
/// Bound on one rank's list of shard slices exchanged before a save.
const MAX_PLAN_BYTES: usize = 64 << 20;

/// `path` itself, or — when it is a run's [`LATEST`] file — the checkpoint it names (in the
/// same directory), so `RUN/checkpoints/latest` can be given wherever a checkpoint is read. The
/// name is checked to stay inside that directory.
pub fn resolve_latest(path: &Path) -> Result<PathBuf> {
    if path.file_name().is_none_or(|n| n != LATEST) || !path.is_file() {
        return Ok(path.to_path_buf());
    }
    let len = std::fs::metadata(path).map_err(io("reading", path))?.len();
    if len > 4096 {
        return Err(invalid(path, format!("{len} bytes, more than a checkpoint's name")));
    }
    let text = std::fs::read_to_string(path).map_err(io("reading", path))?;
    let name = text.trim();
    if !manifest::plain_name(name) {
        return Err(invalid(path, format!("{name:?} is not a checkpoint name in its directory")));
    }
    Ok(path.with_file_name(name))
}

/// The checkpoints of one run in a directory; see the [module](super) for the layout.
#[derive(Debug)]
pub struct Checkpointer {
    dir: PathBuf,
    keep_last: usize,
    background: bool,
    pending: Option<Pending>,
}

/// A save whose files are written (or being written, on `writer`) and not yet committed.
#[derive(Debug)]
struct Pending {
    /// Where the files go (`target`, or `target.new` beside an existing checkpoint).
    staged: PathBuf,
    target: PathBuf,
    /// The manifest rank 0 writes last (`None`: a single-file checkpoint).
    manifest: Option<Manifest>,
    writer: Option<JoinHandle<Result<()>>>,
    rank: usize,
}

/// A checkpoint in the directory, complete or not.
#[derive(Clone, Debug)]
struct Listed {
    path: PathBuf,
    complete: bool,
    /// When it was committed (its file's or manifest's modification time).
    time: SystemTime,
}

impl Checkpointer {
    /// `keep_last == 0` keeps every checkpoint. Nothing touches the disk until the first save.
    pub fn new(dir: impl Into<PathBuf>, keep_last: usize) -> Self {
        Checkpointer { dir: dir.into(), keep_last, background: false, pending: None }
    }

    /// Writes the files on a background thread: a save returns once the state is staged (the
    /// values are host copies) and the checkpoint is committed at the next save or
    /// [`Checkpointer::settle`], where a failed write on any rank is every rank's error.
    pub fn background(mut self, on: bool) -> Self {
        self.background = on;
        self
    }

    /// Whether saves are written on a background thread ([`Checkpointer::background`]).
    pub fn is_background(&self) -> bool {
        self.background
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where a save under `name` ends up: `DIR/checkpoint-NAME.pt` without shards, `DIR/NAME/`
    /// with.
    pub fn path_for(&self, name: &str, sharded: bool) -> PathBuf {
        if sharded {
            self.dir.join(name)
        } else {
            self.dir.join(format!("{FILE_PREFIX}{name}{FILE_SUFFIX}"))
        }
    }

    /// True while a background save is being written or waits to be committed.
    pub fn in_flight(&self) -> bool {
        self.pending.is_some()
    }

    /// [`Checkpointer::save`] of the state `build` makes, with no second copy of it when the
    /// save is synchronous: `build` runs inside `tandem_nn::convert::lend`, so every tensor is
    /// a view of its own memory, written and dropped before this returns (what lets a head of
    /// several GiB be saved without doubling it). A background save builds copies: training
    /// goes on while they are written. Nothing may train the model on another thread during
    /// the call.
    pub fn save_built<E: From<CheckpointError>>(
        &mut self,
        group: &ProcessGroup,
        name: &str,
        build: impl FnOnce() -> Result<TrainingStateDict, E>,
    ) -> Result<PathBuf, E> {
        let state = if self.background {
            build()?
        } else {
            // SAFETY: `save` below writes the dict and drops it before it returns; nothing on
            // this thread writes the lent tensors in between, and no other thread trains.
            unsafe { tandem_nn::convert::lend(build)? }
        };
        Ok(self.save(group, name, state)?)
    }

    /// Saves `state` as checkpoint `name` (a collective: every rank calls it with its own
    /// state). Returns where the checkpoint is (or, in the background, will be). A save in
    /// flight is committed first, and its failure returned (this save does not start).
    pub fn save(
        &mut self,
        group: &ProcessGroup,
        name: &str,
        state: TrainingStateDict,
    ) -> Result<PathBuf> {
        self.settle(group)?;
        self.check_names(name, &state.shards)?;
        let (rank, world) = (group.rank(), group.size());
        let TrainingStateDict { global_step, epoch, replicated, shards } = state;
        let pending = if shards.is_empty() {
            let target = self.path_for(name, false);
            Pending { staged: target.clone(), target, manifest: None, writer: None, rank }
        } else {
            let (staged, target) = self.begin(name, rank, group)?;
            let manifest = plan(group, &staged, global_step, epoch, &shards)?;
            Pending { staged, target, manifest: Some(manifest), writer: None, rank }
        };
        let job: Option<Box<dyn FnOnce() -> Result<()> + Send>> = if pending.manifest.is_none() {
            (rank == 0).then(|| {
                let (dir, target) = (self.dir.clone(), pending.target.clone());
                Box::new(move || write_file(&dir, &target, &replicated)) as Box<_>
            })
        } else {
            let staged = pending.staged.clone();
            let replicated = (rank == 0).then_some(replicated);
            Some(Box::new(move || write_rank_files(&staged, rank, world, replicated, shards)))
        };
        let target = pending.target.clone();
        if self.background {
            let mut pending = pending;
            if let Some(job) = job {
                let writer = std::thread::Builder::new()
                    .name("tandem-ckpt-writer".into())
                    .spawn(job)
                    .map_err(io("starting the checkpoint writer for", &target))?;
                pending.writer = Some(writer);
            }
            self.pending = Some(pending);
            return Ok(target);
        }
        let written = job.map_or(Ok(()), |job| job());
        self.commit(&pending, written, group)?;
        Ok(target)
    }

    /// Commits the background save in flight, if any (a collective: every rank calls it; each
    /// waits for its own files first) and returns where it is. Its failure on any rank is every
    /// rank's error.
    pub fn settle(&mut self, group: &ProcessGroup) -> Result<Option<PathBuf>> {
        let Some(mut p) = self.pending.take() else { return Ok(None) };
        let written = match p.writer.take() {
            None => Ok(()),
            Some(w) => w.join().unwrap_or_else(|_| {
                Err(invalid(&p.staged, "the checkpoint writer thread panicked"))
            }),
        };
        if let Some(why) = group.failure() {
            // A rank died before the save was committed (live recovery re-forms the world):
            // nobody can agree on it, so it stays uncommitted (a directory without a manifest
            // is never resumed and is pruned later). This rank's own write failing is still
            // its error.
            written?;
            if p.rank == 0 {
                tracing::warn!(
                    "{}: left uncommitted (the world broke before it was committed: {why})",
                    p.staged.display()
                );
            }
            return Ok(None);
        }
        self.commit(&p, written, group)?;
        Ok(Some(p.target))
    }

    /// Names become file names: non-empty, no path separators, not hidden, no `.` (a `.new`
    /// or `.old` beside a checkpoint is a swap in progress). Shard names: non-empty, unique.
    fn check_names(&self, name: &str, shards: &[ShardDict]) -> Result<()> {
        if name.is_empty() || name.contains(['/', '\\', '.']) {
            let why = format!("checkpoint name `{name}` must be non-empty, without `/` or `.`");
            return Err(invalid(&self.dir, why));
        }
        for (i, s) in shards.iter().enumerate() {
            if s.name.is_empty() || shards[..i].iter().any(|o| o.name == s.name) {
                let why = format!("shard name `{}` is empty or given twice", s.name);
                return Err(invalid(&self.dir, why));
            }
        }
        Ok(())
    }

    /// Agrees on where sharded checkpoint `name` goes: `DIR/name`, or `DIR/name.new` beside an
    /// existing one (a collective). Returns (where the files go, where it ends up).
    fn begin(&self, name: &str, rank: usize, group: &ProcessGroup) -> Result<(PathBuf, PathBuf)> {
        let target = self.path_for(name, true);
        // Rank 0 looks, everyone acts on its answer (a rank looking itself could see the
        // directory another rank has just created).
        let mut exists = vec![u8::from(rank == 0 && target.exists())];
        group.broadcast_bytes(&mut exists, 0).map_err(comm("agreeing on the checkpoint's name"))?;
        let staged =
            if exists[0] == 1 { self.dir.join(format!("{name}.new")) } else { target.clone() };
        let cleared = match (rank, staged.exists() && staged != target) {
            (0, true) => {
                std::fs::remove_dir_all(&staged).map_err(io("removing an unfinished", &staged))
            }
            _ => Ok(()),
        };
        let synced = group.barrier().map_err(comm("barrier before writing the checkpoint files"));
        cleared?;
        synced?;
        Ok((staged, target))
    }

    /// Every rank's files are written (`written` is this rank's outcome): all agree, rank 0
    /// writes the manifest, puts the checkpoint in place, moves `latest` and prunes, and all
    /// meet again. Pruning comes last, once the new checkpoint is complete, durable and in
    /// place.
    fn commit(&self, p: &Pending, written: Result<()>, group: &ProcessGroup) -> Result<()> {
        let mut all_written = [if written.is_ok() { 1.0f64 } else { 0.0 }];
        let agreed = group
            .all_reduce(&mut all_written, ReduceOp::Min)
            .map_err(comm("agreeing that every checkpoint file is written"));
        written?;
        agreed?;
        if all_written[0] < 1.0 {
            let why = "another rank could not write its checkpoint file (see its error)";
            return Err(invalid(&p.target, why));
        }
        let finished = if p.rank == 0 { self.finish(p) } else { Ok(()) };
        let synced = group.barrier().map_err(comm("barrier after committing the checkpoint"));
        finished?;
        synced
    }

    /// Rank 0's part of a commit.
    fn finish(&self, p: &Pending) -> Result<()> {
        if let Some(m) = &p.manifest {
            manifest::write(&p.staged, m)?;
            swap_in(&p.staged, &p.target)?;
        }
        let name = p.target.file_name().map(|n| n.to_string_lossy().into_owned());
        let line = format!("{}\n", name.unwrap_or_default());
        tandem_ckpt::atomic::write_atomic(&self.dir.join(LATEST), |f| {
            std::io::Write::write_all(f, line.as_bytes())
        })
        .map_err(file(&self.dir.join(LATEST)))?;
        self.prune(&p.target)
    }

    /// Deletes the oldest complete checkpoints beyond `keep_last` (never `newest`), incomplete
    /// ones committed before `newest` (a crashed or uncommitted save's leftovers) and temp
    /// files of killed writes. A failure to delete is only reported: it costs disk space.
    fn prune(&self, newest: &Path) -> Result<()> {
        let all = self.list()?;
        let newest_time = all.iter().find(|l| l.path == newest).map(|l| l.time);
        let complete: Vec<&Listed> = all.iter().rev().filter(|l| l.complete).collect();
        let mut kept = usize::from(newest_time.is_some());
        for l in complete {
            if l.path == newest {
                continue;
            }
            if self.keep_last == 0 || kept < self.keep_last {
                kept += 1;
                continue;
            }
            remove(&l.path);
        }
        for l in all.iter().filter(|l| !l.complete) {
            if newest_time.is_some_and(|t| l.time <= t) && l.path != newest {
                remove(&l.path);
            }
        }
        self.remove_stale_temps();
        Ok(())
    }

    /// Temp files of single-file writes that never finished (a writer killed mid-save leaves
    /// one, as large as a checkpoint). Only rank 0 writes them, so no live write is hit.
    fn remove_stale_temps(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours = |target: &str| {
                (target.starts_with(FILE_PREFIX) && target.ends_with(FILE_SUFFIX))
                    || target == LATEST
            };
            if tandem_ckpt::atomic::is_temp_for(&name, ours) {
                remove(&entry.path());
            }
        }
    }

    /// The checkpoints in the directory, oldest first (commit time, then name): files
    /// `checkpoint-*.pt` and directories (complete with a manifest). A `NAME.new`/`NAME.old`
    /// beside one is a swap in progress, never a checkpoint.
    fn list(&self) -> Result<Vec<Listed>> {
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("reading", &self.dir)(e)),
        };
        let mtime = |p: &Path| {
            std::fs::metadata(p).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH)
        };
        let mut out = Vec::new();
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with('.') {
                continue;
            }
            if path.is_dir() {
                if name.contains('.') {
                    continue;
                }
                let manifest = path.join(MANIFEST);
                let complete = manifest.is_file();
                let time = if complete { mtime(&manifest) } else { mtime(&path) };
                out.push(Listed { path, complete, time });
            } else if name.starts_with(FILE_PREFIX) && name.ends_with(FILE_SUFFIX) {
                out.push(Listed { time: mtime(&path), path, complete: true });
            }
        }
        out.sort_by(|a, b| (a.time, &a.path).cmp(&(b.time, &b.path)));
        Ok(out)
    }

    /// Paths of the complete checkpoints, oldest first.
    pub fn complete(&self) -> Result<Vec<PathBuf>> {
        Ok(self.list()?.into_iter().filter(|l| l.complete).map(|l| l.path).collect())
    }

    /// The newest complete checkpoint that reads (`None`: a fresh start). A file whose
    /// checksums fail or a manifest that does not parse is skipped with a warning; so is a
    /// directory without a manifest (an unfinished save).
    pub fn latest(&self) -> Result<Option<Saved>> {
        for l in self.list()?.into_iter().rev() {
            if !l.complete {
                tracing::warn!("{}: no {MANIFEST} (an unfinished save); skipped", l.path.display());
                continue;
            }
            match Saved::open(&l.path) {
                Ok(saved) => return Ok(Some(saved)),
                Err(e) => tracing::warn!("skipping checkpoint that does not read: {e}"),
            }
        }
        Ok(None)
    }
}

impl Drop for Checkpointer {
    /// A background save nobody settled: its writing is finished (so no half-written temp
    /// file is left by an exiting process) but it cannot be committed without the other ranks,
    /// so it stays uncommitted, and says so.
    fn drop(&mut self) {
        let Some(p) = self.pending.take() else { return };
        let written = p.writer.map_or(Ok(()), |w| {
            w.join().unwrap_or_else(|_| Err(invalid(&p.staged, "the writer thread panicked")))
        });
        match written {
            Err(e) => tracing::warn!("an unsettled background checkpoint save failed: {e}"),
            Ok(()) if p.manifest.is_some() => tracing::warn!(
                "{}: a background save was never settled; it stays uncommitted",
                p.staged.display()
            ),
            Ok(()) => {}
        }
    }
}

/// The manifest of a sharded save: every rank's slices, gathered (a collective) and checked
/// on every rank alike, so a bad plan fails everywhere before anything is written.
fn plan(
    group: &ProcessGroup,
    dir: &Path,
    global_step: u64,
    epoch: u64,
    shards: &[ShardDict],
) -> Result<Manifest> {
    let entries: Vec<ShardEntry> = shards
        .iter()
        .map(|s| ShardEntry { name: s.name.clone(), slice: s.slice.clone() })
        .collect();
    let mine = serde_json::to_vec(&entries).map_err(|e| invalid(dir, e.to_string()))?;
    let all = group
        .all_gather_bytes_at_most(&mine, MAX_PLAN_BYTES)
        .map_err(comm("exchanging the shards each rank saves"))?;
    let mut ranks = Vec::with_capacity(all.len());
    for (r, bytes) in all.iter().enumerate() {
        let shards: Vec<ShardEntry> = serde_json::from_slice(bytes)
            .map_err(|e| invalid(dir, format!("rank {r}'s shard list: {e}")))?;
        ranks.push(shards);
    }
    manifest::check(dir, manifest::build(global_step, epoch, ranks))
}

/// What the manifest says of `shards`.
fn entries_of(shards: &[ShardDict]) -> Vec<ShardEntry> {
    shards.iter().map(|s| ShardEntry { name: s.name.clone(), slice: s.slice.clone() }).collect()
}

/// A single-file checkpoint (state dicts inside get canonical keys), atomically.
fn write_file(dir: &Path, target: &Path, value: &Value) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let value = canonicalize_keys(value).map_err(file(target))?;
    tandem_ckpt::save(target, &value).map_err(file(target))
}

/// This rank's files of a sharded checkpoint: its rank file, and rank 0's replicated file.
fn write_rank_files(
    dir: &Path,
    rank: usize,
    world: usize,
    replicated: Option<Value>,
    shards: Vec<ShardDict>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let value = Value::dict_from(shards.into_iter().map(|s| (s.name, s.value)));
    let path = dir.join(rank_file_name(rank, world));
    tandem_ckpt::save(&path, &value).map_err(file(&path))?;
    if let Some(value) = replicated {
        let path = dir.join(REPLICATED);
        let value = canonicalize_keys(&value).map_err(file(&path))?;
        tandem_ckpt::save(&path, &value).map_err(file(&path))?;
    }
    Ok(())
}

/// Puts the complete checkpoint `new` in `target`'s place and syncs the parent directory:
/// the old one (if any) moves aside, the new one in, then the old one goes.
fn swap_in(new: &Path, target: &Path) -> Result<()> {
    let parent = target.parent().unwrap_or(Path::new("."));
    if new != target {
        let old = target.with_extension("old");
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
        }
        let had_target = target.exists();
        if had_target {
            std::fs::rename(target, &old).map_err(io("moving aside", target))?;
        }
        std::fs::rename(new, target).map_err(io("moving into place", new))?;
        if had_target {
            sync(parent)?;
            remove(&old);
        }
    }
    sync(parent)
}

fn sync(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io("syncing", dir))
}

fn remove(path: &Path) {
    let removed =
        if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
    if let Err(e) = removed {
        tracing::warn!("cannot remove old checkpoint {}: {e}", path.display());
    }
}

/// Writes a complete sharded checkpoint from one process (a converter's output: every rank's
/// shards given at once, `ranks[r]` rank r's): the files, then the manifest, checked as a
/// load checks it. `dir` must not hold another checkpoint's files.
pub fn write_sharded(
    dir: &Path,
    global_step: u64,
    epoch: u64,
    replicated: Value,
    ranks: Vec<Vec<ShardDict>>,
) -> Result<()> {
    let world = ranks.len();
    let entries = ranks.iter().map(|shards| entries_of(shards)).collect();
    let manifest = manifest::check(dir, manifest::build(global_step, epoch, entries))?;
    let mut replicated = Some(replicated);
    for (r, shards) in ranks.into_iter().enumerate() {
        write_rank_files(dir, r, world, replicated.take(), shards)?;
    }
    manifest::write(dir, &manifest)?;
    sync(dir.parent().unwrap_or(Path::new(".")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latest_file_stands_for_the_checkpoint_it_names_inside_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let latest = dir.path().join(LATEST);
        std::fs::write(&latest, "step-00000007\n").unwrap();
        assert_eq!(resolve_latest(&latest).unwrap(), dir.path().join("step-00000007"));
        // Any other path is itself, a missing `latest` too (the reader names it).
        let other = dir.path().join("checkpoint-x.pt");
        assert_eq!(resolve_latest(&other).unwrap(), other);
        let absent = dir.path().join("sub").join(LATEST);
        assert_eq!(resolve_latest(&absent).unwrap(), absent);
        for bad in ["../../etc/passwd\n", "a/b\n", "\n"] {
            std::fs::write(&latest, bad).unwrap();
            let e = resolve_latest(&latest).unwrap_err().to_string();
            assert!(e.contains("latest") && e.contains("not a checkpoint name"), "{bad:?}: {e}");
        }
    }
}
