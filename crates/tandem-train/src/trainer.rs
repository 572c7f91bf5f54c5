//! The training loop, written once for every recipe (as Lightning's `Trainer` and burn's
//! `Learner`): epochs and steps with the sampler's epoch, a step budget, the recipe's step
//! through one [`Step`], evaluation at epoch ends and verification every N steps, checkpoints
//! as a [`CheckpointPolicy`] says (synchronously or in the background), resume, live recovery
//! (`tandem run --live-recovery`: regroup on a peer's death or a rank joining, redo at most the
//! failed step), and the run's typed
//! [`Event`]s to its loggers (the run directory's metrics file, TensorBoard and `training.log`,
//! and any given through a [`Reporter`]), ending in a typed [`RunSummary`]. It never prints.
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
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tandem_ckpt::Value;
use tandem_comm::{ProcessGroup, ReduceOp};
use tandem_data::{Batch, DataLoader, Dataset, SamplerState};
use tandem_optim::{GradScaler, TorchOptimizer};

use crate::checkpoint::{CheckpointPolicy, Checkpointer, Periodic};
use crate::error::{Context, Result, TrainError};
use crate::events::{Event, Logger, Regroup, Reporter, Resplit, StepEvent};
use crate::fault;
use crate::live::{LiveState, LiveTraining};
use crate::live_entries::LiveShards;
use crate::metrics::{MetricsFile, VerificationMetrics};
use crate::rank_state::RankState;
use crate::schedule;
use crate::state::{self, LoaderPosition, Resumed, TrainingState};
use crate::tfevents::STEP_SCALARS_EVERY;
use crate::training_log::TrainingLog;
use crate::{EpochMetrics, EventWriter, RunSummary, Step};

/// What one step reported: this rank's mean loss over its `samples`, and where its time went.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// The loss, when it is already on the host.
    pub loss: f64,
    /// The loss still on a GPU (a scalar tensor): the trainer reads it a few steps later, so
    /// the host never waits for the device inside a step; `loss` is then unused.
    pub pending_loss: Option<candle_core::Tensor>,
    pub samples: usize,
    /// Seconds in the forward pass (the backbone's, for a recipe with a head).
    pub forward_secs: f64,
    /// Seconds in a model-parallel head (PartialFC), 0 otherwise.
    pub head_secs: f64,
    pub backward_secs: f64,
    pub optimizer_secs: f64,
}

/// Steps whose loss is read back from the device this many steps later: the host runs ahead of
/// the GPU by up to that many steps instead of waiting for every step's end.
const LOSS_READ_LAG: usize = 2;

/// An epoch's losses: summed as they reach the host, the device ones a few steps late.
#[derive(Default)]
struct LossQueue {
    sum: f64,
    samples: usize,
    pending: std::collections::VecDeque<(usize, candle_core::Tensor)>,
    /// The newest step loss that reached the host since `settle` last returned one.
    fresh: Option<f64>,
}

impl LossQueue {
    fn push(&mut self, samples: usize, loss: f64, pending: Option<candle_core::Tensor>) {
        match pending {
            Some(t) => self.pending.push_back((samples, t)),
            None => {
                self.sum += loss * samples as f64;
                self.samples += samples;
                self.fresh = Some(loss);
            }
        }
    }

    /// The mean loss over the samples read so far.
    fn mean(&self) -> f64 {
        self.sum / self.samples.max(1) as f64
    }

    /// Reads the device losses until at most `keep` remain; returns the newest step loss that
    /// reached the host since the last call (a host loss pushed, or the last device one read).
    fn settle(&mut self, keep: usize) -> Result<Option<f64>> {
        while self.pending.len() > keep {
            let Some((samples, t)) = self.pending.pop_front() else { break };
            let v = t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            self.sum += v * samples as f64;
            self.samples += samples;
            self.fresh = Some(v);
        }
        Ok(self.fresh.take())
    }
}

