//! The whole training state in one call each way, like Accelerate's `save_state`/`load_state`:
//! model, optimizer, scheduler, loader position, step, epoch and world size, over the one
//! checkpoint API ([`tandem_checkpoint`]). A replicated state is one torch-loadable file rank 0
//! writes atomically (keep-last rotation, a `latest` pointer) while every rank meets inside; an
//! optimizer sharded over the ranks (ZeRO-1) saves each rank's entries in parallel as an entry
//! shard (nothing is gathered), and state each rank holds alone goes beside it as its parts'
//! shards ([`TrainingState::part`]: a [`RankState`] such as a PartialFC head's rows with their
//! optimizer entry). Loading picks the newest checkpoint that verifies and restores everything on
//! every rank, each rank reading only the optimizer entries and the rows it owns.
//!
//! ```ignore
//! let mut state = TrainingState::new(&ddp, &mut opt).loader(&mut loader);
//! if let Some(r) = tandem_state::load_state("runs/ckpt", &mut state)? {
//!     start_epoch = r.epoch;                    // model, optimizer and loader are restored
//! }
//! // ... after an epoch:
//! let state = TrainingState::new(&ddp, &mut opt).loader(&mut loader).epoch(epoch + 1);
//! tandem_state::save_state(&group, "runs/ckpt", &state)?;
//! ```
//!
//! The model is anything that is a [`ParamModule`] (a `Ddp`, the `NamedVars` of a candle
//! model's `VarMap`, tandem's models); the optimizer anything that is an [`OptimizerState`]:
//! tandem's optimizers and candle-nn's `SGD`:
//!
//! ```
//! # use candle_core::{DType, Device};
//! # use candle_nn::{Optimizer, VarBuilder, VarMap};
//! let varmap = VarMap::new();
//! let _w = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).get(4, "w").unwrap();
//! let model = tandem_nn::NamedVars::from_varmap(&varmap);
//! let mut opt = candle_nn::SGD::new(varmap.all_vars(), 0.1).unwrap();
//! let _state = tandem_state::TrainingState::new(&model, &mut opt);
//! ```
//!
//! One whose state cannot be saved (candle-nn's `AdamW`) does not compile, with a note naming
//! tandem's drop-in (the same program, the optimizer swapped):
//!
//! ```compile_fail,E0277
//! # use candle_core::{DType, Device};
//! # use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
//! let varmap = VarMap::new();
//! let _w = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).get(4, "w").unwrap();
//! let model = tandem_nn::NamedVars::from_varmap(&varmap);
//! let mut opt = candle_nn::AdamW::new(varmap.all_vars(), ParamsAdamW::default()).unwrap();
//! let _state = tandem_state::TrainingState::new(&model, &mut opt); // `AdamW` has no state tandem can checkpoint
//! ```
use std::path::{Path, PathBuf};

use tandem_ckpt::{TrainingCheckpoint, Value};
use tandem_comm::ProcessGroup;
pub use tandem_data::{reshard_message, sampler_state_from_value, sampler_value, LoaderPosition};
use tandem_nn::weights::{load_weights_from, state_dict_value};
use tandem_nn::ParamModule;
use tandem_optim::amp::GradScaler;
use tandem_optim::lr_scheduler::LrScheduler;
use tandem_optim::{OptimizerShard, OptimizerState};

use crate::rank_state::RankState;
use crate::{Context, Result, TrainError};
use tandem_checkpoint::{Checkpointer, Saved, ShardDict, TrainingStateDict, KEEP_LAST};

/// The name of a sharded optimizer's entry shard: a path into the replicated dict, where the
/// entries go when the checkpoint is consolidated (`optimizer` → `state`, torch's layout).
pub const OPTIMIZER_SHARD: &str = "optimizer/state";

