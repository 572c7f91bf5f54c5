//! The [`Trainer`] under live recovery (`tandem run --live-recovery`): its outer loop (train,
//! and on a peer's death or a joining rank regroup and go on), joining as a replacement, the
//! regroup's report, and what moves with the state — the recipe's [`TrainingState`] (its parts
//! re-split by [`LiveTraining`] as a user's own loop's are) and the loop's record of what it
//! has done.
use std::path::PathBuf;

use crate::error::{Context, Result, TrainError};
use crate::events::{Event, Regroup};
use crate::fault;
use crate::live::{decode_record, encode_record, LiveState, LiveTraining, WorldChange};
use crate::metrics::VerificationMetrics;
use crate::schedule;
use crate::state::{LoaderPosition, TrainingState};
use crate::trainer::{report_to, whole_state, Ended, Evaluation, Recipe, StepTimes, NO_STATE};
use crate::{EpochMetrics, Trainer};

/// Why a live world regroups, and whether the step in flight failed (it is redone).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Regrouping {
    cause: String,
    step_failed: bool,
}

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
                Ok(Ended::Done) => return Ok(()),
                Ok(Ended::RegroupWanted) => Regroup::JOINED.to_string(),
                // A collective that failed inside a layer may reach here as text only
                // (candle's errors keep no source); the group knows it broke.
                Err(e) if e.is_peer_failure() || self.group.failure().is_some() => root_cause(&e),
                Err(e) => return Err(e),
            };
            self.regroup_after(cause)?;
        }
    }

    /// Regroups the live world after `cause` (a lost peer, a rank waiting to join): the step in
    /// flight, if any, is put back, background saves end, the state moves from the rank furthest
    /// along, and the new world's rank 0 reports it.
    pub(crate) fn regroup_after(&mut self, cause: String) -> Result<()> {
        if cause != Regroup::JOINED {
            fault::hold_before_regroup();
        }
        self.regrouping = Some(Regrouping { cause, step_failed: self.in_flight.is_some() });
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
        let Regrouping { cause, step_failed } = self.regrouping.take().unwrap_or_default();
        let resplit = change.resplit;
        let at_unix_s = crate::tfevents::unix_secs();
        let redone = u64::from(step_failed);
        self.emit(Event::Regrouped(Regroup { at_unix_s, cause, change, redone, resplit }))
    }

    /// A replacement rank (or every member at the start) joins the running world.
    pub fn join_live(&mut self) -> Result<Option<WorldChange>> {
        let Some(live) = self.live.take() else { return Ok(None) };
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
        encode_record(&LoopRecord::of(self), "the loop's record")
    }

    fn take_record(&mut self, record: Vec<u8>) -> Result<()> {
        let record: LoopRecord = decode_record(&record, "the loop's record")?;
        record.apply(self);
        Ok(())
    }

    fn regrouped(&mut self, _change: &WorldChange) -> Result<()> {
        // The schedule came as the source saved it: stretched over this world's steps.
        self.stretch_schedule()
    }
}

/// The loop's record, which every rank takes from a regroup's source with the state. What is
/// done at this step — an epoch closed, a checkpoint written, the final verification and
/// evaluation — decides which collectives come next: a replacement that joins in the same
/// regroup as a failure (after the last step, say) must neither run what the others already
/// did nor skip what they will do, or the world calls different collectives. The figures make
/// its reports, should it become rank 0, the run's.
#[derive(serde::Serialize, serde::Deserialize)]
struct LoopRecord {
    epoch_to_close: Option<(u64, f64)>,
    saved_at: Option<u64>,
    last_ckpt: Option<PathBuf>,
    verified_at: Option<u64>,
    last_val: Vec<VerificationMetrics>,
    last_eval: Option<Evaluation>,
    epochs_seen: Vec<EpochMetrics>,
    samples_seen: u64,
    train_time: f64,
    warm: Option<(f64, u64)>,
    times: StepTimes,
    regrouping: Option<Regrouping>,
}

