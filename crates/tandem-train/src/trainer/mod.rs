//! The training loop, written once for every recipe (as Lightning's `Trainer` and burn's
//! `Learner`): epochs and steps with the sampler's epoch, a step budget, the recipe's step
//! through one [`Step`], evaluation at epoch ends and validation every N steps, checkpoints
//! as a [`CheckpointPolicy`] says (synchronously or in the background), resume, live recovery
//! (`tandem run --live-recovery`: regroup on a peer's death or a rank joining, redo at most the
//! failed step), and the run's typed [`Event`]s to its loggers (the run directory's metrics
//! file, TensorBoard and the recipe's own [`OpenLog`]s, and any given through a [`Reporter`]),
//! ending in a typed [`RunSummary`]. It never prints.
//!
//! A [`Recipe`] says what one step and an evaluation are and gives its state
//! ([`TrainingState`]: the model, the optimizer, the parts each rank holds alone), which the
//! trainer saves, resumes and moves between live ranks for it; the built-in recipes are
//! tandem-recipes' classifier and face recipe.
//!
//! ```ignore
//! let mut trainer = Trainer::new(my_recipe, loader, step, group, TrainerOptions::new(dir, 10));
//! let summary = trainer.fit()?;
//! ```
mod live;
mod recipe;
mod record;
mod times;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tandem_comm::{ProcessGroup, ReduceOp};
use tandem_data::{DataLoader, SamplerState};
use tandem_optim::GradScaler;

use crate::events::{Event, LogSetup, Logger, OpenLog, Reporter, StepEvent};
use crate::fault;
use crate::live::LiveTraining;
use crate::metrics::MetricsFile;
use crate::schedule;
use crate::state::{self, LoaderPosition, Resumed, TrainingState};
use crate::tfevents::STEP_SCALARS_EVERY;
use crate::{Context, Result, TrainError};
use crate::{EpochMetrics, EventWriter, RunSummary, Step};
use live::root_cause;
pub use recipe::{Evaluation, Recipe, StepReport};
use record::LoopRecord;
use tandem_checkpoint::{CheckpointPolicy, Checkpointer, Periodic};
pub use times::StepTimes;
use times::{LossQueue, LOSS_READ_LAG};

/// What a recipe that gives no state is told when asked to save, resume or move it.
pub(crate) const NO_STATE: &str =
    "this recipe gives no state to save, resume or move (Recipe::state)";

/// How the [`Trainer`] runs.
#[derive(Clone, Debug)]
pub struct TrainerOptions {
    /// The run directory: the metrics file (rank 0) and TensorBoard events.
    pub dir: PathBuf,
    pub epochs: u64,
    pub max_steps: Option<u64>,
    /// When checkpoints are written, how many `DIR/checkpoints` keeps and whether a thread
    /// writes them ([`Periodic`] by default; [`Never`](crate::Never) for none).
    pub checkpoints: Arc<dyn CheckpointPolicy>,
    /// [`Recipe::validate`] every N steps (0: only at the end).
    pub validate_every: u64,
    pub resume: bool,
    pub tensorboard: bool,
    /// Steps left out of the summary's samples/s: the first steps carry one-off costs
    /// (cuDNN's algorithm search, kernel compilation, the allocator's growth).
    pub timing_warmup_steps: u64,
    /// Loggers of the run directory beside the metrics file and TensorBoard (tandem-recipes'
    /// `training.log`), opened by rank 0.
    pub log_files: Vec<OpenLog>,
    /// Under live recovery, a sharded optimizer's entries (each rank's alone) are mirrored to
    /// the next rank every N steps: a rank's death loses at most N - 1 steps of them.
    pub mirror_every: u64,
}

