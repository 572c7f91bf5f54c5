//! ZeRO-1's optimizer shards as a [`RankPart`]: each rank holds the optimizer state of the
//! parameters it owns, keyed by parameter index, and [`crate::rank_state::part`] mirrors and re-splits
//! them. A parameter nobody holds (two neighbours lost at once) starts with fresh optimizer
//! state, counted; the parameters themselves are replicated and never lost.
//!
//! Entries travel as a `.pt` image of a torch optimizer state dict's `state` (integer keys).
//!
//! [`LiveShards`] is the [`RankState`] part the `Trainer` (tandem-train) adds itself under
//! live recovery for a recipe whose optimizer is sharded
//! ([`OptimizerState::owned_params`]): the recipe writes nothing for it.
use std::ops::Range;
use std::time::Instant;

use tandem_ckpt::Value;
use tandem_comm::ProcessGroup;
use tandem_optim::OptimizerState;

use crate::error::{Context, Result};
use crate::rank_state::part::{owned_by, runs, Mirrored, PartHeader, RankPart};
use crate::rank_state::{MirrorCost, Resplit};
use crate::rank_state::{PartLoaded, RankState};
use crate::TrainError;
use tandem_checkpoint::{Saved, ShardDict};

/// Entries (parameter index → its optimizer state) held as of `step`, by ascending index.
#[derive(Clone, Debug, PartialEq)]
pub struct Entries {
    pub step: u64,
    pub entries: Vec<(usize, Value)>,
}

impl Entries {
    /// The `state` dict of a torch-layout optimizer state dict (integer keys) as of `step`.
    pub fn from_state(state: &Value, step: u64) -> Entries {
        let mut entries: Vec<(usize, Value)> = match state {
            Value::Dict(items) => items
                .iter()
                .filter_map(|(k, v)| Some((usize::try_from(k.as_int()?).ok()?, v.clone())))
                .collect(),
            _ => Vec::new(),
        };
        entries.sort_by_key(|(i, _)| *i);
        entries.dedup_by_key(|(i, _)| *i);
        Entries { step, entries }
    }

    /// The entries as a `state` dict (integer keys).
    pub fn into_state(self) -> Value {
        Value::Dict(self.entries.into_iter().map(|(i, v)| (Value::Int(i as i64), v)).collect())
    }

    fn within(&self, keys: &[Range<usize>]) -> Vec<(usize, Value)> {
        let inside = |i: &usize| keys.iter().any(|k| k.contains(i));
        self.entries.iter().filter(|(i, _)| inside(i)).cloned().collect()
    }
}

impl RankPart for Entries {
    const WHAT: &'static str = "the ZeRO optimizer shards";

    fn header(&self) -> PartHeader {
        let ranges = runs(self.entries.iter().map(|(i, _)| *i));
        PartHeader {
            ranges: ranges.iter().map(|r| (r.start, r.end)).collect(),
            step: self.step,
            labels: vec![],
        }
    }

    fn encode(&self, keys: &[Range<usize>]) -> Result<Vec<u8>> {
        let state = Entries { step: self.step, entries: self.within(keys) }.into_state();
        tandem_ckpt::to_pt_bytes(&state).context("encoding optimizer entries")
    }

    fn decode(header: &PartHeader, bytes: Vec<u8>) -> Result<Self> {
        let v = tandem_ckpt::pt::load_from_bytes("optimizer entries", bytes, false)
            .context("decoding optimizer entries")?;
        let got = Entries::from_state(&v, header.step);
        let held = got.header().ranges;
        if held != header.ranges {
            let why = format!("entries for parameters {held:?}, announced {:?}", header.ranges);
            return Err(TrainError::Invalid(why));
        }
        Ok(got)
    }

    fn take(&self, keys: &Range<usize>) -> Result<Self> {
        Ok(Entries { step: self.step, entries: self.within(std::slice::from_ref(keys)) })
    }

    fn assemble(
        _want: &[Range<usize>],
        step: u64,
        _labels: &[String],
        pieces: Vec<Self>,
    ) -> Result<Self> {
        let mut entries: Vec<(usize, Value)> = pieces.into_iter().flat_map(|p| p.entries).collect();
        entries.sort_by_key(|(i, _)| *i);
        Ok(Entries { step, entries })
    }
}