impl LoopRecord {
    fn of<R: Recipe>(t: &Trainer<R>) -> LoopRecord {
        LoopRecord {
            epoch_to_close: t.epoch_to_close,
            saved_at: t.saved_at,
            last_ckpt: t.last_ckpt.clone(),
            verified_at: t.verified_at,
            last_val: t.last_val.clone(),
            last_eval: t.last_eval,
            epochs_seen: t.epochs_seen.clone(),
            samples_seen: t.samples_seen,
            train_time: t.train_time,
            warm: t.warm,
            times: t.times,
            regrouping: t.regrouping.clone(),
        }
    }

    fn apply<R: Recipe>(self, t: &mut Trainer<R>) {
        t.epoch_to_close = self.epoch_to_close;
        t.saved_at = self.saved_at;
        t.last_ckpt = self.last_ckpt;
        t.verified_at = self.verified_at;
        t.last_val = self.last_val;
        t.last_eval = self.last_eval;
        t.epochs_seen = self.epochs_seen;
        t.samples_seen = self.samples_seen;
        t.train_time = self.train_time;
        t.warm = self.warm;
        t.times = self.times;
        t.regrouping = self.regrouping;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::{pop_record, push_record};

    #[test]
    fn the_loop_record_travels_behind_the_state_with_a_nan_loss() {
        let epoch = EpochMetrics {
            epoch: 2,
            step: 20,
            train_loss: f64::NAN,
            eval_loss: None,
            eval_accuracy: Some(0.5),
            verification: Vec::new(),
            samples_per_s: 100.0,
            lr: 0.1,
            loss_scale: Some(65536.0),
            skipped_steps: 1,
        };
        let val =
            VerificationMetrics { name: "lfw".into(), accuracy: 0.99, std: 0.01, xnorm: 20.0 };
        let record = LoopRecord {
            epoch_to_close: Some((2, f64::NAN)),
            saved_at: Some(20),
            last_ckpt: Some(PathBuf::from("runs/x/checkpoints/step-00000020")),
            verified_at: None,
            last_val: vec![val.clone()],
            last_eval: Some(Evaluation { loss: f64::INFINITY, accuracy: 0.5 }),
            epochs_seen: vec![epoch],
            samples_seen: 640,
            train_time: 1.5,
            warm: Some((0.25, 64)),
            times: StepTimes::default(),
            regrouping: Some(Regrouping {
                cause: "peer \"2\" died\nat once".into(),
                step_failed: true,
            }),
        };
        let mut bytes = b"the state".to_vec();
        push_record(&mut bytes, &record, "the loop's record").unwrap();
        let back: LoopRecord = pop_record(&mut bytes, "the loop's record").unwrap();
        assert_eq!(bytes, b"the state");
        assert!(back.epoch_to_close.is_some_and(|(e, l)| e == 2 && l.is_nan()));
        assert!(back.epochs_seen[0].train_loss.is_nan());
        assert_eq!(back.last_eval.map(|e| e.loss), Some(f64::INFINITY));
        assert_eq!(
            (back.saved_at, back.verified_at, back.warm),
            (Some(20), None, Some((0.25, 64)))
        );
        assert_eq!((back.last_val, back.last_ckpt), (vec![val], record.last_ckpt));
        let regrouping = back.regrouping.unwrap();
        assert_eq!(
            (regrouping.cause.as_str(), regrouping.step_failed),
            ("peer \"2\" died\nat once", true)
        );
        // A length that does not fit what came is an error naming the record, not a panic.
        for mut bad in [vec![1u8, 2, 3], [b"xx".as_slice(), &1000u64.to_le_bytes()].concat()] {
            let e = pop_record::<LoopRecord>(&mut bad, "the loop's record").err().unwrap();
            assert!(e.to_string().contains("the loop's record"), "{e}");
        }
    }
}
