//! The face recipe's checkpoint. The PartialFC head's centres and their optimizer state differ
//! per rank, the backbone and the rest are replicated, so a checkpoint is a directory:
//!
//! ```text
//! checkpoints/step-00000120/
//!   replicated.pt               rank 0: backbone, optimizer state without the head's entry,
//!                               scheduler, GradScaler, sampler position, counters, config
//!   head-rank-00001-of-00002.pt every rank: its class range, centres, their optimizer state
//!                               and its own BatchNorm statistics (broadcast_buffers=False)
//!   manifest.json               written last by rank 0, once every file is on disk: a
//!                               directory without one is an incomplete save and never resumed
//! ```
//!
//! Every file is written atomically. A resume on another world size reads the head files whose
//! class ranges overlap its own and takes the rows it needs (centres and their optimizer state
//! alike), so the head is re-split rather than lost; arcface_torch's per-rank
//! `checkpoint_gpu_{rank}.pt` can only resume on the world size that wrote it.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tandem_ckpt::{CkptError, TensorData, Value};
use tandem_comm::{CommError, ProcessGroup};
use tandem_partial_fc::ClassSplit;

/// Why a face checkpoint could not be written or read; each names the file or step at fault.
#[derive(Debug, thiserror::Error)]
pub enum FaceCheckpointError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: CkptError,
    },
    #[error("{what}")]
    Comm {
        what: String,
        #[source]
        source: Box<CommError>,
    },
    #[error("{}: {why}", path.display())]
    Invalid { path: PathBuf, why: String },
}

type Result<T> = std::result::Result<T, FaceCheckpointError>;

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> FaceCheckpointError {
    let path = path.to_path_buf();
    move |source| FaceCheckpointError::Io { what, path, source }
}

fn file(path: &Path) -> impl FnOnce(CkptError) -> FaceCheckpointError {
    let path = path.to_path_buf();
    move |source| FaceCheckpointError::File { path, source }
}

fn comm(what: &str) -> impl FnOnce(CommError) -> FaceCheckpointError {
    let what = what.to_string();
    move |source| FaceCheckpointError::Comm { what, source: Box::new(source) }
}

fn invalid(path: &Path, why: impl Into<String>) -> FaceCheckpointError {
    FaceCheckpointError::Invalid { path: path.to_path_buf(), why: why.into() }
}

pub const FORMAT: &str = "tandem-partial-fc-1";
pub const MANIFEST: &str = "manifest.json";
pub const REPLICATED: &str = "replicated.pt";

/// `manifest.json`: what the directory holds and how the classes were split.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// `tandem-partial-fc-1`.
    pub format: String,
    pub world_size: usize,
    pub global_step: u64,
    pub epoch: u64,
    pub num_classes: usize,
    pub embedding_size: usize,
    pub replicated: String,
    /// One per rank, in rank order.
    pub heads: Vec<HeadFile>,
}

/// One rank's head file and its class range `start .. start + len`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HeadFile {
    pub file: String,
    pub start: usize,
    pub len: usize,
}

pub fn head_file_name(rank: usize, world: usize) -> String {
    format!("head-rank-{rank:05}-of-{world:05}.pt")
}

/// What the save writes besides the files' contents.
#[derive(Clone, Debug)]
pub struct SaveInfo {
    pub rank: usize,
    pub world: usize,
    pub global_step: u64,
    pub epoch: u64,
    pub num_classes: usize,
    pub embedding_size: usize,
}

/// The checkpoints of one run: `dir/step-NNNNNNNN/`, the newest `keep_last` kept.
#[derive(Debug)]
pub struct FaceCheckpoints {
    dir: PathBuf,
    keep_last: usize,
    background: bool,
    /// A background save whose files are being written (committed at the next save or
    /// [`FaceCheckpoints::settle`]).
    pending: Option<Pending>,
}

/// A save in flight: this rank's writer thread and where the checkpoint goes.
#[derive(Debug)]
struct Pending {
    dir: PathBuf,
    target: PathBuf,
    info: SaveInfo,
    writer: std::thread::JoinHandle<Result<()>>,
}

impl FaceCheckpoints {
    pub fn new(dir: PathBuf, keep_last: usize) -> Self {
        FaceCheckpoints { dir, keep_last: keep_last.max(1), background: false, pending: None }
    }