/// A sharded optimizer's entries under live recovery: mirrored to the next rank every `K`
/// steps, re-split over the new world's partition after a regroup (each parameter's from its
/// newest holder, fresh where nobody holds it), while the hyperparameters move with the
/// replicated state.
pub(crate) struct LiveShards {
    mirror: Mirrored<Entries>,
    /// The optimizer's parameters (the keys of the entries).
    params: usize,
}

impl LiveShards {
    /// The entries of an optimizer over `params` parameters, mirrored every `every` steps;
    /// `holds`: whether this rank starts with a shard (a replacement holds none until it
    /// joins).
    pub fn new(params: usize, every: u64, holds: bool) -> Self {
        LiveShards { mirror: Mirrored::new(every, holds), params }
    }

    /// Sends this rank's entries as of `step` to the next rank and keeps the previous rank's
    /// (a collective).
    fn send_mirror(
        &mut self,
        group: &ProcessGroup,
        opt: &dyn OptimizerState,
        step: u64,
    ) -> Result<()> {
        let clock = Instant::now();
        let shard = sharded(opt)?;
        let own = Entries::from_state(&shard.entries, step);
        self.mirror.exchange(group, &own, self.params, clock)
    }
}

/// This rank's part of a sharded optimizer.
fn sharded(opt: &dyn OptimizerState) -> Result<tandem_optim::OptimizerShard> {
    opt.optimizer_shard()?.context("live recovery: the optimizer is no longer sharded")
}

/// Only under live recovery: a sharded optimizer's entries are saved and loaded by the
/// optimizer itself (its entry shard), so this part has no shards of its own.
impl RankState for LiveShards {
    fn shards(&self, _entries: Vec<Value>, _step: u64) -> Result<Vec<ShardDict>> {
        Ok(Vec::new())
    }

    fn load(&mut self, _saved: &Saved) -> Result<PartLoaded> {
        Ok(PartLoaded::default())
    }

    /// This rank's entries as of `step`, mirrored when due (a collective then).
    fn after_step(
        &mut self,
        group: &ProcessGroup,
        optimizer: &dyn OptimizerState,
        step: u64,
    ) -> Result<()> {
        self.mirror.stepped(step);
        match self.mirror.due(step) {
            true => self.send_mirror(group, optimizer, step),
            false => Ok(()),
        }
    }

    /// Re-splits the entries over `group`'s partition and has the optimizer take this rank's
    /// with the world's hyperparameters (`world_optimizer`: what the regroup's source sent,
    /// else `None` for this rank's own) (a collective).
    fn regroup(
        &mut self,
        group: &ProcessGroup,
        step: u64,
        optimizer: &mut dyn OptimizerState,
        world_optimizer: &Value,
        _last: Option<&Saved>,
    ) -> Result<PartLoaded> {
        let shard = sharded(optimizer)?;
        let own = self.mirror.holds().map(|at| Entries::from_state(&shard.entries, at));
        let owner = optimizer.owners_for(group.size()).unwrap_or_default();
        let want = |rank: usize| owned_by(&owner, rank);
        let keys = owner.len();
        let (entries, counts) =
            self.mirror.regroup(group, step, keys, own.as_ref(), &want, &mut |_| Ok(None))?;
        let groups = match world_optimizer {
            Value::None => &shard.groups,
            sent => sent,
        };
        let state = tandem_optim::OptimizerShard::full(groups, entries.into_state());
        let taking = optimizer.repartition(&state);
        taking.context("live recovery: taking the new world's optimizer shard")?;
        // This rank's new shard is mirrored at once, so the next death is covered.
        self.send_mirror(group, optimizer, step)?;
        let resplit = Some(Resplit {
            part: "optimizer shards".into(),
            lost_unit: "parameter-steps of state".into(),
            counts,
            layout: None,
        });
        Ok(PartLoaded { resplit, ..PartLoaded::default() })
    }

    fn mirror_cost(&self) -> Option<MirrorCost> {
        Some(self.mirror.cost("optimizer shard"))
    }
}