impl TrainerOptions {
    pub fn new(dir: impl Into<PathBuf>, epochs: u64) -> Self {
        TrainerOptions {
            dir: dir.into(),
            epochs,
            max_steps: None,
            checkpoints: Arc::new(Periodic::default()),
            validate_every: 0,
            resume: false,
            tensorboard: false,
            timing_warmup_steps: 0,
            log_files: Vec::new(),
            mirror_every: 1,
        }
    }
}

/// How a pass of [`Trainer::train`] ended.
pub(crate) enum Ended {
    /// At the end of the epochs or the step budget.
    Done,
    /// At a step boundary of a live world, where a rank waits to join.
    RegroupWanted,
}

/// Drives a [`Recipe`] to the end of its epochs.
pub struct Trainer<R: Recipe> {
    pub(crate) recipe: R,
    pub(crate) loader: DataLoader<R::Data>,
    pub(crate) step: Step,
    pub(crate) group: ProcessGroup,
    pub(crate) opts: TrainerOptions,
    pub(crate) global_step: u64,
    /// What the loop has done beyond the recipe's state (moves with it under live recovery).
    pub(crate) record: LoopRecord,
    /// Where the step in progress took its batch from (put back if the step fails).
    pub(crate) in_flight: Option<SamplerState>,
    pub(crate) live: Option<LiveTraining>,
    /// Whether this process opened the run directory's loggers (it is or was rank 0).
    pub(crate) logs_open: bool,
    /// The run's loggers: the run directory's (the metrics file, and TensorBoard and the
    /// options' `log_files` when asked for), opened by rank 0, and those the run was given;
    /// the recipe holds a clone.
    pub(crate) reporter: Reporter,
    /// Where the checkpoints of a recipe that gives its [`Recipe::state`] go.
    pub(crate) ckpt: Checkpointer,
}

impl<R: Recipe> Trainer<R> {
    /// A trainer for `recipe` on `group`, reading `loader`, stepping through `step`.
    pub fn new(
        recipe: R,
        loader: DataLoader<R::Data>,
        step: Step,
        group: ProcessGroup,
        opts: TrainerOptions,
    ) -> Result<Self> {
        let policy = &opts.checkpoints;
        let ckpt = Checkpointer::new(opts.dir.join("checkpoints"), policy.keep_last())
            .background(policy.background());
        let mut trainer = Trainer {
            ckpt,
            recipe,
            loader,
            step,
            group,
            opts,
            global_step: 0,
            record: LoopRecord::default(),
            in_flight: None,
            live: None,
            logs_open: false,
            reporter: Reporter::new(),
        };
        trainer.open_logs()?;
        Ok(trainer)
    }

    /// Rank 0's metrics file and TensorBoard writer, opened by whichever process is rank 0
    /// (under live recovery another member may become rank 0 after a regroup; the metrics
    /// file is appended to, so its records stay in one file).
    pub(crate) fn open_logs(&mut self) -> Result<()> {
        if self.group.rank() != 0 || self.logs_open {
            return Ok(());
        }
        self.logs_open = true;
        let dir = &self.opts.dir;
        let mut files: Vec<Box<dyn Logger>> = Vec::new();
        files.push(Box::new(MetricsFile::append(&dir.join("metrics.jsonl"))?));
        let setup = LogSetup {
            dir,
            world: self.group.size(),
            total_steps: self.max_steps(),
            start_step: self.global_step,
        };
        for open in &self.opts.log_files {
            let log = open.open(&setup);
            files.push(log.with_context(|| format!("opening a log in {}", dir.display()))?);
        }
        if self.opts.tensorboard {
            let tb = dir.join("tensorboard");
            files.push(Box::new(EventWriter::create(&tb).with_context(|| {
                format!("creating a TensorBoard event file in {}", tb.display())
            })?));
        }
        self.reporter.add_first(files);
        Ok(())
    }

    /// Reports the run's events to `reporter`'s loggers too (on rank 0, as every world event
    /// is); the run directory's loggers go along, so a recipe reporting through a clone of
    /// `reporter` reaches them as well.
    pub fn reporter(mut self, reporter: Reporter) -> Self {
        reporter.add_first(self.reporter.take_all());
        self.reporter = reporter;
        self
    }