    /// Writes the files on a background thread: a save returns once the state is staged (the
    /// values are host copies), and the checkpoint is committed (every rank's files durable,
    /// then rank 0's manifest) at the next save or at [`FaceCheckpoints::settle`]. A failed
    /// write is reported there, naming the file; the checkpoints before it stay intact.
    pub fn background(mut self, on: bool) -> Self {
        self.background = on;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A collective: every rank writes its head file (rank 0 also `replicated`), all meet, rank
    /// 0 writes the manifest and prunes old checkpoints, all meet again. An error on any rank
    /// still reaches every collective, so no rank is left waiting. In the background (see
    /// [`FaceCheckpoints::background`]) the writing goes on after the call returns and the rest
    /// happens at the next save or [`FaceCheckpoints::settle`].
    ///
    /// A checkpoint of this name may exist already (a run resumed on another world size saves
    /// at the step it started from). Then the new one is written beside it as `NAME.new` and
    /// swapped in only once complete: at every moment one complete copy is on disk.
    pub fn save(
        &mut self,
        name: &str,
        info: &SaveInfo,
        replicated: Option<Value>,
        head: Value,
        group: &ProcessGroup,
    ) -> Result<PathBuf> {
        self.settle(group)?;
        let (dir, target) = self.begin(name, info.rank, group)?;
        if self.background {
            let (d, i) = (dir.clone(), info.clone());
            let writer = std::thread::Builder::new()
                .name("tandem-face-save".into())
                .spawn(move || write_files(&d, &i, replicated.as_ref(), &head))
                .map_err(io("starting the checkpoint writer for", &dir))?;
            self.pending =
                Some(Pending { dir, target: target.clone(), info: info.clone(), writer });
            return Ok(target);
        }
        let written = write_files(&dir, info, replicated.as_ref(), &head);
        self.commit(&dir, &target, info, written, group)?;
        Ok(target)
    }

    /// Commits the background save in flight, if any (a collective: every rank calls it; each
    /// waits for its own files first). Its failure on any rank is every rank's error.
    pub fn settle(&mut self, group: &ProcessGroup) -> Result<()> {
        let Some(p) = self.pending.take() else { return Ok(()) };
        let written = p
            .writer
            .join()
            .unwrap_or_else(|_| Err(invalid(&p.dir, "the checkpoint writer thread panicked")));
        if let Some(why) = group.failure() {
            // A rank died before the save was committed (live recovery re-forms the world):
            // nobody can agree on it, so it stays without a manifest — an incomplete save,
            // never resumed, removed by a later save's pruning. This rank's own write failing
            // is still its error.
            written?;
            if p.info.rank == 0 {
                eprintln!(
                    "{}: left incomplete (the world broke before it was committed: {why})",
                    p.dir.display()
                );
            }
            return Ok(());
        }
        self.commit(&p.dir, &p.target, &p.info, written, group)
    }

    /// Agrees on where checkpoint `name` goes: `dir/name`, or `dir/name.new` beside an existing
    /// one (a collective). Returns (where the files go, where the checkpoint ends up).
    fn begin(&self, name: &str, rank: usize, group: &ProcessGroup) -> Result<(PathBuf, PathBuf)> {
        let barrier = |what: &str| group.barrier().map_err(comm(&format!("barrier {what}")));
        let target = self.dir.join(name);
        // Rank 0 looks, everyone acts on its answer (a rank looking itself could see the
        // directory another rank has just created).
        let mut exists = vec![u8::from(rank == 0 && target.exists())];
        group.broadcast_bytes(&mut exists, 0).map_err(comm("agreeing on the checkpoint's name"))?;
        let dir =
            if exists[0] == 1 { self.dir.join(format!("{name}.new")) } else { target.clone() };
        let cleared = match (rank, dir.exists() && dir != target) {
            (0, true) => std::fs::remove_dir_all(&dir).map_err(io("removing an unfinished", &dir)),
            _ => Ok(()),
        };
        let synced = barrier("before writing the checkpoint files");
        cleared?;
        synced?;
        Ok((dir, target))
    }

    /// Every rank's files are written (`written` is this rank's outcome): all agree, then rank
    /// 0 writes the manifest and puts the checkpoint in place, and all meet again.
    fn commit(
        &self,
        dir: &Path,
        target: &Path,
        info: &SaveInfo,
        written: Result<()>,
        group: &ProcessGroup,
    ) -> Result<()> {
        let mut all_written = [if written.is_ok() { 1.0f64 } else { 0.0 }];
        let agreed = group
            .all_reduce(&mut all_written, tandem_comm::ReduceOp::Min)
            .map_err(comm("after writing the checkpoint files"));
        written?;
        agreed?;
        if all_written[0] < 1.0 {
            return Err(invalid(dir, "another rank could not write its head file (see its error)"));
        }
        // Pruning comes last, once the new checkpoint is complete, durable and in its place.
        let finished = if info.rank == 0 {
            self.write_manifest(dir, info)
                .and_then(|()| swap_in(dir, target))
                .and_then(|()| self.prune(target))
        } else {
            Ok(())
        };
        let synced = group.barrier().map_err(comm("barrier after writing the checkpoint manifest"));
        finished?;
        synced
    }

    fn write_manifest(&self, dir: &Path, info: &SaveInfo) -> Result<()> {
        let heads = (0..info.world)
            .map(|r| {
                let split = ClassSplit::new(info.num_classes, info.world, r);
                HeadFile { file: head_file_name(r, info.world), start: split.start, len: split.len }
            })
            .collect();
        let manifest = Manifest {
            format: FORMAT.into(),
            world_size: info.world,
            global_step: info.global_step,
            epoch: info.epoch,
            num_classes: info.num_classes,
            embedding_size: info.embedding_size,
            replicated: REPLICATED.into(),
            heads,
        };
        write_manifest(dir, &manifest)
    }

    /// Deletes the oldest complete checkpoints beyond `keep_last`, and incomplete ones older
    /// than `newest` (a crashed save's leftovers). Only `step-NNNNNNNN` directories count: a
    /// `.new`/`.old` beside one is a swap in progress, never a checkpoint.
    fn prune(&self, newest: &Path) -> Result<()> {
        let all = self.list()?;
        let complete: Vec<&PathBuf> = all.iter().filter(|d| d.join(MANIFEST).is_file()).collect();
        let keep: Vec<&PathBuf> = complete.iter().rev().take(self.keep_last).copied().collect();
        for d in &all {
            if keep.contains(&d) || d.as_path() == newest || d.as_path() > newest {
                continue;
            }
            if let Err(e) = std::fs::remove_dir_all(d) {
                eprintln!("cannot remove old checkpoint {}: {e}", d.display());
            }
        }
        Ok(())
    }

    /// The checkpoint directories (`step-*`), oldest first.
    pub fn list(&self) -> Result<Vec<PathBuf>> {
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("reading", &self.dir)(e)),
        };
        let mut dirs: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
                p.is_dir() && name.is_some_and(|n| n.starts_with("step-") && !n.contains('.'))
            })
            .collect();
        dirs.sort();
        Ok(dirs)
    }

    /// The newest checkpoint with a manifest (incomplete saves are skipped, said so on stderr
    /// by the caller's rank 0).
    pub fn latest(&self) -> Result<Option<(PathBuf, Manifest)>> {
        for dir in self.list()?.into_iter().rev() {
            if dir.join(MANIFEST).is_file() {
                let manifest = read_manifest(&dir)?;
                return Ok(Some((dir, manifest)));
            }
            eprintln!("{}: no {MANIFEST} (an incomplete save); skipped", dir.display());
        }
        Ok(None)
    }
}