/// Where a rank's step time goes (seconds summed over the run's steps).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    pub steps: u64,
    /// Waiting for the next batch (decoding runs ahead on the loader's threads).
    pub data: f64,
    pub forward: f64,
    pub head: f64,
    /// Backward, with Ddp's bucketed all-reduce.
    pub backward: f64,
    /// Unscale, clipping, the optimizer step and the schedule.
    pub optimizer: f64,
    /// Checkpoint saves: how many, and the seconds training stood still for them (a
    /// background save's staging only; its writing overlaps the steps).
    #[serde(default)]
    pub saves: u64,
    #[serde(default)]
    pub save: f64,
}

impl StepTimes {
    fn add(&mut self, data: f64, r: &StepReport) {
        self.steps += 1;
        self.data += data;
        self.forward += r.forward_secs;
        self.head += r.head_secs;
        self.backward += r.backward_secs;
        self.optimizer += r.optimizer_secs;
    }

    /// `time per step on rank 0: T ms = data .. + forward .. + head .. + backward and
    /// all-reduce .. + optimizer ..` (`head`: a model-parallel head's, such as PartialFC).
    pub fn line(&self) -> String {
        let per = |t: f64| t * 1e3 / self.steps.max(1) as f64;
        let total = self.data + self.forward + self.head + self.backward + self.optimizer;
        format!(
            "time per step on rank 0: {:.1} ms = data {:.1} + forward {:.1} + head {:.1} + backward and all-reduce {:.1} + optimizer {:.1}",
            per(total),
            per(self.data),
            per(self.forward),
            per(self.head),
            per(self.backward),
            per(self.optimizer)
        )
    }
}

/// An end-of-epoch evaluation on held-out data (the world's figures).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
}

/// One recipe: the model, its optimizer and its data, as the [`Trainer`] drives them.
pub trait Recipe {
    /// What the loader reads.
    type Data: Dataset + 'static;

    /// One optimizer step on `batch`: forward, loss, and `step.run` with the recipe's backward.
    /// `global_step` numbers the step being taken (1-based).
    fn train_step(
        &mut self,
        batch: &Batch,
        step: &mut Step,
        global_step: u64,
    ) -> Result<StepReport>;

    /// The optimizer (its learning rate goes in the epoch line; a schedule is reloaded into it).
    fn optimizer(&mut self) -> &mut dyn TorchOptimizer;

    /// Called before an epoch's batches (augmentation keyed by the epoch).
    fn start_epoch(&mut self, _epoch: u64) {}

    /// Training (`true`) or evaluation mode.
    fn set_training(&mut self, _training: bool) -> Result<()> {
        Ok(())
    }

    /// The end-of-epoch evaluation (a collective), if the recipe has one.
    fn evaluate(&mut self, _group: &ProcessGroup) -> Result<Option<Evaluation>> {
        Ok(None)
    }

    /// Verification (a collective) every `validate_every` steps and at the end, if any.
    fn validate(&mut self, _group: &ProcessGroup, _step: u64) -> Result<Vec<VerificationMetrics>> {
        Ok(Vec::new())
    }

    /// The state the [`Trainer`] saves, resumes and moves between live ranks, beside its own
    /// part (the schedule, the loss scaler, the loader's position, the step count): the model
    /// and optimizer, and the parts each rank holds alone
    /// (`Some(TrainingState::new(&self.ddp, &mut self.opt).part(&mut self.head))`). The
    /// checkpoints go to `DIR/checkpoints` as [`TrainerOptions::checkpoints`] says. `None`
    /// (the default): nothing to save, which a run without checkpoints, resume or live
    /// recovery may do.
    fn state(&mut self) -> Option<TrainingState<'_>> {
        None
    }

    /// The final outputs after the last checkpoint (weights, ONNX); every rank calls it.
    fn finish(&mut self, _group: &ProcessGroup) -> Result<()> {
        Ok(())
    }
}

/// What a recipe that gives no state is told when asked to save, resume or move it.
const NO_STATE: &str = "this recipe gives no state to save, resume or move (Recipe::state)";

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
    /// A `training.log` line every N steps, as arcface_torch's `frequent` (0: no file).
    pub log_every: u64,
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
            log_every: 0,
            mirror_every: 1,
        }
    }
}

