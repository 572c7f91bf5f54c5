//! The face-recognition recipe's training state (insightface's arcface_torch): a replicated
//! backbone under Ddp with per-rank BatchNorm statistics (`broadcast_buffers=False`), and a
//! PartialFC head whose class centres, with their optimizer state, are split over the ranks.
//!
//! [`save`] writes it through the one checkpoint API ([`tandem_train::checkpoint`]: the replicated
//! part once, every rank's `head` row shard (its centres and their optimizer state) and its
//! `buffers` in parallel, a manifest last) and [`resume`] reads it back on any world size, each
//! rank reading only the rank files that hold its rows.
//!
//! ```ignore
//! let mut ckpts = Checkpointer::new(out.join("checkpoints"), 2);
//! let mut state = FaceState::new(&ddp, &mut head, &mut opt, &mut step);
//! if let Some(r) = face::resume(&ckpts, &mut state, &mut loader, epochs, &group)? { /* r.step */ }
//! // ... train ...
//! let state = FaceState::new(&ddp, &mut head, &mut opt, &mut step).global_step(n);
//! face::save(&mut ckpts, &state, &loader.state(), &group)?;
//! ```
pub mod arcface;
pub mod config;
mod live_head;
mod weights;
pub use live_head::RowBlock;
pub use weights::load_backbone;
pub mod optimizer_entry;

use std::path::PathBuf;

use tandem_ckpt::Value;
use tandem_comm::ProcessGroup;
use tandem_data::SamplerState;
use tandem_nn::ParamModule;
use tandem_optim::{GradScaler, TorchOptimizer};
use tandem_partial_fc::PartialFc;
use tandem_train::checkpoint::{CheckpointError, Checkpointer, ShardDict, TrainingStateDict};
use tandem_train::state::{sampler_state_from_value, sampler_value};
use tandem_train::{schedule, LoaderPosition, Resumed, Step};

/// The name of the head's row shard (centres and their optimizer state) in a checkpoint.
pub const HEAD_SHARD: &str = "head";
/// The name of each rank's BatchNorm statistics in a checkpoint.
pub const BUFFERS_SHARD: &str = "buffers";

/// Why the face state could not be saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum FaceStateError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(
        "{}: the checkpoint's head is {saved_classes} classes x {saved_embedding}, this run's \
         {classes} x {embedding}", dir.display()
    )]
    HeadShape {
        dir: PathBuf,
        saved_classes: usize,
        saved_embedding: usize,
        classes: usize,
        embedding: usize,
    },
    #[error("{}: {what}: {why}", dir.display())]
    Restore { dir: PathBuf, what: &'static str, why: String },
    #[error("the face state: {0}")]
    Save(String),
}

/// The face recipe's state, borrowed for [`save`] or [`resume`]: the backbone (a `Ddp` or any
/// [`ParamModule`]; its parameters are the optimizer's first group), the head, the optimizer
/// over both, the [`Step`] (GradScaler and schedule) and the step count.
pub struct FaceState<'a> {
    backbone: &'a dyn ParamModule,
    head: &'a mut PartialFc,
    opt: &'a mut dyn TorchOptimizer,
    step: &'a mut Step,
    global_step: u64,
    order: Option<&'a [String]>,
    config: Option<String>,
    seed: u64,
}

impl<'a> FaceState<'a> {
    pub fn new(
        backbone: &'a dyn ParamModule,
        head: &'a mut PartialFc,
        opt: &'a mut dyn TorchOptimizer,
        step: &'a mut Step,
    ) -> Self {
        FaceState { backbone, head, opt, step, global_step: 0, order: None, config: None, seed: 0 }
    }
    /// Optimizer steps done (what a save records).
    pub fn global_step(mut self, step: u64) -> Self {
        self.global_step = step;
        self
    }
    /// The backbone's state-dict names in torch's order (the file lists them so).
    pub fn order(mut self, order: &'a [String]) -> Self {
        self.order = Some(order);
        self
    }
    /// A text kept in the checkpoint as its `config` entry (the run's settings).
    pub fn config(mut self, text: String) -> Self {
        self.config = Some(text);
        self
    }
    /// The run's seed, kept as the checkpoint's `rng` entry (every draw derives from it).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
}

/// Saves `state` with the loader at `position` as checkpoint `step-NNNNNNNN` under `ckpts`
/// (a collective: every rank writes its head rows and BatchNorm statistics, rank 0 the
/// replicated part and the manifest). Returns the checkpoint's directory.
pub fn save(
    ckpts: &mut Checkpointer,
    state: &FaceState<'_>,
    position: &SamplerState,
    group: &ProcessGroup,
) -> Result<PathBuf, FaceStateError> {
    let step = state.global_step;
    let name = format!("step-{step:08}");
    // A synchronous save writes the head and its momentum from their own memory: a staging
    // copy would double the head's footprint at every save (at a million classes and more, the
    // difference between a save and the kernel's OOM killer).
    let (rank, world) = (group.rank(), group.size());
    ckpts.save_built(group, &name, || state_dict(state, position, rank, world))
}