/// This rank's files of a checkpoint: its head file, and rank 0's replicated file.
fn write_files(
    dir: &Path,
    info: &SaveInfo,
    replicated: Option<&Value>,
    head: &Value,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let path = dir.join(head_file_name(info.rank, info.world));
    tandem_ckpt::save(&path, head).map_err(file(&path))?;
    if let Some(value) = replicated {
        let path = dir.join(REPLICATED);
        tandem_ckpt::save(&path, value).map_err(file(&path))?;
    }
    Ok(())
}

/// Puts the complete checkpoint `new` in `target`'s place (nothing to do when they are the
/// same): the old one (if it is still there) moves aside, the new one in, the parent directory
/// is synced, then the old one goes.
fn swap_in(new: &Path, target: &Path) -> Result<()> {
    if new == target {
        return Ok(());
    }
    let old = target.with_extension("old");
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
    }
    let had_target = target.exists();
    if had_target {
        std::fs::rename(target, &old).map_err(io("moving aside", target))?;
    }
    std::fs::rename(new, target).map_err(io("moving into place", new))?;
    if let Some(parent) = target.parent() {
        std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io("syncing", parent))?;
    }
    if had_target {
        std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
    }
    Ok(())
}

pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| invalid(&path, e.to_string()))?;
    tandem_ckpt::atomic::write_atomic(&path, |f| std::io::Write::write_all(f, &json))
        .map_err(file(&path))
}

