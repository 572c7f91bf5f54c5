//! The [`Trainer`] under live recovery (`tandem run --live-recovery`): its outer loop (train,
//! and on a peer's death or a joining rank regroup and go on), joining as a replacement, the
//! regroup's report, and what moves with the state — the recipe's [`TrainingState`] (its parts
//! re-split by [`LiveTraining`] as a user's own loop's are) and the loop's record of what it
//! has done.
use super::{report_to, whole_state, Ended, Recipe, Trainer, NO_STATE};
use crate::events::{Event, Regroup};
use crate::fault;
use crate::live::{decode_record, encode_record, LiveState, LiveTraining, WorldChange};
use crate::schedule;
use crate::state::{LoaderPosition, TrainingState};
use crate::{Context, Result, TrainError};

/// Why a live world regroups, and whether the step in flight failed (it is redone).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Regrouping {
    pub(crate) cause: String,
    pub(crate) step_failed: bool,
}

/// The cause of a restart generation's regroup.
const RESTARTED: &str = "every member of the world before died";

impl Default for Regrouping {
    /// A process that joins and was told nothing else: the world regroups to let it in.
    fn default() -> Self {
        Regrouping { cause: Regroup::JOINED.into(), step_failed: false }
    }
}

impl<R: Recipe> Trainer<R> {
    /// Trains in the live world `live` (`tandem run --live-recovery`): a peer's death or a
    /// joining rank regroups the world instead of ending the run. Call [`Trainer::join_live`]
    /// next (a replacement's group is only a placeholder until it joins).
    pub fn live(mut self, live: LiveTraining) -> Self {
        let live = live.mirror_every(self.opts.mirror_every).checkpoints(self.ckpt.dir());
        self.live = Some(live);
        self
    }

    /// Live recovery's outer loop: trains (and writes the last checkpoint) to the end, and
    /// whenever a peer dies or a rank joins, regroups and goes on from the state of the rank
    /// furthest along — the failed step redone, nothing else.
    pub(crate) fn run_live(&mut self) -> Result<()> {
        loop {
            let ended = match self.train() {
                Ok(Ended::Done) => self.save_last().map(|()| Ended::Done),
                other => other,
            };
            let cause = match ended {
                Ok(Ended::Done) => {
                    let live = self.live.as_ref().context("live recovery without a live world")?;
                    return live.finish();
                }
                Ok(Ended::RegroupWanted) => Regroup::JOINED.to_string(),
                // A collective that failed inside a layer may reach here as text only
                // (candle's errors keep no source); the group knows it broke.
                Err(e) if e.is_peer_failure() || self.group.failure().is_some() => root_cause(&e),
                Err(e) => return Err(e),
            };
            tracing::debug!(step = self.global_step, %cause, "live: leaving the world");
            self.regroup_after(cause)?;
            tracing::debug!(step = self.global_step, world = self.group.size(), "live: regrouped");
        }
    }

    /// Regroups the live world after `cause` (a lost peer, a rank waiting to join): the step in
    /// flight, if any, is put back, background saves end, the state moves from the rank furthest
    /// along, and the new world's rank 0 reports it.
    pub(crate) fn regroup_after(&mut self, cause: String) -> Result<()> {
        if cause != Regroup::JOINED {
            fault::hold_before_regroup();
        }
        self.record.regrouping = Some(Regrouping { cause, step_failed: self.in_flight.is_some() });
        if let Some(position) = self.in_flight.take() {
            // The failed step did not happen: its batch goes back.
            self.loader.load_state(&position)?;
        }
        // A background save this rank started (as the world's rank 0) ends before the world
        // re-forms: the new rank 0 may be another member, and two writers must not share the
        // checkpoint directory. Its failure ends the run as it would without live recovery
        // (the files before it are intact).
        self.settle()?;
        let live = self.live.take().context("live recovery without a live world")?;
        let changed = live.regroup(self);
        self.group = live.group();
        self.live = Some(live);
        let change = changed.context("regrouping")?;
        self.open_logs()?;
        self.report_regroup(change)
    }

