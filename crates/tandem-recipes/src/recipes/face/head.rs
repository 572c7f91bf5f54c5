//! The face-recognition recipe's training state (insightface's arcface_torch): a replicated
//! backbone under Ddp with per-rank BatchNorm statistics (`broadcast_buffers=False`), and a
//! PartialFC head whose class centres, with their optimizer state, are split over the ranks.
//!
//! The [`Trainer`](tandem_train::Trainer) saves, resumes and moves it as it does any recipe's
//! ([`TrainingState`](tandem_train::TrainingState)): the backbone and the optimizer's other
//! entries are the replicated part; the head is a [`HeadPart`] (its rows and their optimizer
//! entry as the `head` row shard, mirrored and re-split under live recovery) and each rank's
//! statistics a [`RankBuffers`](tandem_train::RankBuffers) (`buffers`). A checkpoint loads on
//! any world size, each rank reading only the rank files that hold its rows.

use super::live_head::RowBlock;
use std::ops::Range;
use std::time::Instant;

use candle_core::DType;
use tandem_ckpt::{TensorData, Value};
use tandem_comm::ProcessGroup;
use tandem_optim::OptimizerState;
use tandem_partial_fc::{ClassSplit, PartialFc};
use tandem_train::checkpoint::{Saved, ShardDict};
use tandem_train::events::{MirrorCost, Resplit};
use tandem_train::live::{Mirrored, RegroupCounts};
use tandem_train::{Context, PartLoaded, RankState, Result, TrainError};

/// The name of the head's row shard (centres and their optimizer state) in a checkpoint.
pub const HEAD_SHARD: &str = "head";
/// The head's rows as a live regroup's [`Resplit`] names them.
pub const HEAD_ROWS: &str = "head rows";
/// The name of each rank's BatchNorm statistics in a checkpoint.
pub const BUFFERS_SHARD: &str = "buffers";

/// The PartialFC head as state its ranks hold alone: this rank's class centres and their
/// optimizer entry (parameter `index` of the optimizer, after the backbone's), saved as rows
/// of the `head` shard, loaded on any world size, and under live recovery mirrored to the next
/// rank and re-split after a regroup (each class from the newest copy any rank holds, else
/// from the last checkpoint, else its initial centre).
pub struct HeadPart {
    pub head: PartialFc,
    /// The head's parameter index in the optimizer (the backbone's parameter count).
    index: usize,
    /// The ranks the rows are split over now.
    world: usize,
    /// Under live recovery: the mirror and the re-split.
    live: Option<Mirrored<RowBlock>>,
    /// A gradient accumulation window is open (its head gradient is not state).
    pub window_open: bool,
    /// The run's accumulation window, for the warning of a save inside one.
    pub gradient_acc: u64,
}

impl HeadPart {
    /// `head` at optimizer index `index`, split over `world` ranks; `live`: its mirror.
    pub fn new(
        head: PartialFc,
        index: usize,
        world: usize,
        live: Option<Mirrored<RowBlock>>,
    ) -> Self {
        HeadPart { head, index, world, live, window_open: false, gradient_acc: 1 }
    }

    /// This rank's rows were updated by the optimizer step `step` (live recovery's mirror
    /// knows what step its copy is as of).
    pub fn stepped(&mut self, step: u64) {
        if let Some(live) = self.live.as_mut() {
            live.stepped(step);
        }
    }

    /// This rank's rows as a block: centres and the optimizer's row tensors (`entry`, the
    /// head's entry of the optimizer state), as of `step`.
    fn own_rows(&self, entry: &Value, step: u64) -> Result<RowBlock> {
        let split = self.head.split();
        let e = self.head.config().embedding_size;
        let weight =
            self.head.weight().as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(RowBlock {
            start: split.start,
            len: split.len,
            step,
            weight,
            state: row_tensors(entry, split.len, e),
        })
    }

    /// Sends `own` (this rank's rows) to the next rank and keeps the previous rank's (a
    /// collective), timed from `clock`.
    fn send_mirror(&mut self, group: &ProcessGroup, own: &RowBlock, clock: Instant) -> Result<()> {
        let classes = self.head.config().num_classes;
        match self.live.as_mut() {
            Some(live) => live.exchange(group, own, classes, clock),
            None => Ok(()),
        }
    }

    /// Rows no rank holds after a regroup: from `last` (the newest checkpoint), else the
    /// initial centres (step 0, no optimizer state).
    fn reload_rows(&self, last: Option<&Saved>, range: Range<usize>) -> Result<RowBlock> {
        let cfg = self.head.config();
        let (classes, e) = (cfg.num_classes, cfg.embedding_size);
        if let Some(saved) = last.filter(|s| s.rows_total(HEAD_SHARD) == Some(classes)) {
            let rows = saved.read_rows(HEAD_SHARD, range.clone())?;
            let weight = rows.get("weight").and_then(Value::as_tensor);
            if let Some(weight) = weight.filter(|w| w.shape == [range.len(), e]) {
                let state = rows.get("state").unwrap_or(&Value::None);
                return Ok(RowBlock {
                    start: range.start,
                    len: range.len(),
                    step: saved.global_step(),
                    weight: weight.to_f32_vec(),
                    state: row_tensors(state, range.len(), e),
                });
            }
        }
        Ok(RowBlock {
            start: range.start,
            len: range.len(),
            step: 0,
            weight: self.head.initial_centres(range.clone()),
            state: Vec::new(),
        })
    }
}