    /// Reports a world event (rank 0 only).
    pub(crate) fn emit(&mut self, event: Event) -> Result<()> {
        if self.rank() != 0 {
            return Ok(());
        }
        report_to(&self.reporter, &event)
    }

    pub fn recipe(&self) -> &R {
        &self.recipe
    }

    pub fn recipe_mut(&mut self) -> &mut R {
        &mut self.recipe
    }

    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    pub fn options(&self) -> &TrainerOptions {
        &self.opts
    }

    pub(crate) fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Restores the newest checkpoint in the recipe's checkpoint directory (a fresh start when
    /// there is none; rank 0 says which).
    pub fn resume(&mut self) -> Result<()> {
        if self.recipe.state().is_none() {
            return Err(TrainError::invalid(NO_STATE));
        }
        let resumed = self.resume_state()?;
        let Some(r) = resumed else { return Ok(()) };
        self.global_step = r.step;
        let (epoch, step) = (self.loader.epoch(), self.global_step);
        self.emit(Event::Resumed { path: r.path, epoch, step, note: r.note })
    }

    /// [`Trainer::resume`] for a recipe that gives its [`Recipe::state`]: the newest checkpoint
    /// in `DIR/checkpoints` that verifies, each rank reading the optimizer entries it owns; the
    /// schedule is stretched over the steps this world has left.
    fn resume_state(&mut self) -> Result<Option<Resumed>> {
        let Some(saved) = self.ckpt.latest().context("looking for a checkpoint to resume")? else {
            if self.rank() == 0 {
                let dir = self.ckpt.dir().display().to_string();
                let text = format!("no checkpoint in {dir} to resume; starting fresh");
                report_to(&self.reporter, &Event::Note(text))?;
            }
            return Ok(None);
        };
        let what = saved.path().display().to_string();
        let (resumed, ck) = {
            let loader: &mut dyn LoaderPosition = &mut self.loader;
            let mut whole = whole_state(&mut self.recipe, &mut self.step, Some(loader), 0, 0)
                .context("the recipe stopped giving its state")?;
            // Loaded below, stretched over the steps this world has left.
            whole.scheduler = None;
            state::resume_from(&saved, &mut whole).with_context(|| format!("reading {what}"))?
        };
        let max_steps = Some(resumed.step + self.loader.steps_to_end(self.opts.epochs));
        let sched = self.step.lr_scheduler_mut();
        schedule::load(sched, &ck.scheduler, self.recipe.optimizer(), max_steps, &what)?;
        // Every rank has read what it needs before any goes on (and perhaps saves over it).
        self.group.barrier().context("barrier after reading the checkpoint")?;
        Ok(Some(resumed))
    }

    /// Waits for the background saves in flight, the trainer's and the recipe's (a collective).
    pub(crate) fn settle(&mut self) -> Result<()> {
        self.ckpt.settle(&self.group).context("a background checkpoint save failed")?;
        Ok(())
    }