/// What [`save_state`] writes and [`load_state`] restores. `step` and `epoch` are the caller's
/// counters; the rest is read from (and restored into) the objects themselves.
pub struct TrainingState<'a> {
    pub model: &'a dyn ParamModule,
    pub optimizer: &'a mut dyn OptimizerState,
    pub scheduler: Option<&'a mut dyn LrScheduler>,
    pub loader: Option<&'a mut dyn LoaderPosition>,
    /// The loss scaler of float16 mixed-precision training.
    pub scaler: Option<&'a mut GradScaler>,
    pub step: u64,
    pub epoch: u64,
    /// Fixed shards of this rank saved beside the replicated part
    /// (`ShardDict::rows("head", ..., head.state_dict()?)`), read back by the caller through
    /// the [`Saved`] checkpoint [`load_state_from`] takes; state that loads and moves itself
    /// is a part instead ([`TrainingState::part`]).
    pub shards: Vec<ShardDict>,
    /// The run's settings as text, kept as the checkpoint's `config` entry.
    pub config: Option<String>,
    /// The seed every random draw of the run derives from, kept as the checkpoint's `rng`
    /// entry (`{"seed": S}`).
    pub seed: Option<u64>,
    /// State this rank holds alone that saves, loads and moves itself ([`RankState`]: a
    /// PartialFC head's rows, per-rank BatchNorm statistics).
    pub parts: Vec<&'a mut dyn RankState>,
    /// The model's state-dict names in the order the checkpoint lists them (torch's module
    /// order), when the model's own order is another.
    pub order: Option<&'a [String]>,
}

impl<'a> TrainingState<'a> {
    /// Whether the model has a replicated state dict: not when it lives wholly in a part (an
    /// Fsdp model's shards), which a resume or a live regroup then moves alone.
    pub(crate) fn has_replicated_model(&self) -> bool {
        !(self.model.param_set().is_empty() && self.model.named_buffers().is_empty())
    }

    /// `model`: a `Ddp`, a `NamedVars`, or any other [`ParamModule`];
    /// `optimizer`: tandem's optimizers or candle-nn's `SGD` (see [`OptimizerState`]).
    pub fn new<O: OptimizerState + 'a>(model: &'a dyn ParamModule, optimizer: &'a mut O) -> Self {
        TrainingState {
            model,
            optimizer,
            scheduler: None,
            loader: None,
            scaler: None,
            step: 0,
            epoch: 0,
            shards: Vec::new(),
            config: None,
            seed: None,
            parts: Vec::new(),
            order: None,
        }
    }
    /// The state of a model sharded by `Fsdp`: its parameters and the optimizer's entries
    /// (the optimizer steps [`tandem_fsdp::Fsdp::params`]) go to `shards`, saved by rows and
    /// resumable on any world size; the replicated part holds the rest.
    pub fn fsdp<O: OptimizerState + 'a>(
        shards: &'a mut crate::FsdpShards,
        optimizer: &'a mut O,
    ) -> Self {
        TrainingState::new(&*crate::fsdp_state::NO_MODEL, optimizer).part(shards)
    }
    /// The loss scaler and the schedule of `step` (what a [`tandem_optim::Step`] steps with).
    pub fn scaler_and_scheduler(mut self, step: &'a mut tandem_optim::Step) -> Self {
        (self.scaler, self.scheduler) = step.scaler_and_scheduler_mut();
        self
    }
    /// Adds state this rank holds alone (see [`RankState`]).
    pub fn part(mut self, part: &'a mut dyn RankState) -> Self {
        self.parts.push(part);
        self
    }
    /// Lists the model's entries in `order` in the checkpoint (see [`TrainingState::order`]).
    pub fn order(mut self, order: &'a [String]) -> Self {
        self.order = Some(order);
        self
    }
    /// The optimizer's entries the parts hold, by parameter index, and which part holds each.
    pub(crate) fn part_entries(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (p, part) in self.parts.iter().enumerate() {
            out.extend(part.optimizer_entries().into_iter().map(|i| (i, p)));
        }
        out
    }
    /// The optimizer's state without the entries the parts hold, and those entries by part.
    pub(crate) fn optimizer_split(&self) -> Result<(Value, Vec<Vec<Value>>)> {
        let n = self.model.named_parameters().len();
        let mut full = self.optimizer.save_optimizer_state(n)?;
        let mut by_part: Vec<Vec<Value>> = vec![Vec::new(); self.parts.len()];
        for (index, p) in self.part_entries() {
            by_part[p].push(take_entry(&mut full, index));
        }
        Ok((full, by_part))
    }
    /// Keeps the run's settings (`text`) as the checkpoint's `config` entry.
    pub fn config(mut self, text: String) -> Self {
        self.config = Some(text);
        self
    }
    /// Keeps the run's seed as the checkpoint's `rng` entry.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
    /// Adds a shard this rank holds alone (see [`TrainingState::shards`]).
    pub fn shard(mut self, shard: ShardDict) -> Self {
        self.shards.push(shard);
        self
    }
    pub fn scaler(mut self, scaler: &'a mut GradScaler) -> Self {
        self.scaler = Some(scaler);
        self
    }
    pub fn scheduler(mut self, scheduler: &'a mut dyn LrScheduler) -> Self {
        self.scheduler = Some(scheduler);
        self
    }
    pub fn loader(mut self, loader: &'a mut dyn LoaderPosition) -> Self {
        self.loader = Some(loader);
        self
    }
    pub fn step(mut self, step: u64) -> Self {
        self.step = step;
        self
    }
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }
}

