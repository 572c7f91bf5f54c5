//! The per-rank parts of a [`TrainingState`] under live recovery, run the same way for a
//! `Trainer` (tandem-train) and a user's own loop: after every step each part mirrors itself
//! to its buddy when due ([`RankState::after_step`]), and after a regroup moved the replicated
//! state each part re-splits over the new world ([`RankState::regroup`]) and the optimizer takes
//! the entries the parts hold back with the world's hyperparameters.
//!
//! Beside the state's own parts (PartialFC's rows, per-rank buffers) [`LiveParts`] keeps one it
//! adds itself: a sharded optimizer's (ZeRO-1's) entries ([`LiveShards`]), which nobody else
//! holds between steps (a user's `TrainingState` is rebuilt for each call).
use std::path::PathBuf;

use tandem_ckpt::Value;
use tandem_comm::ProcessGroup;

use super::entries::LiveShards;
use crate::error::{Context, Result};
use crate::rank_state::RankState;
use crate::rank_state::{MirrorCost, Resplit};
use crate::state::{put_entry, TrainingState};
use tandem_checkpoint::{Checkpointer, Saved, KEEP_LAST};

/// What a live job keeps for a state's parts between steps (see the module docs).
pub(crate) struct LiveParts {
    /// A sharded optimizer's entries are mirrored every this many steps.
    mirror_every: u64,
    /// The checkpoints that fill what no rank holds after a regroup (two neighbours lost).
    checkpoints: Option<PathBuf>,
    /// A sharded optimizer's entries, once a state with one was seen.
    zero: Option<LiveShards>,
}

impl LiveParts {
    pub fn new() -> Self {
        LiveParts { mirror_every: 1, checkpoints: None, zero: None }
    }

    pub fn set_mirror_every(&mut self, every: u64) {
        self.mirror_every = every.max(1);
    }

    pub fn set_checkpoints(&mut self, dir: PathBuf) {
        self.checkpoints = Some(dir);
    }

    /// Where the run's checkpoints are, if the loop said ([`LiveTraining::checkpoints`]).
    ///
    /// [`LiveTraining::checkpoints`]: super::LiveTraining::checkpoints
    pub fn checkpoints(&self) -> Option<PathBuf> {
        self.checkpoints.clone()
    }

    /// Starts keeping `state`'s sharded optimizer entries, if it has any and they are not kept
    /// yet; `holds`: whether this rank holds a shard now (a replacement holds none until it
    /// joins).
    pub fn track(&mut self, state: &TrainingState<'_>, holds: bool) {
        if self.zero.is_none() && state.optimizer.owned_params().is_some() {
            let params = state.optimizer.owners_for(1).map_or(0, |owners| owners.len());
            self.zero = Some(LiveShards::new(params, self.mirror_every, holds));
        }
    }

    /// After completed step `state.step` on every rank: each part mirrors itself when due (a
    /// collective then).
    pub fn after_step(
        &mut self,
        group: &ProcessGroup,
        state: &mut TrainingState<'_>,
    ) -> Result<()> {
        self.track(state, true);
        let step = state.step;
        let TrainingState { parts, optimizer, .. } = state;
        for part in with_own(parts, &mut self.zero) {
            part.after_step(group, &**optimizer, step)?;
        }
        Ok(())
    }

    /// After a regroup moved the replicated state: re-splits every part over the new world
    /// `group` (a collective) and loads the optimizer with the parts' entries and the world's
    /// state (`sent` by the regroup's source; `None` on the source, whose own it is). Returns
    /// how the first part that moved did.
    pub fn regroup(
        &mut self,
        group: &ProcessGroup,
        state: &mut TrainingState<'_>,
        sent: Option<Value>,
    ) -> Result<Option<Resplit>> {
        self.track(state, true);
        let step = state.step;
        let entries = state.part_entries();
        // What no rank holds comes from the newest checkpoint; without a readable one it
        // starts afresh.
        let last = match state.parts.is_empty() {
            true => None,
            false => self.last_checkpoint(),
        };
        let received = sent.is_some();
        let mut world = match sent {
            Some(sent) => sent,
            None if entries.is_empty() => Value::None,
            None => state.optimizer_split()?.0,
        };
        let (sharded, held_apart) = (self.zero.is_some(), !entries.is_empty());
        let TrainingState { parts, optimizer, .. } = state;
        let mut resplit = None;
        let mut moved = Vec::with_capacity(parts.len() + 1);
        // The sharded optimizer's part last: its entries are not among `entries`, and `moved`
        // keeps the state's parts' order.
        for part in with_own(parts, &mut self.zero) {
            let got = part.regroup(group, step, &mut **optimizer, &world, last.as_ref())?;
            resplit = resplit.or(got.resplit);
            moved.push(got.entries.into_iter());
        }
        for (index, p) in entries {
            put_entry(&mut world, index, moved[p].next().unwrap_or(Value::None));
        }
        // A sharded optimizer took its shard with the world's hyperparameters in its part; any
        // other takes the world's state now, with the parts' entries put back.
        if !sharded && (received || held_apart) && !matches!(world, Value::None) {
            optimizer
                .load_optimizer_state(&world)
                .context("live recovery: loading the optimizer with the re-split entries")?;
        }
        Ok(resplit)
    }

    /// What the mirrors of `state`'s parts and of the sharded optimizer cost this rank.
    pub fn mirror_costs(&self, state: &TrainingState<'_>) -> Vec<MirrorCost> {
        let parts = state.parts.iter().filter_map(|p| p.mirror_cost());
        parts.chain(self.zero.iter().filter_map(|z| z.mirror_cost())).collect()
    }

    fn last_checkpoint(&self) -> Option<Saved> {
        let dir = self.checkpoints.as_ref()?;
        Checkpointer::new(dir, KEEP_LAST).latest().unwrap_or(None)
    }
}

/// The state's parts, then the one the live job adds itself (a sharded optimizer's entries).
fn with_own<'r>(
    parts: &'r mut [&mut dyn RankState],
    zero: &'r mut Option<LiveShards>,
) -> Vec<&'r mut dyn RankState> {
    let mut all: Vec<&'r mut dyn RankState> = Vec::with_capacity(parts.len() + 1);
    for part in parts.iter_mut() {
        all.push(&mut **part);
    }
    if let Some(z) = zero.as_mut() {
        all.push(z);
    }
    all
}