/// Reads and checks `dir/manifest.json`, naming the file at fault.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = std::fs::read(&path).map_err(io("reading", &path))?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(&path, format!("not a face checkpoint manifest: {e}")))?;
    if m.format != FORMAT {
        return Err(invalid(&path, format!("format `{}`, expected `{FORMAT}`", m.format)));
    }
    // The files a manifest names are in its own directory: a name that is absolute, has a
    // directory part or is `..` would read (or, converted, write) elsewhere.
    for name in std::iter::once(&m.replicated).chain(m.heads.iter().map(|h| &h.file)) {
        let plain = Path::new(name).file_name().is_some_and(|f| f == name.as_str());
        if !plain || name == ".." || name == "." {
            let why = format!("file name {name:?} is not a plain name inside the checkpoint");
            return Err(invalid(&path, why));
        }
    }
    let mut next = 0;
    for (r, h) in m.heads.iter().enumerate() {
        if h.start != next {
            let why = format!(
                "head {r} starts at class {} but the classes before end at {next}",
                h.start
            );
            return Err(invalid(&path, why));
        }
        next += h.len;
    }
    if m.heads.len() != m.world_size || next != m.num_classes {
        let why = format!(
            "{} head files covering {next} classes for world size {} and {} classes",
            m.heads.len(),
            m.world_size,
            m.num_classes
        );
        return Err(invalid(&path, why));
    }
    Ok(m)
}

/// The rows `split` owns, read from the head files that hold them: the centres, their
/// optimizer state (row tensors re-split, other entries from the first file) and the BatchNorm
/// statistics of the rank with this number in the saved run (rank 0's when the saved run had
/// fewer ranks).
pub struct HeadRows {
    pub weight: TensorData,
    pub state: Value,
    pub buffers: Value,
}

pub fn read_head_rows(
    dir: &Path,
    m: &Manifest,
    split: ClassSplit,
    rank: usize,
) -> Result<HeadRows> {
    if m.embedding_size == 0 {
        return Err(invalid(dir, "embedding size 0"));
    }
    let want = split.start..split.start + split.len;
    let mut weights = Vec::new();
    let mut states = Vec::new();
    let own = rank.min(m.world_size.saturating_sub(1));
    let mut buffers = Value::None;
    for (r, h) in m.heads.iter().enumerate() {
        let overlap = h.start.max(want.start)..(h.start + h.len).min(want.end);
        if overlap.is_empty() && r != own {
            continue;
        }
        let path = dir.join(&h.file);
        let v = tandem_ckpt::load(&path).map_err(file(&path))?;
        let get = |k: &str| v.get(k).ok_or_else(|| invalid(&path, format!("no `{k}` entry")));
        if r == own {
            buffers = get("buffers")?.clone();
        }
        if overlap.is_empty() {
            continue;
        }
        let rows = (overlap.start - h.start)..(overlap.end - h.start);
        let w =
            get("weight")?.as_tensor().ok_or_else(|| invalid(&path, "`weight` is not a tensor"))?;
        if w.shape != [h.len, m.embedding_size] {
            let why = format!(
                "`weight` has shape {:?}, the manifest says [{}, {}]",
                w.shape, h.len, m.embedding_size
            );
            return Err(invalid(&path, why));
        }
        weights.push(slice_rows(w, rows.clone()));
        states.push((get("state")?.clone(), h.len, rows, path));
    }
    let weight = concat_rows(&weights, m.embedding_size)
        .map_err(|why| invalid(dir, format!("centres {}..{}: {why}", want.start, want.end)))?;
    Ok(HeadRows { weight, state: resplit_state(&states)?, buffers })
}

/// One parameter's optimizer state re-split by rows: tensors whose first dimension is the
/// file's row count are sliced and concatenated; anything else (Adam's `step`) is taken from
/// the first file.
fn resplit_state(parts: &[(Value, usize, std::ops::Range<usize>, PathBuf)]) -> Result<Value> {
    let Some((first, _, _, _)) = parts.first() else { return Ok(Value::None) };
    let Value::Dict(items) = first else { return Ok(Value::None) };
    let mut out = Vec::new();
    for (key, value) in items {
        let name = key.as_str().unwrap_or("?");
        let merged = match value {
            Value::Tensor(t) if t.shape.first() == Some(&parts[0].1) && t.shape.len() == 2 => {
                let mut pieces = Vec::new();
                for (state, len, rows, path) in parts {
                    let t = state
                        .get(name)
                        .and_then(Value::as_tensor)
                        .filter(|t| t.shape.first() == Some(len))
                        .ok_or_else(|| {
                            let why =
                                format!("optimizer state `{name}` is missing or has another shape");
                            invalid(path, why)
                        })?;
                    pieces.push(slice_rows(t, rows.clone()));
                }
                let rows =
                    concat_rows(&pieces, t.shape[1]).map_err(|why| invalid(&parts[0].3, why))?;
                Value::Tensor(rows)
            }
            other => other.clone(),
        };
        out.push((key.clone(), merged));
    }
    Ok(Value::Dict(out))
}