/// Where a resume started from: what [`load_state`] returns and the
/// `Trainer` of tandem-train reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed {
    /// The checkpoint read (a file, or a directory of shards).
    pub path: PathBuf,
    /// The optimizer steps taken before it was written.
    pub step: u64,
    /// The epoch the loader resumes in.
    pub epoch: u64,
    /// The world size that wrote the checkpoint.
    pub world_size: usize,
    /// What to say about it beside `resumed from PATH (epoch E, step S)`, if anything (how
    /// the state was re-split over another world size).
    pub note: Option<String>,
}

/// Saves the whole state as checkpoint `epoch-EEEE-step-SSSSSSSS` in `dir` (keeping the last
/// [`KEEP_LAST`]): one file rank 0 writes, or with shards (a sharded optimizer, extra shards)
/// a directory every rank writes its part of. A collective: call it on every rank. Returns the
/// checkpoint on rank 0, `None` elsewhere. Each tensor is written from its own memory (no
/// staging copy of the state): nothing may train the model on another thread meanwhile.
pub fn save_state(
    group: &ProcessGroup,
    dir: impl AsRef<Path>,
    state: &TrainingState<'_>,
) -> Result<Option<PathBuf>> {
    // Every rank builds the whole value: a failure building it (a dtype the file cannot hold)
    // is then the same on every rank, before anyone waits.
    let name = format!("epoch-{:04}-step-{:08}", state.epoch, state.step);
    let mut ckpt = Checkpointer::new(dir.as_ref(), KEEP_LAST);
    let path = ckpt.save_built(group, &name, || state_dict(state, group.size()))?;
    Ok((group.rank() == 0).then_some(path))
}

/// This rank's part of `state` as a [`TrainingStateDict`] (for a [`Checkpointer`] of the
/// caller's: background saves, other retention): the replicated dict, the optimizer's entry
/// shard when it is sharded, and `state.shards`. Every tensor is a copy, unless built inside
/// [`Checkpointer::save_built`]'s synchronous save.
pub fn state_dict(state: &TrainingState<'_>, world_size: usize) -> Result<TrainingStateDict> {
    let shard = state.optimizer.optimizer_shard()?;
    let (optimizer, by_part) = match &shard {
        Some(_) if !state.part_entries().is_empty() => return Err(TrainError::ShardedWithParts),
        Some(s) => (s.groups.clone(), vec![Vec::new(); state.parts.len()]),
        None => state.optimizer_split()?,
    };
    let replicated = value_with(state, world_size, optimizer)?;
    let mut dict = TrainingStateDict::new(state.step, state.epoch, replicated);
    if let Some(OptimizerShard { indices, entries, .. }) = shard {
        dict = dict.shard(ShardDict::entries(OPTIMIZER_SHARD, indices, entries));
    }
    dict.shards.extend(state.shards.iter().cloned());
    for (part, entries) in state.parts.iter().zip(by_part) {
        dict.shards.extend(part.shards(entries, state.step)?);
    }
    Ok(dict)
}