/// This rank's face state as a [`TrainingStateDict`]: the replicated part (built on rank 0
/// only), the `head` row shard (`{weight, state}`: the centres and the head's optimizer entry)
/// and the `buffers` rank shard. Copies of the tensors, or inside `tandem_nn::convert::lend`
/// views of them ([`save`] lends).
pub fn state_dict(
    state: &FaceState<'_>,
    position: &SamplerState,
    rank: usize,
    world: usize,
) -> Result<TrainingStateDict, FaceStateError> {
    let fail = |e: &dyn std::fmt::Display| FaceStateError::Save(e.to_string());
    let head_index = state.backbone.params().len() as i64;
    let full_opt = state.opt.state_dict().map_err(|e| fail(&e))?;
    let (rest, head_state) = optimizer_entry::split_optimizer(full_opt, head_index);
    let split = state.head.split();
    let head_weight = state.head.weight().as_tensor();
    let weight = tandem_nn::convert::to_ckpt(head_weight).map_err(|e| fail(&e))?;
    let head = Value::dict_from([("weight", Value::Tensor(weight)), ("state", head_state)]);
    let buffers = buffers_value(&state.backbone.named_buffers()).map_err(|e| fail(&e))?;
    let replicated = if rank == 0 {
        replicated_value(state, rest, position, world).map_err(|e| fail(&e))?
    } else {
        Value::None
    };
    let classes = state.head.config().num_classes;
    Ok(TrainingStateDict::new(state.global_step, position.epoch, replicated)
        .shard(ShardDict::rows(HEAD_SHARD, split.start, split.len, classes, head))
        .shard(ShardDict::rank(BUFFERS_SHARD, buffers)))
}

/// The replicated part of the face state: backbone, the optimizer's state without the head's
/// entry (`rest`), scheduler, GradScaler, sampler position, counters and config. What rank 0
/// writes as `replicated.pt` and a live regroup's source sends.
pub fn replicated_value(
    state: &FaceState<'_>,
    rest: Value,
    position: &SamplerState,
    world: usize,
) -> tandem_nn::Result<Value> {
    let backbone = state.backbone.state_dict()?;
    let backbone = match state.order {
        Some(order) => in_order(backbone, order),
        None => backbone,
    };
    Ok(Value::dict_from([
        ("epoch", Value::Int(position.epoch as i64)),
        ("global_step", Value::Int(state.global_step as i64)),
        ("world_size", Value::Int(world as i64)),
        ("backbone", backbone),
        ("optimizer", rest),
        ("scheduler", schedule::state(state.step.lr_scheduler())),
        ("scaler", state.step.grad_scaler().map_or(Value::None, GradScaler::state_dict)),
        ("sampler", sampler_value(position)),
        ("rng", Value::dict_from([("seed", Value::Int(state.seed as i64))])),
        ("config", state.config.clone().map_or(Value::None, Value::Str)),
    ]))
}