    /// Trains to the end (regrouping through failures in a live world), writes the last
    /// checkpoint and the recipe's final outputs, and returns the run's summary.
    pub fn fit(mut self) -> Result<RunSummary> {
        let gathered = if self.live.is_some() {
            loop {
                self.run_live()?;
                let peaks = (tandem_comm::procfs::peak_rss().unwrap_or(0), device_peak_bytes());
                // A rank lost in the final collectives (validation, the final outputs) is
                // regrouped over as one lost in a step; the survivors then conclude again.
                match self.conclude(peaks) {
                    Ok(gathered) => break gathered,
                    Err(e) if e.is_peer_failure() || self.group.failure().is_some() => {
                        self.regroup_after(root_cause(&e))?
                    }
                    Err(e) => return Err(e),
                }
            }
        } else {
            // Without a live world no rank can ask to join: a pass ends at the end.
            self.train()?;
            // Training's own peak, before the last save (a background one stages a copy).
            let peaks = (tandem_comm::procfs::peak_rss().unwrap_or(0), device_peak_bytes());
            self.save_last()?;
            self.conclude(peaks)?
        };
        let word = |b: &[u8], i: usize| {
            b.get(8 * i..8 * i + 8).and_then(|w| w.try_into().ok()).map_or(0, u64::from_le_bytes)
        };
        let peak_rss_bytes = gathered.iter().map(|b| word(b, 0)).collect();
        let training_peak_rss_bytes = gathered.iter().map(|b| word(b, 1)).collect();
        let device_peak_bytes = gathered.iter().map(|b| word(b, 2)).collect();
        let summary = RunSummary {
            rank: self.rank(),
            epochs: self.loader.epoch().min(self.opts.epochs),
            steps: self.global_step,
            samples_per_s: self.samples_per_s(),
            final_loss: self.record.epochs_seen.last().map(|e| e.train_loss),
            eval_accuracy: self.record.last_eval.map(|e| e.accuracy),
            verification_accuracy: self.record.last_val.first().map(|r| r.accuracy),
            checkpoint: if self.rank() == 0 { self.record.last_ckpt.clone() } else { None },
            skipped_steps: self.step.skipped_steps(),
            step_times: Some(self.record.times.clone()),
            verification: self.record.last_val.clone(),
            epochs_seen: std::mem::take(&mut self.record.epochs_seen),
            peak_rss_bytes,
            training_peak_rss_bytes,
            device_peak_bytes,
        };
        self.emit(Event::Finished(Box::new(summary.clone())))?;
        Ok(summary)
    }

    /// What follows the last checkpoint (collectives, every rank): the background saves waited
    /// for, the final validation (once) and evaluation, the recipe's final outputs, and the
    /// world agreeing the run is over. Returns every rank's (peak RSS, training's peak RSS —
    /// `peaks.0` —, the device's peak — `peaks.1`) as 24 bytes.
    pub(crate) fn conclude(&mut self, peaks: (u64, u64)) -> Result<Vec<Vec<u8>>> {
        fault::hit(fault::Phase::Conclude);
        self.settle()?;
        self.group.barrier().context("barrier after the last checkpoint save")?;
        if self.record.verified_at != Some(self.global_step) {
            let val = self.recipe.validate(&self.group, self.global_step)?;
            self.record.verified_at = Some(self.global_step);
            if !val.is_empty() {
                self.emit(Event::Validated { step: self.global_step, results: val.clone() })?;
                self.record.last_val = val;
            }
        }
        if self.record.last_eval.is_none() {
            // Nothing was left to train (a resume at the end): evaluate the model as it is.
            self.recipe.set_training(false)?;
            self.record.last_eval = self.recipe.evaluate(&self.group)?;
        }
        if let Some(live) = self.live.as_ref() {
            let costs = match whole_state(&mut self.recipe, &mut self.step, None, 0, 0) {
                Some(whole) => live.mirror_costs(&whole),
                None => Vec::new(),
            };
            for cost in costs {
                self.emit(Event::MirrorCost(cost))?;
            }
        }
        self.recipe.finish(&self.group)?;
        // Every rank agrees the run is over before any reports it.
        let mut done = [1.0f64];
        self.group.all_reduce(&mut done, ReduceOp::Sum)?;
        let peak = tandem_comm::procfs::peak_rss().unwrap_or(0);
        let mut bytes = peak.to_le_bytes().to_vec();
        bytes.extend(peaks.0.to_le_bytes());
        bytes.extend(peaks.1.to_le_bytes());
        Ok(self.group.all_gather_bytes_at_most(&bytes, 24)?)
    }