/// Restores the newest checkpoint in `dir` that verifies into `state` (on every rank; each rank
/// reads the replicated part and the optimizer entries it owns). `Ok(None)` when there is
/// none: a fresh start. A checkpoint that does not fit (another model, a missing field) is an
/// error naming the file and what does not fit; one without GradScaler state (written without
/// f16 precision) leaves `state.scaler` fresh, and [`Resumed::note`] says so.
pub fn load_state(dir: impl AsRef<Path>, state: &mut TrainingState<'_>) -> Result<Option<Resumed>> {
    let Some(saved) = Checkpointer::new(dir.as_ref(), KEEP_LAST).latest()? else {
        return Ok(None);
    };
    load_state_from(&saved, state).map(Some)
}

/// [`load_state`] from a checkpoint found or opened by the caller (whose other shards it can
/// then read: [`Saved::read_rows`], [`Saved::read_row_parts`]).
pub fn load_state_from(saved: &Saved, state: &mut TrainingState<'_>) -> Result<Resumed> {
    resume_from(saved, state).map(|(resumed, _)| resumed)
}

/// The one resume path, a user's loop's ([`load_state_from`]) and the
/// `Trainer`'s of tandem-train: restores `saved` into `state` and says where it resumed —
/// the step, the loader's epoch, and notes on a re-split over another world size and on
/// GradScaler state it did not hold. Also returns the checkpoint read (the Trainer loads its
/// schedule from it, stretched over the steps this world has left).
#[doc(hidden)]
pub fn resume_from(
    saved: &Saved,
    state: &mut TrainingState<'_>,
) -> Result<(Resumed, TrainingCheckpoint)> {
    let (ck, scaler_note) = restore(saved, state)?;
    let path = saved.path();
    let saved_world = ck.world_size as usize;
    let mut notes = Vec::new();
    if let Some(loader) = state.loader.as_deref() {
        let world = loader.position().num_replicas;
        if world != saved_world && ck.sampler != Value::None {
            let sampler = sampler_state_from_value(&ck.sampler)
                .with_context(|| format!("{}: checkpoint `sampler`", path.display()))?;
            notes.push(reshard_message(&sampler, world, loader));
        }
    }
    notes.extend(scaler_note);
    let epoch = state.loader.as_deref().map_or(state.epoch, |l| l.position().epoch);
    let resumed = Resumed {
        path: path.to_path_buf(),
        step: ck.global_step as u64,
        epoch,
        world_size: saved_world,
        note: (!notes.is_empty()).then(|| notes.join("\n")),
    };
    Ok((resumed, ck))
}

/// Restores `saved` into `state` (the replicated part and the optimizer entries `state`'s
/// optimizer owns; the loader's position too) and returns the checkpoint it read, with what
/// to tell the user (see [`apply_checkpoint`]).
pub(crate) fn restore(
    saved: &Saved,
    state: &mut TrainingState<'_>,
) -> Result<(TrainingCheckpoint, Option<String>)> {
    let replicated = state.has_replicated_model();
    // An Fsdp run's rows stacked: the model and optimizer a replicated run resumes from (a
    // sharded model reads only its own rows, through its part).
    let stacked = if replicated { crate::fsdp_state::fsdp_consolidated(saved)? } else { None };
    let value = match stacked {
        Some(whole) => whole,
        None => replicated_with_optimizer(saved, state.optimizer.owned_params().as_deref())?,
    };
    let mut ck = TrainingCheckpoint::from_value(&value)?;
    let path = saved.path();
    // The model first: a part may overwrite some of it (a rank's own BatchNorm statistics).
    if replicated {
        load_weights_from(state.model, &ck.model, true)
            .map_err(|e| field_error(path, "model", e.to_string()))?;
    }
    let mut notes = Vec::new();
    let entries = state.part_entries();
    let mut loaded = Vec::with_capacity(state.parts.len());
    for part in state.parts.iter_mut() {
        let got = part.load(saved)?;
        notes.extend(got.note);
        loaded.push(got.entries.into_iter());
    }
    for (index, p) in entries {
        let entry = loaded[p].next().unwrap_or(Value::None);
        put_entry(&mut ck.optimizer, index, entry);
    }
    let what = Restore { model: false, ..Restore::ALL };
    notes.extend(apply_checkpoint(state, &ck, path, what)?);
    Ok((ck, (!notes.is_empty()).then(|| notes.join("\n"))))
}