    /// Reports a regroup, once: by the new world's rank 0 (a survivor, or a member that joins),
    /// with the source's cause (every rank took the source's record). The world redoes the
    /// step the source had in flight.
    fn report_regroup(&mut self, change: WorldChange) -> Result<()> {
        let Regrouping { mut cause, step_failed } =
            self.record.regrouping.take().unwrap_or_default();
        if change.restarted_from.is_some() {
            cause = RESTARTED.into();
        }
        let resplit = change.resplit.clone();
        let at_unix_s = crate::tfevents::unix_secs();
        let redone = u64::from(step_failed);
        self.emit(Event::Regrouped(Regroup { at_unix_s, cause, change, redone, resplit }))
    }

    /// A replacement rank (or every member at the start) joins the running world.
    pub fn join_live(&mut self) -> Result<Option<WorldChange>> {
        let Some(live) = self.live.take() else { return Ok(None) };
        if live.is_replacement() {
            tracing::debug!("live: built; joining the running world");
        }
        let change = live.start(self);
        if live.has_joined() {
            self.group = live.group();
        }
        self.live = Some(live);
        let change = change.context("joining the running job")?;
        self.open_logs()?;
        if let Some(change) = &change {
            let member = self.live_member();
            let event = Event::Joined { member, change: change.clone() };
            report_to(&self.reporter, &event)?;
            // The world re-formed for this member; as its rank 0 it reports the regroup.
            self.report_regroup(change.clone())?;
        }
        Ok(change)
    }

    /// This process's member slot in the live world (for messages).
    pub fn live_member(&self) -> String {
        self.live.as_ref().map_or_else(
            || std::env::var("RANK").unwrap_or_default(),
            |l| l.generation().members[self.group.rank()].to_string(),
        )
    }

    /// The schedule stretched over the steps this world has left (after a regroup moved the
    /// loader to it), the optimizer's rates set from it.
    fn stretch_schedule(&mut self) -> Result<()> {
        let saved = schedule::state(self.step.lr_scheduler());
        let max_steps = Some(self.global_step + self.loader.steps_to_end(self.opts.epochs));
        let sched = self.step.lr_scheduler_mut();
        schedule::load(sched, &saved, self.recipe.optimizer(), max_steps, "the live state")?;
        Ok(())
    }
}

/// The failure behind a failed collective in a few words: the group's first failure (which
/// names the rank that died) when the error carries it, else the innermost error.
pub(crate) fn root_cause(e: &TrainError) -> String {
    let text = e.root_cause();
    let text = match text.find("first failure in this group: ") {
        Some(i) => text[i + "first failure in this group: ".len()..].to_string(),
        None => text,
    };
    // Keep the first clause; the rest repeats it for each rank the failure passed through.
    let end = text.find(" (process exited").or_else(|| text.find("; ")).unwrap_or(text.len());
    text[..end].to_string()
}

/// A regroup moves the recipe's whole state from the rank furthest along, with the loop's
/// record; every rank then splits the rest of the epoch over the new world and stretches the
/// schedule over the steps that world has left (as a resume on another world size does).
impl<R: Recipe> LiveState for Trainer<R> {
    fn progress(&self) -> u64 {
        self.global_step
    }

    fn with_state(
        &mut self,
        f: &mut dyn FnMut(&mut TrainingState<'_>) -> Result<()>,
    ) -> Result<()> {
        let (n, epoch) = (self.global_step, self.loader.epoch());
        let loader: &mut dyn LoaderPosition = &mut self.loader;
        let mut whole = whole_state(&mut self.recipe, &mut self.step, Some(loader), epoch, n)
            .ok_or_else(|| TrainError::invalid(NO_STATE))?;
        f(&mut whole)?;
        let step = whole.step;
        self.global_step = step;
        Ok(())
    }

    fn record(&mut self) -> Result<Vec<u8>> {
        fault::hit(fault::Phase::Send);
        encode_record(&self.record, "the loop's record")
    }

    fn take_record(&mut self, record: Vec<u8>) -> Result<()> {
        self.record = decode_record(&record, "the loop's record")?;
        Ok(())
    }

    fn regrouped(&mut self, _change: &WorldChange) -> Result<()> {
        // The schedule came as the source saved it: stretched over this world's steps.
        self.stretch_schedule()
    }

    fn restart_from(&mut self, _dir: Option<&std::path::Path>) -> Result<String> {
        // The Trainer's own resume (its checkpoint directory, the schedule stretched).
        let resumed = self.resume_state()?;
        let Some(r) = resumed else { return Ok(crate::live::FROM_THE_BEGINNING.into()) };
        self.global_step = r.step;
        Ok(r.path.display().to_string())
    }
}