    /// Samples per second of training time, after the timing warm-up when one was run.
    fn samples_per_s(&self) -> f64 {
        let (t0, s0) = match self.record.warm {
            Some(w) if self.record.samples_seen > w.1 => w,
            _ => (0.0, 0),
        };
        (self.record.samples_seen - s0) as f64 / (self.record.train_time - t0).max(1e-9)
    }

    /// The step budget from here: `max_steps`, and the steps to the end of the epochs (which
    /// depend on the world size, so a live regroup changes them).
    fn max_steps(&self) -> u64 {
        let to_end = self.global_step + self.loader.steps_to_end(self.opts.epochs);
        self.opts.max_steps.unwrap_or(u64::MAX).min(to_end)
    }

    /// Epochs until the end or the step budget, each closed by [`Trainer::close_epoch`].
    pub(crate) fn train(&mut self) -> Result<Ended> {
        self.emit(Event::Started { total: self.max_steps(), done: self.global_step })?;
        self.close_epoch()?;
        loop {
            let max_steps = self.max_steps();
            if self.loader.epoch() >= self.opts.epochs || self.global_step >= max_steps {
                break;
            }
            let epoch = self.loader.epoch();
            let Some(train_loss) = self.train_epoch(max_steps)? else {
                return Ok(Ended::RegroupWanted);
            };
            self.record.epoch_to_close = Some((epoch, train_loss));
            self.close_epoch()?;
        }
        Ok(Ended::Done)
    }

    /// The rest of the current epoch (up to `max_steps`); returns the world's mean loss. In a
    /// live world every step starts with the boundary check (a rank waiting to join ends the
    /// epoch here: `None`), and the step in progress is remembered so a failure can put its
    /// batch back.
    fn train_epoch(&mut self, max_steps: u64) -> Result<Option<f64>> {
        let started = Instant::now();
        let Trainer { recipe, loader, step, group, opts, live, in_flight, reporter, ckpt, .. } =
            self;
        let world = group.size() as u64;
        let rank0 = group.rank() == 0;
        recipe.set_training(true)?;
        recipe.start_epoch(loader.epoch());
        let mut pause = 0.0f64;
        let mut losses = LossQueue::default();
        let mut batches = loader.iter()?;
        let in_epoch = batches.num_batches();
        let mut taken = 0usize;
        while self.global_step < max_steps {
            if let Some(live) = live.as_ref() {
                if live.regroup_wanted()? {
                    return Ok(None);
                }
            }
            // Pulling past the last batch is what marks the epoch complete in the sampler
            // state; never pull a batch the step budget will not use.
            let before = live.is_some().then(|| loader.state());
            let waited = Instant::now();
            let Some(batch) = batches.next() else { break };
            let data = waited.elapsed().as_secs_f64();
            taken += 1;
            *in_flight = before;
            let batch = batch?;
            let n = self.global_step + 1;
            fault::set_step(n);
            let mut report = recipe.train_step(&batch, step, n)?;
            *in_flight = None;
            self.record.times.add(data, &report);
            self.global_step = n;
            // (Per step, for a timeline of a regroup: `TANDEM_LOG=tandem_train::live=debug`.)
            tracing::debug!(
                target: "tandem_train::live",
                step = n,
                world,
                data,
                forward = report.forward_secs,
                phases = ?report.phases,
                backward = report.backward_secs,
                optimizer = report.optimizer_secs,
                "step done"
            );
            if let Some(live) = live.as_ref() {
                // The state each rank holds alone keeps its live copies (mirrors).
                if let Some(mut whole) = whole_state(recipe, step, None, 0, n) {
                    live.after_step(&mut whole)?;
                }
            }
            self.record.samples_seen += batch.len() as u64 * world;
            if n == opts.timing_warmup_steps && n > 0 {
                losses.settle(0)?;
                let now = self.record.train_time + started.elapsed().as_secs_f64() - pause;
                self.record.warm = Some((now, self.record.samples_seen));
            }
            // A TensorBoard step scalar wants this step's loss now, not a few steps late.
            let tb_due = rank0 && opts.tensorboard && n.is_multiple_of(STEP_SCALARS_EVERY);
            losses.push(report.samples, report.loss, report.pending_loss.take());
            let step_loss = losses.settle(if tb_due { 0 } else { LOSS_READ_LAG })?;
            if rank0 {
                let event = Event::Step(StepEvent {
                    global_step: n,
                    loss: step_loss,
                    epoch_loss: losses.mean(),
                    epoch: loader.epoch(),
                    lr: recipe.optimizer().lr(),
                    batch: batch.len(),
                    grad_scale: step.grad_scaler().map(GradScaler::get_scale),
                });
                report_to(reporter, &event)?;
            }
            if opts.validate_every > 0 && n.is_multiple_of(opts.validate_every) && n < max_steps {
                let clock = Instant::now();
                let val = recipe.validate(group, n)?;
                recipe.set_training(true)?;
                if !val.is_empty() {
                    if rank0 {
                        let event = Event::Validated { step: n, results: val.clone() };
                        report_to(reporter, &event)?;
                    }
                    self.record.last_val = val;
                }
                pause += clock.elapsed().as_secs_f64();
            }
            if n < max_steps && opts.checkpoints.after_step(n) {
                let clock = Instant::now();
                let written = checkpoint(recipe, ckpt, group, step, &loader.state(), n)?;
                if rank0 {
                    let event = Event::CheckpointSaved { step: n, path: written.clone() };
                    report_to(reporter, &event)?;
                }
                self.record.last_ckpt = written.or(self.record.last_ckpt.take());
                self.record.saved_at = Some(n);
                let took = clock.elapsed().as_secs_f64();
                pause += took;
                self.record.times.saves += 1;
                self.record.times.save += took;
            }
        }
        if taken == in_epoch {
            // The epoch's batches are all used: let the loader close it (moves to the next epoch).
            let _ = batches.next();
        }
        drop(batches);
        losses.settle(0)?;
        self.record.train_time += started.elapsed().as_secs_f64() - pause;
        let mut sums = [losses.sum, losses.samples as f64];
        self.group.all_reduce(&mut sums, ReduceOp::Sum)?;
        Ok(Some(sums[0] / sums[1].max(1.0)))
    }