/// Removes parameter `index`'s entry from an optimizer state dict's `state` (torch layout) and
/// returns it (`Value::None` when it has none): the entry moves out, nothing is copied.
pub fn take_entry(optimizer: &mut Value, index: usize) -> Value {
    let Some(Value::Dict(items)) = optimizer.get_mut("state") else { return Value::None };
    match items.iter().position(|(k, _)| k.as_int() == Some(index as i64)) {
        Some(i) => items.remove(i).1,
        None => Value::None,
    }
}

/// Puts `entry` back as parameter `index`'s in an optimizer state dict (nothing for `None`):
/// [`take_entry`] undone.
pub fn put_entry(optimizer: &mut Value, index: usize, entry: Value) {
    if matches!(entry, Value::None) {
        return;
    }
    if let Some(Value::Dict(items)) = optimizer.get_mut("state") {
        items.retain(|(k, _)| k.as_int() != Some(index as i64));
        items.push((Value::Int(index as i64), entry));
    }
}

fn field_error(path: &Path, field: &'static str, problem: String) -> TrainError {
    TrainError::Field { path: path.to_path_buf(), field, problem }
}

/// The replicated dict of `saved` with the optimizer entries `owned` (all with `None`) put
/// back under `optimizer` → `state` when the optimizer was saved sharded.
pub fn replicated_with_optimizer(saved: &Saved, owned: Option<&[usize]>) -> Result<Value> {
    let mut value = saved.replicated()?;
    if saved.shard_names().contains(&OPTIMIZER_SHARD) {
        let entries = saved.read_entries(OPTIMIZER_SHARD, owned)?;
        let Some(groups) = value.get("optimizer") else {
            return Err(TrainError::Field {
                path: saved.path().to_path_buf(),
                field: "optimizer",
                problem: "missing (the hyperparameters of the sharded optimizer)".into(),
            });
        };
        let full = OptimizerShard::full(groups, entries);
        value.insert("optimizer", full);
    }
    Ok(value)
}

/// What [`apply_checkpoint`] restores beside the model, scheduler, GradScaler and counters.
#[derive(Clone, Copy)]
pub(crate) struct Restore {
    /// The model's weights.
    pub model: bool,
    /// The loader's position (a live regroup moves the loader to the new world itself).
    pub loader: bool,
    /// The optimizer (a live regroup of a sharded optimizer moves its entries apart and loads
    /// them with the hyperparameters after the re-split).
    pub optimizer: bool,
}

impl Restore {
    pub const ALL: Restore = Restore { model: true, loader: true, optimizer: true };
}

/// Restores `ck` (read from `path`, named in errors) into `state`: model, scheduler, GradScaler,
/// counters, and the optimizer and loader position as `what` says. Returns what to tell the
/// user: a checkpoint without GradScaler state (written without f16 precision) leaves the
/// scaler fresh, and says so.
pub(crate) fn apply_checkpoint(
    state: &mut TrainingState<'_>,
    ck: &TrainingCheckpoint,
    path: &Path,
    what: Restore,
) -> Result<Option<String>> {
    let field = |field: &'static str, problem: String| TrainError::Field {
        path: path.to_path_buf(),
        field,
        problem,
    };
    if what.model {
        let model = load_weights_from(state.model, &ck.model, true);
        model.map_err(|e| field("model", e.to_string()))?;
    }
    if what.optimizer {
        state
            .optimizer
            .load_optimizer_state(&ck.optimizer)
            .map_err(|e| field("optimizer", e.to_string()))?;
    }
    if let Some(s) = state.scheduler.as_deref_mut() {
        if ck.scheduler == Value::None {
            return Err(field("scheduler", "missing (saved without a scheduler)".into()));
        }
        s.load_state_dict(&ck.scheduler).map_err(|e| field("scheduler", e.to_string()))?;
    }
    let mut note = None;
    match state.scaler.as_deref_mut() {
        Some(s) if ck.scaler == Value::None => {
            note = Some(format!(
                "{}: no GradScaler state (written without f16 precision); the loss scale starts \
                 at {}",
                path.display(),
                s.get_scale()
            ));
        }
        Some(s) => s.load_state_dict(&ck.scaler).map_err(|e| field("scaler", e.to_string()))?,
        None => {}
    }
    if let Some(l) = state.loader.as_deref_mut().filter(|_| what.loader) {
        if ck.sampler == Value::None {
            // Converted from another trainer's checkpoint (arcface_torch's resumes at epoch
            // boundaries): the start of its epoch, in this run's order.
            l.set_epoch(ck.epoch as u64);
        } else {
            let pos = sampler_state_from_value(&ck.sampler)
                .map_err(|p| field("sampler", p.to_string()))?;
            l.set_position(&pos).map_err(|e| field("sampler", e.to_string()))?;
        }
    }
    state.step = ck.global_step as u64;
    state.epoch = ck.epoch as u64;
    Ok(note)
}