/// Restores the newest complete checkpoint under `ckpts` into `state` and `loader`, on this
/// world size or another (the head's rows and their optimizer state re-split), `None` when there
/// is none. A collective. The schedule is stretched over the steps left to the end of `epochs`
/// from the restored position.
pub fn resume(
    ckpts: &Checkpointer,
    state: &mut FaceState<'_>,
    loader: &mut dyn LoaderPosition,
    epochs: u64,
    group: &ProcessGroup,
) -> Result<Option<Resumed>, FaceStateError> {
    let rank = group.rank();
    let Some(saved) = ckpts.latest()? else { return Ok(None) };
    let dir = saved.path().to_path_buf();
    let cfg = state.head.config();
    let (classes, embedding) = (cfg.num_classes, cfg.embedding_size);
    let saved_classes = saved.rows_total(HEAD_SHARD).unwrap_or(0);
    let shape_error = |saved_embedding: usize| FaceStateError::HeadShape {
        dir: dir.clone(),
        saved_classes,
        saved_embedding,
        classes,
        embedding,
    };
    if saved_classes != classes {
        return Err(shape_error(0));
    }
    let rep = saved.replicated()?;
    let split = state.head.split();
    let rows = saved.read_rows(HEAD_SHARD, split.start..split.start + split.len)?;
    let own = rank.min(saved.world_size() - 1);
    let buffers = saved.read_rank(BUFFERS_SHARD, own)?.unwrap_or(Value::None);
    let label = dir.display().to_string();
    let restore = |what: &'static str| {
        let dir = dir.clone();
        move |why: &dyn std::fmt::Display| FaceStateError::Restore {
            dir: dir.clone(),
            what,
            why: why.to_string(),
        }
    };
    let weight = rows
        .get("weight")
        .and_then(Value::as_tensor)
        .ok_or_else(|| restore("head centres")(&"no `weight` tensor"))?;
    if weight.shape.get(1) != Some(&embedding) {
        return Err(shape_error(weight.shape.get(1).copied().unwrap_or(0)));
    }
    let device = state.head.weight().device().clone();
    let weight =
        tandem_nn::convert::from_ckpt(weight, &device).map_err(|e| restore("head centres")(&e))?;
    state.head.weight().set(&weight).map_err(|e| restore("head centres")(&e))?;
    let head_index = state.backbone.params().len() as i64;
    let rest = rep.get("optimizer").ok_or_else(|| restore("optimizer")(&"no such entry"))?;
    let head_state = rows.get("state").cloned().unwrap_or(Value::None);
    let full = optimizer_entry::merge_optimizer(rest, head_index, head_state);
    state.opt.load_state_dict(&full).map_err(|e| restore("optimizer state")(&e))?;
    if rep.get("sampler") == Some(&Value::None) {
        // Converted from arcface_torch: the start of `epoch`, in this run's order.
        loader.set_epoch(saved.epoch());
    }
    let step = restore_replicated(state, &rep, &buffers, loader, epochs, &label, rank == 0)
        .map_err(|(what, why)| restore(what)(&why))?;
    // Every rank has read what it needs before any goes on (and perhaps saves over it).
    group.barrier().map_err(|source| CheckpointError::Comm {
        what: "barrier after reading the checkpoint".into(),
        source: Box::new(source),
    })?;
    let epoch = loader.position().epoch;
    let (saved_world, world) = (saved.world_size(), group.size());
    let note = (saved_world != world).then(|| {
        format!(
            "the checkpoint was written by {saved_world} ranks, this run has {world}: the \
             {classes} class centres and their optimizer state are re-split ({} per rank here)",
            split.len
        )
    });
    Ok(Some(Resumed { path: dir, step, epoch, world_size: saved_world, note }))
}

/// Restores the replicated part `rep` (see [`replicated_value`]) but the optimizer: the backbone
/// with `buffers` (this rank's BatchNorm statistics) over the saved ones, the loader position
/// (unless the entry is `None`: a converted checkpoint), the step count (also the head's), the
/// schedule stretched to the end of `epochs`, and the GradScaler. `label` names the source in
/// messages; `say` lets this rank print the notes. Returns the step; an error names the entry.
pub fn restore_replicated(
    state: &mut FaceState<'_>,
    rep: &Value,
    buffers: &Value,
    loader: &mut dyn LoaderPosition,
    epochs: u64,
    label: &str,
    say: bool,
) -> Result<u64, (&'static str, String)> {
    let get = |k: &'static str| rep.get(k).ok_or((k, "no such entry".to_string()));
    let mut backbone = get("backbone")?.clone();
    overlay(&mut backbone, buffers);
    state.backbone.load_state_dict(&backbone).map_err(|e| ("backbone", e.to_string()))?;
    let saved = get("sampler")?;
    if saved != &Value::None {
        let position = sampler_state_from_value(saved).map_err(|e| ("sampler", e.to_string()))?;
        loader.set_position(&position).map_err(|e| ("sampler", e.to_string()))?;
    }
    let step = get("global_step")?.as_int().unwrap_or(0) as u64;
    state.global_step = step;
    state.head.set_steps_taken(step);
    let left = loader.steps_to_end(epochs);
    schedule::load(
        state.step.lr_scheduler_mut(),
        get("scheduler")?,
        state.opt,
        Some(step + left),
        &format!("{label}: scheduler"),
    )
    .map_err(|e| ("scheduler", e.to_string()))?;
    match (state.step.grad_scaler_mut(), get("scaler")?) {
        (Some(s), Value::None) if say => {
            tracing::warn!(
                "{label}: no GradScaler state; the loss scale starts at {}",
                s.get_scale()
            )
        }
        (Some(_), Value::None) | (None, _) => {}
        (Some(s), saved) => s.load_state_dict(saved).map_err(|e| ("GradScaler", e.to_string()))?,
    }
    Ok(step)
}

/// A rank's BatchNorm statistics as a state-dict fragment.
fn buffers_value(buffers: &[(String, candle_core::Var)]) -> tandem_nn::Result<Value> {
    let mut items = Vec::with_capacity(buffers.len());
    for (name, var) in buffers {
        items.push((name.clone(), Value::Tensor(tandem_nn::convert::to_ckpt(var.as_tensor())?)));
    }
    Ok(Value::dict_from(items))
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