/// How a pass of [`Trainer::train`] ended.
enum Ended {
    /// At the end of the epochs or the step budget.
    Done,
    /// At a step boundary of a live world, where a rank waits to join.
    RegroupWanted,
}

/// Drives a [`Recipe`] to the end of its epochs.
pub struct Trainer<R: Recipe> {
    recipe: R,
    loader: DataLoader<R::Data>,
    step: Step,
    group: ProcessGroup,
    opts: TrainerOptions,
    global_step: u64,
    samples_seen: u64,
    train_time: f64,
    /// (training seconds, samples seen) when the timing warm-up ended.
    warm: Option<(f64, u64)>,
    times: StepTimes,
    last_eval: Option<Evaluation>,
    last_val: Vec<VerificationMetrics>,
    last_ckpt: Option<PathBuf>,
    /// The step of the last checkpoint written (the same on every rank).
    saved_at: Option<u64>,
    /// An epoch whose steps are done but whose evaluation, line and checkpoint are not.
    epoch_to_close: Option<(u64, f64)>,
    /// Where the step in progress took its batch from (put back if the step fails).
    in_flight: Option<SamplerState>,
    live: Option<LiveTraining>,
    /// A sharded optimizer's entries under live recovery (mirrored, re-split at a regroup).
    live_shards: Option<LiveShards>,
    /// The optimizer state a regroup's source sent without the entries ranks hold alone
    /// (loaded with them once they are re-split).
    sent_optimizer: Option<Value>,
    /// How the last regroup re-split the recipe's per-rank state.
    resplit: Option<Resplit>,
    epochs_seen: Vec<EpochMetrics>,
    /// Whether this process opened the run directory's loggers (it is or was rank 0).
    logs_open: bool,
    /// The run's loggers: the run directory's (the metrics file, and `training.log` and
    /// TensorBoard when asked for), opened by rank 0, and those the run was given; the recipe
    /// holds a clone.
    reporter: Reporter,
    /// Where the checkpoints of a recipe that gives its [`Recipe::state`] go.
    ckpt: Checkpointer,
    /// The step the final verification ran at (a regroup after it does not run it again).
    verified_at: Option<u64>,
    /// Why the world is regrouping now, until it is reported.
    regrouping: Option<Regrouping>,
}