/// The replicated part of the whole state as one value (what a live regroup sends): a sharded
/// optimizer's hyperparameters only, any other's state without the entries the parts hold
/// (they move with the parts, in the re-split that follows).
pub(crate) fn to_value(state: &TrainingState<'_>, world_size: usize) -> Result<Value> {
    let optimizer = match state.optimizer.optimizer_shard()? {
        Some(shard) => shard.groups,
        None => state.optimizer_split()?.0,
    };
    value_with(state, world_size, optimizer)
}

/// The replicated dict of `state` with `optimizer` as its optimizer entry.
fn value_with(state: &TrainingState<'_>, world_size: usize, optimizer: Value) -> Result<Value> {
    let model = state_dict_value(state.model)?;
    let ck = TrainingCheckpoint {
        epoch: state.epoch as i64,
        global_step: state.step as i64,
        model: match state.order {
            Some(order) => in_order(model, order),
            None => model,
        },
        optimizer,
        scheduler: state.scheduler.as_deref().map_or(Value::None, |s| s.state_dict()),
        sampler: state.loader.as_deref().map_or(Value::None, |l| sampler_value(&l.position())),
        // The loader's shuffle is seeded by (seed, epoch), which the sampler state holds; a
        // recipe's other draws by the run's seed.
        rng: state.seed.map_or(Value::None, |s| Value::dict_from([("seed", Value::Int(s as i64))])),
        world_size: world_size as i64,
        config: state.config.clone().map_or(Value::None, Value::Str),
        scaler: state.scaler.as_deref().map_or(Value::None, |s| s.state_dict()),
    };
    Ok(ck.to_value()?)
}

/// A state dict with its entries in `order` (names not in it keep their place at the end).
fn in_order(state: Value, order: &[String]) -> Value {
    let Value::Dict(mut items) = state else { return state };
    let rank = |k: &Value| {
        k.as_str().and_then(|k| order.iter().position(|o| o == k)).unwrap_or(usize::MAX)
    };
    items.sort_by_key(|(k, _)| rank(k));
    Value::Dict(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` rows of two f32 counting up from `from`.
    fn rows(n: usize, from: f32) -> tandem_ckpt::TensorData {
        let data: Vec<f32> = (0..n * 2).map(|i| from + i as f32).collect();
        tandem_ckpt::TensorData::from_f32(&[n, 2], &data)
    }

    #[test]
    fn optimizer_state_splits_and_merges_without_loss() {
        let state = Value::Dict(vec![
            (Value::Int(0), Value::dict_from([("momentum_buffer", Value::Tensor(rows(1, 0.0)))])),
            (Value::Int(3), Value::dict_from([("momentum_buffer", Value::Tensor(rows(2, 9.0)))])),
        ]);
        let full = Value::dict_from([("state", state), ("param_groups", Value::List(vec![]))]);
        let mut rest = full.clone();
        let entry = take_entry(&mut rest, 3);
        assert_eq!(rest.get("state").unwrap().as_dict().unwrap().len(), 1);
        assert!(entry.get("momentum_buffer").is_some());
        let mut back = rest;
        put_entry(&mut back, 3, entry);
        assert_eq!(back, full);
    }
}
