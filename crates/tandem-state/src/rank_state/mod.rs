//! State one rank holds alone beside the replicated training state — PartialFC's class rows
//! and their optimizer entries, per-rank BatchNorm statistics, FSDP's shards — as one
//! trait the [`TrainingState`](crate::TrainingState) carries ([`TrainingState::part`]): a save
//! writes each part's shards beside the replicated part, a resume loads each from the shards of
//! any world size, and under live recovery each part mirrors itself to a buddy after its steps
//! and re-splits after a regroup ([`crate::live::Mirrored`] does both for a
//! [`crate::live::RankPart`]), driven by [`LiveTraining`](crate::live::LiveTraining) the same
//! way for the `Trainer` (tandem-train) and a user's own loop. A ZeRO-sharded optimizer's
//! entries are such a part too, one `LiveTraining` adds itself.
//!
//! A part may hold some of the optimizer's entries ([`RankState::optimizer_entries`]: the
//! head's momentum is split with its rows): they leave the replicated optimizer state, travel
//! with the part, and come back into the optimizer when the state is loaded.
//!
//! [`TrainingState::part`]: crate::TrainingState::part
pub(crate) mod elements;
pub(crate) mod part;

use candle_core::{DType, Tensor, Var};
use tandem_ckpt::Value;
use tandem_comm::ProcessGroup;
use tandem_optim::OptimizerState;

use crate::error::{Context, Result};
use serde::{Deserialize, Serialize};
use tandem_checkpoint::{Saved, ShardDict};

/// How a re-split went, summed over the world; counts are of keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegroupCounts {
    /// Keys a rank already held as its own.
    pub kept: u64,
    /// Keys received from the rank that owned them.
    pub moved: u64,
    /// Keys restored from a mirror (the owner is gone).
    pub from_mirror: u64,
    /// Keys no rank held, read by the caller's fill (the last checkpoint, the initial centres).
    pub reloaded: u64,
    /// Keys no rank held and nothing filled: their state starts afresh.
    pub fresh: u64,
    /// Steps of training lost, summed over the keys whose source was older than the world's
    /// step (`keys x steps`).
    pub stale_steps: u64,
    /// Bytes sent point to point.
    pub bytes_sent: u64,
}

impl RegroupCounts {
    pub(crate) fn add(&mut self, o: &RegroupCounts) {
        self.kept += o.kept;
        self.moved += o.moved;
        self.from_mirror += o.from_mirror;
        self.reloaded += o.reloaded;
        self.fresh += o.fresh;
        self.stale_steps += o.stale_steps;
        self.bytes_sent += o.bytes_sent;
    }
}

/// How a regroup re-split one kind of state each rank holds alone, summed over the world; the
/// part's owner names it and its units.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resplit {
    /// What was re-split, as its owner names it (`optimizer shards`; the face recipe's
    /// `head rows`).
    pub part: String,
    /// What a key's lost step is called (`parameter-steps of state`, `row-steps of head
    /// training`).
    pub lost_unit: String,
    #[serde(flatten)]
    pub counts: RegroupCounts,
    /// How the part lies over the new world, where its owner says (an HSDP model's mesh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
}

impl std::fmt::Display for Resplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.counts;
        write!(
            f,
            "{}: {} kept, {} moved, {} restored from mirrors, {} reloaded, {} started afresh; {} {} lost; {} KiB moved",
            self.part,
            c.kept,
            c.moved,
            c.from_mirror,
            c.reloaded,
            c.fresh,
            c.stale_steps,
            self.lost_unit,
            c.bytes_sent.div_ceil(1024)
        )?;
        match &self.layout {
            Some(layout) => write!(f, "; {layout}"),
            None => Ok(()),
        }
    }
}

/// What live recovery's mirrors cost rank 0 over the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MirrorCost {
    /// What is mirrored, as its owner names it (`optimizer shards`; the face recipe's `head`).
    pub what: String,
    /// A mirror every this many steps.
    pub every: u64,
    pub taken: u64,
    /// Bytes each rank sends per mirror.
    pub bytes_per_rank: u64,
    /// Mean seconds one mirror took on rank 0.
    pub mean_secs: f64,
}

/// What a part restored or re-split.
#[derive(Debug, Default)]
pub struct PartLoaded {
    /// Its optimizer entries, in [`RankState::optimizer_entries`]'s order (`Value::None`: none
    /// yet).
    pub entries: Vec<Value>,
    /// What to tell the user (how the part was re-split over another world size).
    pub note: Option<String>,
    /// How a live re-split moved the part, for the regroup's report.
    pub resplit: Option<Resplit>,
}

/// State one rank holds alone (see the module docs).
pub trait RankState {
    /// The optimizer's parameter indices whose entries this part holds (none by default).
    fn optimizer_entries(&self) -> Vec<usize> {
        Vec::new()
    }

    /// This rank's shards of a checkpoint of step `step`; `entries`: the optimizer's entries
    /// for [`RankState::optimizer_entries`], in that order. A copy of each tensor, or a view
    /// of it inside a synchronous save (the save lends the tensors).
    fn shards(&self, entries: Vec<Value>, step: u64) -> Result<Vec<ShardDict>>;

    /// Restores this rank's part from `saved`, written on any world size.
    fn load(&mut self, saved: &Saved) -> Result<PartLoaded>;

    /// Live recovery, after every completed step `step` on every rank (a collective when it
    /// mirrors); `optimizer` as of that step.
    fn after_step(
        &mut self,
        _group: &ProcessGroup,
        _optimizer: &dyn OptimizerState,
        _step: u64,
    ) -> Result<()> {
        Ok(())
    }