impl RankState for HeadPart {
    fn optimizer_entries(&self) -> Vec<usize> {
        vec![self.index]
    }

    fn shards(&self, mut entries: Vec<Value>, step: u64) -> Result<Vec<ShardDict>> {
        if self.window_open && self.head.split().start == 0 {
            // Gradients are not part of the training state (nor of arcface_torch's).
            tracing::warn!(
                "checkpoint at step {step} is inside a gradient accumulation window of {}: a run \
                 resumed from it starts the window without this window's earlier batches",
                self.gradient_acc
            );
        }
        let state = entries.pop().unwrap_or(Value::None);
        let weight = tandem_nn::convert::to_ckpt(self.head.weight().as_tensor())?;
        let head = Value::dict_from([("weight", Value::Tensor(weight)), ("state", state)]);
        let (split, classes) = (self.head.split(), self.head.config().num_classes);
        Ok(vec![ShardDict::rows(HEAD_SHARD, split.start, split.len, classes, head)])
    }

    fn load(&mut self, saved: &Saved) -> Result<PartLoaded> {
        let dir = saved.path().to_path_buf();
        let cfg = self.head.config();
        let (classes, embedding) = (cfg.num_classes, cfg.embedding_size);
        let saved_classes = saved.rows_total(HEAD_SHARD).unwrap_or(0);
        let shape_error = |saved_embedding: usize| TrainError::Field {
            path: dir.clone(),
            field: "head",
            problem: format!(
                "the checkpoint's head is {saved_classes} classes x {saved_embedding}, this \
                 run's {classes} x {embedding}"
            ),
        };
        if saved_classes != classes {
            return Err(shape_error(0));
        }
        let split = self.head.split();
        let rows = saved.read_rows(HEAD_SHARD, split.start..split.start + split.len)?;
        let restoring = || format!("{}: restoring the head centres", dir.display());
        let weight =
            rows.get("weight").and_then(Value::as_tensor).ok_or_else(|| TrainError::Field {
                path: dir.clone(),
                field: "head",
                problem: "no `weight` tensor".into(),
            })?;
        if weight.shape.get(1) != Some(&embedding) {
            return Err(shape_error(weight.shape.get(1).copied().unwrap_or(0)));
        }
        let device = self.head.weight().device().clone();
        let weight = tandem_nn::convert::from_ckpt(weight, &device).with_context(restoring)?;
        self.head.weight().set(&weight).with_context(restoring)?;
        self.head.set_steps_taken(saved.global_step());
        let (saved_world, world) = (saved.world_size(), self.world);
        let note = (saved_world != world).then(|| {
            format!(
                "the checkpoint was written by {saved_world} ranks, this run has {world}: the \
                 {classes} class centres and their optimizer state are re-split ({} per rank \
                 here)",
                split.len
            )
        });
        let entry = rows.get("state").cloned().unwrap_or(Value::None);
        Ok(PartLoaded { entries: vec![entry], note, resplit: None })
    }

    /// Under live recovery, every `--mirror-every` steps: this rank's rows to the next rank,
    /// the previous rank's rows kept here.
    fn after_step(
        &mut self,
        group: &ProcessGroup,
        optimizer: &dyn OptimizerState,
        step: u64,
    ) -> Result<()> {
        if !self.live.as_ref().is_some_and(|live| live.due(step)) {
            return Ok(());
        }
        let clock = Instant::now();
        let entry = optimizer.param_entry(self.index)?;
        let own = self.own_rows(&entry, step)?;
        self.send_mirror(group, &own, clock)
    }