    /// An epoch whose steps are done: evaluation, the line, scalars and metrics on rank 0, and
    /// the end-of-epoch checkpoint (unless `save_every` just wrote this step or the run is
    /// over).
    fn close_epoch(&mut self) -> Result<()> {
        let Some((epoch, train_loss)) = self.record.epoch_to_close else { return Ok(()) };
        self.recipe.set_training(false)?;
        if let Some(eval) = self.recipe.evaluate(&self.group)? {
            self.record.last_eval = Some(eval);
        }
        self.report_epoch(epoch, train_loss)?;
        let (step, max_steps) = (self.global_step, self.max_steps());
        let just_saved = self.record.saved_at == Some(step);
        let more = step < max_steps && self.loader.epoch() < self.opts.epochs;
        if more && !just_saved && self.opts.checkpoints.at_epoch_end(epoch, step) {
            self.save()?;
        }
        self.record.epoch_to_close = None;
        Ok(())
    }

    /// A checkpoint of the whole state now (a collective).
    fn save(&mut self) -> Result<()> {
        let n = self.global_step;
        let clock = Instant::now();
        let position = self.loader.state();
        let (recipe, ckpt, group, step) =
            (&mut self.recipe, &mut self.ckpt, &self.group, &mut self.step);
        let written = checkpoint(recipe, ckpt, group, step, &position, n)?;
        self.record.times.saves += 1;
        self.record.times.save += clock.elapsed().as_secs_f64();
        self.emit(Event::CheckpointSaved { step: n, path: written.clone() })?;
        self.record.last_ckpt = written.or(self.record.last_ckpt.take());
        self.record.saved_at = Some(n);
        Ok(())
    }