    /// Live recovery, after the replicated state moved: re-splits the part over the new world
    /// `group` as of `step` (a collective), from the copies the ranks hold and, for what no
    /// rank holds, `last` (the newest checkpoint). `optimizer` still holds this rank's own
    /// entries; `world_optimizer` is the world's optimizer state without the parts' entries
    /// (what the trainer loads with the returned entries afterwards). A part whose parameters
    /// change shape puts the new ones into `optimizer` ([`OptimizerState::replace_param`]).
    fn regroup(
        &mut self,
        _group: &ProcessGroup,
        _step: u64,
        _optimizer: &mut dyn OptimizerState,
        _world_optimizer: &Value,
        _last: Option<&Saved>,
    ) -> Result<PartLoaded> {
        Ok(PartLoaded::default())
    }

    /// What this part's live mirrors cost this rank, if it keeps any.
    fn mirror_cost(&self) -> Option<MirrorCost> {
        None
    }
}

/// A model's buffers that differ between ranks (BatchNorm statistics under Ddp's
/// `broadcast_buffers=False`, as arcface_torch trains): the replicated part holds rank 0's,
/// and each rank's own go into a rank shard. A resume on another world size gives rank `r`
/// the statistics of rank `min(r, W - 1)` of the `W` that wrote it (a checkpoint without the
/// shard leaves the replicated part's); a live regroup leaves the source's (they came with the
/// replicated state).
pub struct RankBuffers {
    name: String,
    buffers: Vec<(String, Var)>,
    rank: usize,
    /// Under live recovery without a replicated model to carry them: whether this rank holds
    /// the run's statistics (a replacement does not until a regroup gives it some).
    holds: Option<bool>,
}

impl RankBuffers {
    /// `buffers` (a model's `named_buffers()`) of rank `rank`, saved as shard `name`.
    pub fn new(name: impl Into<String>, buffers: Vec<(String, Var)>, rank: usize) -> Self {
        RankBuffers { name: name.into(), buffers, rank, holds: None }
    }

    /// Under live recovery of a sharded model (whose replicated state is empty, so the
    /// regroup's source sends no buffers): at a regroup, a rank that holds no statistics (a
    /// replacement: `holds` false) takes those of the lowest rank that does.
    pub fn live(mut self, holds: bool) -> Self {
        self.holds = Some(holds);
        self
    }

    /// Every rank without statistics takes the lowest holder's (a collective).
    fn share_with_newcomers(&mut self, group: &ProcessGroup, holds: bool) -> Result<()> {
        let flags = group
            .all_gather_bytes_at_most(&[u8::from(holds)], 1)
            .map_err(crate::error::comm("live recovery: which ranks hold BatchNorm statistics"))?;
        let (Some(src), true) =
            (flags.iter().position(|f| f[..] == [1]), flags.iter().any(|f| f[..] == [0]))
        else {
            return Ok(());
        };
        for (name, var) in &self.buffers {
            let what = || format!("live recovery: buffer `{name}`");
            let t = var.as_tensor();
            let mut v = t
                .flatten_all()
                .and_then(|t| t.to_dtype(DType::F64))
                .and_then(|t| t.to_vec1::<f64>())
                .with_context(what)?;
            group.broadcast(&mut v, src).map_err(crate::error::comm(what()))?;
            if !holds {
                let got = Tensor::from_vec(v, t.shape(), t.device())
                    .and_then(|g| g.to_dtype(t.dtype()))
                    .with_context(what)?;
                var.set(&got).with_context(what)?;
            }
        }
        Ok(())
    }
}

impl RankState for RankBuffers {
    fn shards(&self, _entries: Vec<Value>, _step: u64) -> Result<Vec<ShardDict>> {
        let mut items = Vec::with_capacity(self.buffers.len());
        for (name, var) in &self.buffers {
            let t = tandem_nn::convert::to_ckpt(var.as_tensor())?;
            items.push((name.clone(), Value::Tensor(t)));
        }
        Ok(vec![ShardDict::rank(&self.name, Value::dict_from(items))])
    }

    /// This rank's buffers (the nearest saved rank's), or, from a checkpoint that kept them in
    /// its replicated model (a Ddp run's, resumed sharded), the model's.
    fn load(&mut self, saved: &Saved) -> Result<PartLoaded> {
        let from = self.rank.min(saved.world_size().saturating_sub(1));
        let held = saved.shard_names().contains(&self.name.as_str());
        let own = if held { saved.read_rank(&self.name, from)? } else { None };
        let (value, whose) = match own {
            Some(value) => (value, format!("`{}` of rank {from}", self.name)),
            None => match saved.replicated()?.get("model") {
                Some(model) => (model.clone(), "the model".to_string()),
                None => return Ok(PartLoaded::default()),
            },
        };
        for (name, var) in &self.buffers {
            let Some(t) = value.get(name).and_then(Value::as_tensor) else { continue };
            let what = || format!("{}: {whose}: {name}", saved.path().display());
            let t = tandem_nn::convert::from_ckpt(t, var.device()).with_context(what)?;
            let t = t.to_dtype(var.dtype()).with_context(what)?;
            var.set(&t).with_context(what)?;
        }
        Ok(PartLoaded::default())
    }

    fn regroup(
        &mut self,
        group: &ProcessGroup,
        _step: u64,
        _optimizer: &mut dyn OptimizerState,
        _world_optimizer: &Value,
        _last: Option<&Saved>,
    ) -> Result<PartLoaded> {
        self.rank = group.rank();
        if let Some(holds) = self.holds {
            self.share_with_newcomers(group, holds)?;
            self.holds = Some(true);
        }
        Ok(PartLoaded::default())
    }
}