    /// Re-splits the head over the new world: each class from the newest copy any rank holds
    /// (its owner's, else a mirror), else from the last checkpoint, else the initial centres;
    /// the optimizer takes the new rows as its parameter, and a fresh mirror is taken.
    fn regroup(
        &mut self,
        group: &ProcessGroup,
        step: u64,
        optimizer: &mut dyn OptimizerState,
        world_optimizer: &Value,
        last: Option<&Saved>,
    ) -> Result<PartLoaded> {
        let Some(mut live) = self.live.take() else { return Ok(PartLoaded::default()) };
        let own_entry = optimizer.param_entry(self.index)?;
        // (Put back whatever happens: a peer lost during the re-split starts another.)
        let regrouped = self.regroup_rows(&mut live, group, step, &own_entry, last);
        self.live = Some(live);
        let (rows, counts) = regrouped?;
        self.world = group.size();
        let e = self.head.config().embedding_size;
        let device = self.head.weight().device().clone();
        let weight = candle_core::Tensor::from_vec(rows.weight.clone(), (rows.len, e), &device)?;
        let var = self.head.regroup(&weight).context("re-splitting the PartialFC head")?;
        self.head.set_steps_taken(step);
        optimizer.replace_param(self.index, var)?;
        let entry = head_entry(&rows, &own_entry, world_optimizer, e);
        // The new rows are this rank's own now: mirrored at once, so the next death is covered
        // (what the re-split moved between neighbours stays where it went).
        let classes = self.head.config().num_classes;
        if let Some(live) = self.live.as_mut() {
            live.exchange_regrouped(group, &rows, classes, Instant::now())?;
        }
        Ok(PartLoaded {
            entries: vec![entry],
            note: None,
            resplit: Some(Resplit {
                part: HEAD_ROWS.into(),
                lost_unit: "row-steps of head training".into(),
                counts,
                layout: None,
            }),
        })
    }

    fn mirror_cost(&self) -> Option<MirrorCost> {
        // What the mirror cost this rank (its own bytes; every rank sends one shard).
        self.live.as_ref().map(|live| live.cost("head"))
    }
}

impl HeadPart {
    /// This rank's rows of the new world `group`, each class from the newest copy any rank
    /// holds, else from [`HeadPart::reload_rows`] (a collective); `own_entry` is the head's
    /// entry of this rank's optimizer state.
    fn regroup_rows(
        &self,
        live: &mut Mirrored<RowBlock>,
        group: &ProcessGroup,
        step: u64,
        own_entry: &Value,
        last: Option<&Saved>,
    ) -> Result<(RowBlock, RegroupCounts)> {
        let own = live.holds().map(|at| self.own_rows(own_entry, at)).transpose()?;
        let (classes, world) = (self.head.config().num_classes, group.size());
        let want = |rank: usize| {
            let split = ClassSplit::new(classes, world, rank);
            let rows = split.start..split.start + split.len;
            vec![rows]
        };
        let mut fill = |range: Range<usize>| Ok(Some(self.reload_rows(last, range)?));
        live.regroup(group, step, classes, own.as_ref(), &want, &mut fill)
    }
}

/// The row tensors (`[rows, e]`) of a parameter's optimizer state entry, by name.
fn row_tensors(entry: &Value, rows: usize, e: usize) -> Vec<(String, Vec<f32>)> {
    let Value::Dict(items) = entry else { return Vec::new() };
    let mut out: Vec<(String, Vec<f32>)> = items
        .iter()
        .filter_map(|(k, v)| {
            let t = v.as_tensor().filter(|t| t.shape == [rows, e])?;
            Some((k.as_str()?.to_string(), t.to_f32_vec()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The head's optimizer entry for the re-split `rows`: their row tensors, and the other
/// entries (AdamW's `step`) from this rank's old entry, else from the world's first
/// parameter's (`world`: the world's optimizer state).
fn head_entry(rows: &RowBlock, own: &Value, world: &Value, e: usize) -> Value {
    if rows.state.is_empty() {
        return Value::None;
    }
    let scalars_from = match own {
        Value::Dict(items) if !items.is_empty() => own.clone(),
        _ => world
            .get("state")
            .and_then(|s| match s {
                Value::Dict(items) => items.first().map(|(_, v)| v.clone()),
                _ => None,
            })
            .unwrap_or(Value::None),
    };
    let row_names: Vec<&str> = rows.state.iter().map(|(k, _)| k.as_str()).collect();
    let mut items: Vec<(Value, Value)> = Vec::new();
    if let Value::Dict(src) = &scalars_from {
        for (k, v) in src {
            if k.as_str().is_some_and(|k| !row_names.contains(&k)) {
                items.push((k.clone(), v.clone()));
            }
        }
    }
    for (k, t) in &rows.state {
        items.push((Value::Str(k.clone()), Value::Tensor(TensorData::from_f32(&[rows.len, e], t))));
    }
    Value::Dict(items)
}

/// The head's (classes, embedding width) of a face-recipe checkpoint (`None` for any other).
pub fn head_shape(saved: &Saved) -> Option<(usize, usize)> {
    let classes = saved.rows_total(HEAD_SHARD)?;
    let rows = saved.read_row_parts(HEAD_SHARD, 0..1).ok()?;
    Some((classes, *rows.first()?.get("weight")?.as_tensor()?.shape.get(1)?))
}

/// `state` with the entries of `over` replaced (a rank's own statistics over rank 0's).
pub fn overlay(state: &mut Value, over: &Value) {
    let Value::Dict(items) = over else { return };
    for (k, v) in items {
        if let Some(name) = k.as_str() {
            if let Some(slot) = state.get_mut(name) {
                *slot = v.clone();
            }
        }
    }
}