/// Rows `rows` of a 2-d tensor.
pub fn slice_rows(t: &TensorData, rows: std::ops::Range<usize>) -> TensorData {
    let row_bytes = t.shape.get(1).copied().unwrap_or(1) * t.dtype.size();
    let bytes = t.contiguous_bytes();
    let part = bytes[rows.start * row_bytes..rows.end * row_bytes].to_vec();
    let mut shape = t.shape.clone();
    shape[0] = rows.len();
    TensorData::from_bytes(t.dtype, &shape, part)
}

/// Stacks 2-d tensors of one dtype and width by rows (the error says why they do not stack).
pub fn concat_rows(parts: &[TensorData], width: usize) -> std::result::Result<TensorData, String> {
    let Some(first) = parts.first() else { return Err("no rows".into()) };
    let mut bytes = Vec::new();
    let mut rows = 0;
    for p in parts {
        if p.dtype != first.dtype || p.shape.len() != 2 || p.shape[1] != width {
            return Err(format!(
                "row blocks of different dtypes or widths ({:?} {:?})",
                p.dtype, p.shape
            ));
        }
        bytes.extend_from_slice(&p.contiguous_bytes());
        rows += p.shape[0];
    }
    Ok(TensorData::from_bytes(first.dtype, &[rows, width], bytes))
}

/// Splits a two-group optimizer state dict (torch layout) into the state without parameter
/// `head` and that parameter's entry (`Value::None` when it has none yet).
pub fn split_optimizer(full: &Value, head: i64) -> (Value, Value) {
    let mut rest = full.clone();
    let mut entry = Value::None;
    if let Some(Value::Dict(items)) = rest.get_mut("state") {
        if let Some(i) = items.iter().position(|(k, _)| k.as_int() == Some(head)) {
            entry = items.remove(i).1;
        }
    }
    (rest, entry)
}

/// [`split_optimizer`] undone: `entry` back under index `head`.
pub fn merge_optimizer(rest: &Value, head: i64, entry: Value) -> Value {
    let mut full = rest.clone();
    if !matches!(entry, Value::None) {
        if let Some(Value::Dict(items)) = full.get_mut("state") {
            items.push((Value::Int(head), entry));
        }
    }
    full
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, from: f32) -> TensorData {
        let data: Vec<f32> = (0..n * 2).map(|i| from + i as f32).collect();
        TensorData::from_f32(&[n, 2], &data)
    }

    #[test]
    fn manifest_file_names_outside_the_directory_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["../../etc/passwd", "/etc/passwd", "..", "sub/head.pt", ""] {
            let m = Manifest {
                format: FORMAT.into(),
                world_size: 1,
                global_step: 1,
                epoch: 0,
                num_classes: 4,
                embedding_size: 2,
                replicated: "replicated.pt".into(),
                heads: vec![HeadFile { file: bad.into(), start: 0, len: 4 }],
            };
            write_manifest(dir.path(), &m).unwrap();
            let e = read_manifest(dir.path()).expect_err("refused").to_string();
            assert!(e.contains("manifest.json") && e.contains("not a plain name"), "{bad}: {e}");
        }
    }

    #[test]
    fn rows_slice_and_concatenate_back() {
        let t = rows(5, 0.0);
        let parts = [slice_rows(&t, 0..2), slice_rows(&t, 2..5)];
        assert_eq!(concat_rows(&parts, 2).unwrap().to_f32_vec(), t.to_f32_vec());
        assert_eq!(slice_rows(&t, 3..4).to_f32_vec(), vec![6.0, 7.0]);
    }

    #[test]
    fn optimizer_state_splits_and_merges_without_loss() {
        let state = Value::Dict(vec![
            (Value::Int(0), Value::dict_from([("momentum_buffer", Value::Tensor(rows(1, 0.0)))])),
            (Value::Int(3), Value::dict_from([("momentum_buffer", Value::Tensor(rows(2, 9.0)))])),
        ]);
        let full = Value::dict_from([("state", state), ("param_groups", Value::List(vec![]))]);
        let (rest, entry) = split_optimizer(&full, 3);
        assert_eq!(rest.get("state").unwrap().as_dict().unwrap().len(), 1);
        assert!(entry.get("momentum_buffer").is_some());
        let back = merge_optimizer(&rest, 3, entry);
        assert_eq!(back, full);
    }
}