/// Why a live world regroups, and whether the step in flight failed (it is redone).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Regrouping {
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
            verified_at: None,
            regrouping: None,
            recipe,
            loader,
            step,
            group,
            opts,
            global_step: 0,
            samples_seen: 0,
            train_time: 0.0,
            warm: None,
            times: StepTimes::default(),
            last_eval: None,
            last_val: Vec::new(),
            last_ckpt: None,
            saved_at: None,
            epoch_to_close: None,
            in_flight: None,
            live: None,
            live_shards: None,
            sent_optimizer: None,
            resplit: None,
            epochs_seen: Vec::new(),
            logs_open: false,
            reporter: Reporter::new(),
        };
        trainer.open_logs()?;
        Ok(trainer)
    }

    /// Rank 0's metrics file and TensorBoard writer, opened by whichever process is rank 0
    /// (under live recovery another member may become rank 0 after a regroup; the metrics
    /// file is appended to, so its records stay in one file).
    fn open_logs(&mut self) -> Result<()> {
        if self.group.rank() != 0 || self.logs_open {
            return Ok(());
        }
        self.logs_open = true;
        let dir = &self.opts.dir;
        let mut files: Vec<Box<dyn Logger>> = Vec::new();
        files.push(Box::new(MetricsFile::append(&dir.join("metrics.jsonl"))?));
        if self.opts.log_every > 0 {
            let (every, world) = (self.opts.log_every, self.group.size());
            let log = TrainingLog::open(dir, every, world, self.max_steps(), self.global_step)
                .with_context(|| format!("opening {}", dir.join("training.log").display()))?;
            files.push(Box::new(log));
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
    fn emit(&mut self, event: Event) -> Result<()> {
        if self.rank() != 0 {
            return Ok(());
        }
        report_to(&self.reporter, &event)
    }

    /// Trains in the live world `live` (`tandem run --live-recovery`): a peer's death or a
    /// joining rank regroups the world instead of ending the run. Call [`Trainer::join_live`]
    /// next (a replacement's group is only a placeholder until it joins).
    pub fn live(mut self, live: LiveTraining) -> Self {
        if self.recipe.state().is_some() && self.recipe.optimizer().owned_params().is_some() {
            // A replacement holds no shard until it joins.
            let holds = !live.is_replacement();
            let params = self.recipe.optimizer().params().len();
            self.live_shards = Some(LiveShards::new(params, self.opts.mirror_every, holds));
        }
        self.live = Some(live);
        self
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

    fn rank(&self) -> usize {
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
        let path = saved.path().to_path_buf();
        let what = path.display().to_string();
        let ck = {
            let loader: &mut dyn LoaderPosition = &mut self.loader;
            let mut whole = whole_state(&mut self.recipe, &mut self.step, Some(loader), 0, 0)
                .context("the recipe stopped giving its state")?;
            // Loaded below, stretched over the steps this world has left.
            whole.scheduler = None;
            state::restore(&saved, &mut whole).with_context(|| format!("reading {what}"))?
        };
        let (ck, scaler_note) = ck;
        let global_step = ck.global_step as u64;
        let max_steps = Some(global_step + self.loader.steps_to_end(self.opts.epochs));
        let sched = self.step.lr_scheduler_mut();
        schedule::load(sched, &ck.scheduler, self.recipe.optimizer(), max_steps, &what)?;
        let world = self.group.size();
        let reshard = match ck.world_size as usize != world {
            true => {
                let saved = state::sampler_state_from_value(&ck.sampler)
                    .with_context(|| format!("{what}: checkpoint `sampler`"))?;
                Some(crate::state::reshard_message(&saved, world, &self.loader))
            }
            false => None,
        };
        let notes: Vec<String> = reshard.into_iter().chain(scaler_note).collect();
        let note = (!notes.is_empty()).then(|| notes.join("\n"));
        let epoch = self.loader.epoch();
        let world_size = ck.world_size as usize;
        // Every rank has read what it needs before any goes on (and perhaps saves over it).
        self.group.barrier().context("barrier after reading the checkpoint")?;
        Ok(Some(Resumed { path, step: global_step, epoch, world_size, note }))
    }

    /// Waits for the background saves in flight, the trainer's and the recipe's (a collective).
    fn settle(&mut self) -> Result<()> {
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
                // A rank lost in the final collectives (verification, the final outputs) is
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
            final_loss: self.epochs_seen.last().map(|e| e.train_loss),
            eval_accuracy: self.last_eval.map(|e| e.accuracy),
            verification_accuracy: self.last_val.first().map(|r| r.accuracy),
            checkpoint: if self.rank() == 0 { self.last_ckpt.clone() } else { None },
            skipped_steps: self.step.skipped_steps(),
            step_times: Some(self.times),
            verification: self.last_val.clone(),
            epochs_seen: std::mem::take(&mut self.epochs_seen),
            peak_rss_bytes,
            training_peak_rss_bytes,
            device_peak_bytes,
        };
        self.emit(Event::Finished(Box::new(summary.clone())))?;
        Ok(summary)
    }

    /// What follows the last checkpoint (collectives, every rank): the background saves waited
    /// for, the final verification (once) and evaluation, the recipe's final outputs, and the
    /// world agreeing the run is over. Returns every rank's (peak RSS, training's peak RSS —
    /// `peaks.0` —, the device's peak — `peaks.1`) as 24 bytes.
    fn conclude(&mut self, peaks: (u64, u64)) -> Result<Vec<Vec<u8>>> {
        fault::hit(fault::Phase::Conclude);
        self.settle()?;
        self.group.barrier().context("barrier after the last checkpoint save")?;
        if self.verified_at != Some(self.global_step) {
            let val = self.recipe.validate(&self.group, self.global_step)?;
            self.verified_at = Some(self.global_step);
            if !val.is_empty() {
                self.emit(Event::Verified { step: self.global_step, results: val.clone() })?;
                self.last_val = val;
            }
        }
        if self.last_eval.is_none() {
            // Nothing was left to train (a resume at the end): evaluate the model as it is.
            self.recipe.set_training(false)?;
            self.last_eval = self.recipe.evaluate(&self.group)?;
        }
        let mut costs: Vec<_> = self.live_shards.iter().filter_map(|s| s.mirror_cost()).collect();
        if let Some(whole) = whole_state(&mut self.recipe, &mut self.step, None, 0, 0) {
            costs.extend(whole.parts.iter().filter_map(|p| p.mirror_cost()));
        }
        if self.live.is_some() {
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
        let (t0, s0) = match self.warm {
            Some(w) if self.samples_seen > w.1 => w,
            _ => (0.0, 0),
        };
        (self.samples_seen - s0) as f64 / (self.train_time - t0).max(1e-9)
    }

    /// The step budget from here: `max_steps`, and the steps to the end of the epochs (which
    /// depend on the world size, so a live regroup changes them).
    fn max_steps(&self) -> u64 {
        let to_end = self.global_step + self.loader.steps_to_end(self.opts.epochs);
        self.opts.max_steps.unwrap_or(u64::MAX).min(to_end)
    }

    /// Epochs until the end or the step budget, each closed by [`Trainer::close_epoch`].
    fn train(&mut self) -> Result<Ended> {
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
            self.epoch_to_close = Some((epoch, train_loss));
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
        let Trainer {
            recipe,
            loader,
            step,
            group,
            opts,
            live,
            in_flight,
            reporter,
            ckpt,
            live_shards,
            ..
        } = self;
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
            self.times.add(data, &report);
            self.global_step = n;
            if live.is_some() {
                // The parts each rank holds alone keep their live copies (mirrors).
                if let Some(whole) = whole_state(recipe, step, None, 0, n) {
                    let TrainingState { parts, optimizer, .. } = whole;
                    for part in parts.into_iter().chain(own_part(live_shards)) {
                        part.after_step(group, &*optimizer, n)?;
                    }
                }
            }
            self.samples_seen += batch.len() as u64 * world;
            if n == opts.timing_warmup_steps && n > 0 {
                losses.settle(0)?;
                let now = self.train_time + started.elapsed().as_secs_f64() - pause;
                self.warm = Some((now, self.samples_seen));
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
                        let event = Event::Verified { step: n, results: val.clone() };
                        report_to(reporter, &event)?;
                    }
                    self.last_val = val;
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
                self.last_ckpt = written.or(self.last_ckpt.take());
                self.saved_at = Some(n);
                let took = clock.elapsed().as_secs_f64();
                pause += took;
                self.times.saves += 1;
                self.times.save += took;
            }
        }
        if taken == in_epoch {
            // The epoch's batches are all used: let the loader close it (moves to the next epoch).
            let _ = batches.next();
        }
        drop(batches);
        losses.settle(0)?;
        self.train_time += started.elapsed().as_secs_f64() - pause;
        let mut sums = [losses.sum, losses.samples as f64];
        self.group.all_reduce(&mut sums, ReduceOp::Sum)?;
        Ok(Some(sums[0] / sums[1].max(1.0)))
    }

    /// An epoch whose steps are done: evaluation, the line, scalars and metrics on rank 0, and
    /// the end-of-epoch checkpoint (unless `save_every` just wrote this step or the run is
    /// over).
    fn close_epoch(&mut self) -> Result<()> {
        let Some((epoch, train_loss)) = self.epoch_to_close else { return Ok(()) };
        self.recipe.set_training(false)?;
        if let Some(eval) = self.recipe.evaluate(&self.group)? {
            self.last_eval = Some(eval);
        }
        self.report_epoch(epoch, train_loss)?;
        let (step, max_steps) = (self.global_step, self.max_steps());
        let just_saved = self.saved_at == Some(step);
        let more = step < max_steps && self.loader.epoch() < self.opts.epochs;
        if more && !just_saved && self.opts.checkpoints.at_epoch_end(epoch, step) {
            self.save()?;
        }
        self.epoch_to_close = None;
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
        self.times.saves += 1;
        self.times.save += clock.elapsed().as_secs_f64();
        self.emit(Event::CheckpointSaved { step: n, path: written.clone() })?;
        self.last_ckpt = written.or(self.last_ckpt.take());
        self.saved_at = Some(n);
        Ok(())
    }

    /// The final checkpoint of the run (a collective), unless this step's is written.
    fn save_last(&mut self) -> Result<()> {
        if self.saved_at == Some(self.global_step) || !self.opts.checkpoints.at_end() {
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
            eval_loss: self.last_eval.map(|e| e.loss),
            eval_accuracy: self.last_eval.map(|e| e.accuracy),
            verification: self.last_val.clone(),
            samples_per_s: sps,
            lr,
            loss_scale,
            skipped_steps: skipped,
        };
        self.epochs_seen.push(metrics.clone());
        self.emit(Event::EpochEnded { metrics, epochs: self.opts.epochs })
    }

    /// Live recovery's outer loop: trains (and writes the last checkpoint) to the end, and
    /// whenever a peer dies or a rank joins, regroups and goes on from the state of the rank
    /// furthest along — the failed step redone, nothing else.
    fn run_live(&mut self) -> Result<()> {
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
    fn regroup_after(&mut self, cause: String) -> Result<()> {
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
    fn report_regroup(&mut self, change: crate::live::WorldChange) -> Result<()> {
        let Regrouping { cause, step_failed } = self.regrouping.take().unwrap_or_default();
        let resplit = self.resplit.take();
        let at_unix_s = crate::tfevents::unix_secs();
        let redone = u64::from(step_failed);
        self.emit(Event::Regrouped(Regroup { at_unix_s, cause, change, redone, resplit }))
    }

    /// A replacement rank (or every member at the start) joins the running world.
    pub fn join_live(&mut self) -> Result<Option<crate::live::WorldChange>> {
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
        } else {
            self.resplit = None;
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
fn whole_state<'s, R: Recipe>(
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

/// The part the trainer adds itself under live recovery (a sharded optimizer's entries).
fn own_part(shards: &mut Option<LiveShards>) -> Option<&mut dyn RankState> {
    shards.as_mut().map(|s| s as &mut dyn RankState)
}

fn report_to(reporter: &Reporter, event: &Event) -> Result<()> {
    reporter.report(event).context("reporting to the run's loggers")
}

/// The failure behind a failed collective in a few words: the group's first failure (which
/// names the rank that died) when the error carries it, else the innermost error.
fn root_cause(e: &TrainError) -> String {
    let text = e.root_cause();
    let text = match text.find("first failure in this group: ") {
        Some(i) => text[i + "first failure in this group: ".len()..].to_string(),
        None => text,
    };
    // Keep the first clause; the rest repeats it for each rank the failure passed through.
    let end = text.find(" (process exited").or_else(|| text.find("; ")).unwrap_or(text.len());
    text[..end].to_string()
}

/// A regroup moves the recipe's whole state from the rank furthest along; every rank then
/// splits the rest of the epoch over the new world and stretches the schedule over the steps
/// that world has left (as a resume on another world size does).
impl<R: Recipe> LiveState for Trainer<R> {
    fn progress(&self) -> u64 {
        self.global_step
    }
    fn save(&mut self, world: usize) -> Result<Vec<u8>> {
        fault::hit(fault::Phase::Send);
        let n = self.global_step;
        let position = self.loader.state();
        let (epoch, loader): (u64, &mut dyn LoaderPosition) = (position.epoch, &mut self.loader);
        let whole = whole_state(&mut self.recipe, &mut self.step, Some(loader), epoch, n)
            .ok_or_else(|| TrainError::invalid(NO_STATE))?;
        // What a user's own loop sends (`impl LiveState for TrainingState`), without a sharded
        // optimizer's entries and the parts' (they move in the re-split that follows); the
        // loop's record after it, its length last.
        let mut bytes = crate::live::state_bytes(&whole, world, self.live_shards.is_some())?;
        crate::live::push_record(&mut bytes, &LoopRecord::of(self), "the loop's record")?;
        Ok(bytes)
    }
    fn load(&mut self, mut bytes: Vec<u8>, rank: usize, size: usize) -> Result<()> {
        let record: LoopRecord = crate::live::pop_record(&mut bytes, "the loop's record")?;
        let loader: &mut dyn LoaderPosition = &mut self.loader;
        let mut whole = whole_state(&mut self.recipe, &mut self.step, Some(loader), 0, 0)
            .ok_or_else(|| TrainError::invalid(NO_STATE))?;
        // As a user's own loop loads it (`impl LiveState for TrainingState`: the loader moved
        // to this world), but the optimizer: a sharded optimizer's entries, and those the parts
        // hold, are still this rank's own until the re-split, which loads them with what came.
        let apart = self.live_shards.is_some() || !whole.part_entries().is_empty();
        let ck = crate::live::load_state_bytes(&mut whole, bytes, (rank, size), !apart)?;
        self.global_step = whole.step;
        if apart {
            self.sent_optimizer = Some(ck.optimizer);
        }
        record.apply(self);
        // The schedule came as the source saved it: stretched over this world's steps.
        self.stretch_schedule()
    }
    fn reshard(&mut self, group: &ProcessGroup) -> Result<()> {
        let sent = self.sent_optimizer.take();
        self.resplit = self.regroup_parts(group, sent)?;
        Ok(())
    }
    fn enter_world(&mut self, rank: usize, size: usize) -> Result<()> {
        let position = self.loader.state();
        self.loader.reshard(rank, size, &position).context("resharding the loader")?;
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

impl<R: Recipe> Trainer<R> {
    /// Re-splits the state's parts over the new world `group` (a collective) and loads the
    /// optimizer with their entries and the world's (`sent` by the regroup's source, else this
    /// rank's own); the learning rates stay the schedule's. Returns how the first part that
    /// moved did.
    fn regroup_parts(
        &mut self,
        group: &ProcessGroup,
        sent: Option<Value>,
    ) -> Result<Option<Resplit>> {
        let step = self.global_step;
        let lrs = self.recipe.optimizer().group_lrs();
        let Some(whole) = whole_state(&mut self.recipe, &mut self.step, None, 0, step) else {
            return Ok(None);
        };
        // What no rank holds comes from the newest checkpoint; without a readable one it
        // starts afresh.
        let last = match whole.parts.is_empty() {
            true => None,
            false => self.ckpt.latest().unwrap_or(None),
        };
        let entries = whole.part_entries();
        let mut world = match sent {
            Some(sent) => sent,
            None if entries.is_empty() => Value::None,
            None => whole.optimizer_split()?.0,
        };
        let TrainingState { parts, optimizer, .. } = whole;
        let mut resplit = None;
        let mut moved = Vec::with_capacity(parts.len());
        // The trainer's own part (a sharded optimizer's entries) last: its entries are not
        // among `entries`, and `moved` keeps the recipe's parts' order.
        for part in parts.into_iter().chain(own_part(&mut self.live_shards)) {
            let got = part.regroup(group, step, &mut *optimizer, &world, last.as_ref())?;
            resplit = resplit.or(got.resplit);
            moved.push(got.entries.into_iter());
        }
        if !entries.is_empty() {
            for (index, p) in entries {
                state::put_entry(&mut world, index, moved[p].next().unwrap_or(Value::None));
            }
            optimizer
                .load_optimizer_state(&world)
                .context("live recovery: loading the optimizer with the re-split entries")?;
        }
        let opt = self.recipe.optimizer();
        if !lrs.is_empty() && opt.group_lrs().len() == lrs.len() {
            // The schedule's rates (set before the parts changed hands).
            opt.set_group_lrs(&lrs)?;
        }
        Ok(resplit)
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

/// Training's peak GPU memory on this rank (the device pool's high-water mark), 0 on the CPU
/// or without the `cuda` feature.
fn device_peak_bytes() -> u64 {
    #[cfg(feature = "cuda")]
    return tandem_cuda::memory::peak_bytes().unwrap_or(0);
    #[cfg(not(feature = "cuda"))]
    0
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