    /// The final checkpoint of the run (a collective), unless this step's is written.
    pub(crate) fn save_last(&mut self) -> Result<()> {
        if self.record.saved_at == Some(self.global_step) || !self.opts.checkpoints.at_end() {
            return Ok(());
        }
        self.save()
    }

    /// The epoch's figures (every rank keeps them; rank 0 reports them).
    fn report_epoch(&mut self, epoch: u64, train_loss: f64) -> Result<()> {
        let sps = self.samples_per_s();
        let lr = self.recipe.optimizer().lr();
        let skipped = self.step.skipped_steps();
        let loss_scale = self.step.grad_scaler().map(GradScaler::get_scale);
        let metrics = EpochMetrics {
            epoch: epoch + 1,
            step: self.global_step,
            train_loss,
            eval_loss: self.record.last_eval.map(|e| e.loss),
            eval_accuracy: self.record.last_eval.map(|e| e.accuracy),
            verification: self.record.last_val.clone(),
            samples_per_s: sps,
            lr,
            loss_scale,
            skipped_steps: skipped,
            at_unix_s: Some(crate::tfevents::unix_secs()),
        };
        self.record.epochs_seen.push(metrics.clone());
        self.emit(Event::EpochEnded { metrics, epochs: self.opts.epochs })
    }
}

/// Checkpoint `step-NNNNNNNN` of step `n` (a collective): the recipe's [`Recipe::state`] with
/// the trainer's part, written by `ckpt`. Returns what rank 0 wrote.
fn checkpoint<R: Recipe>(
    recipe: &mut R,
    ckpt: &mut Checkpointer,
    group: &ProcessGroup,
    step: &mut Step,
    position: &SamplerState,
    n: u64,
) -> Result<Option<PathBuf>> {
    fault::hit(fault::Phase::Save);
    let name = format!("step-{n:08}");
    let whole = whole_state(recipe, step, None, position.epoch, n)
        .ok_or_else(|| TrainError::invalid(NO_STATE))?;
    // Every rank builds its whole dict: a failure building it is the same on every rank,
    // before anyone waits.
    let build = || -> Result<_> {
        let mut dict = state::state_dict(&whole, group.size())?;
        dict.replicated.insert("sampler", state::sampler_value(position));
        Ok(dict)
    };
    let path = ckpt.save_built(group, &name, build).with_context(|| {
        "a checkpoint save failed (the run stops here; the checkpoints before it are intact)"
    })?;
    Ok((group.rank() == 0).then_some(path))
}

/// The recipe's [`Recipe::state`] (if it gives it) with the trainer's part: the schedule, the
/// loss scaler, the loader (whose position a save reads from the sampler state instead while
/// an epoch's batches hold it), the loader's `epoch` and the step count `global_step`.
pub(crate) fn whole_state<'s, R: Recipe>(
    recipe: &'s mut R,
    step: &'s mut Step,
    loader: Option<&'s mut dyn LoaderPosition>,
    epoch: u64,
    global_step: u64,
) -> Option<TrainingState<'s>> {
    let given = recipe.state()?;
    let (scaler, scheduler) = step.scaler_and_scheduler_mut();
    Some(TrainingState { scheduler, scaler, loader, step: global_step, epoch, ..given })
}

pub(crate) fn report_to(reporter: &Reporter, event: &Event) -> Result<()> {
    reporter.report(event).context("reporting to the run's loggers")
}

/// Training's peak GPU memory on this rank (the device pool's high-water mark), 0 on the CPU
/// or without the `cuda` feature.
fn device_peak_bytes() -> u64 {
    #[cfg(feature = "cuda")]
    return tandem_cuda::memory::peak_bytes().unwrap_or(0);
    #[cfg(not(feature = "cuda"))]
    0
}
