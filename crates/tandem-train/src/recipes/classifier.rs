//! The classifier recipe (mlp, cnn, resnet18 on digits, MNIST, CIFAR-10 or synthetic data):
//! build data, model, Ddp and optimizer, optionally resume or load initial weights, then train
//! with per-epoch evaluation, rank-0 checkpoints (synchronous or in the background), TensorBoard
//! scalars, the metrics file and live recovery.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::error::{bail, Context, Result};
use candle_core::Device;
use tandem_ckpt::{AsyncCheckpointManager, CheckpointManager, TrainingCheckpoint, Value};
use tandem_comm::{Collectives, LiveOptions};
use tandem_comm::{ProcessGroup, ReduceOp};
use tandem_data::{
    channel_stats, CropFlip, DataLoader, Dataset, DistributedSampler, EvalMetrics, ImageTransforms,
    InMemoryDataset, LoaderOptions, SamplerState, Transformed,
};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_optim::amp::GradScaler;

use crate::error::TrainError;
use crate::live::{LiveError, LiveState, LiveTraining};
use crate::metrics::{three_figures, MetricsFile, MetricsRecord};
use crate::schedule::{self, RunLength};
use crate::state::{sampler_state_from_value, sampler_value, LoaderPosition};
use crate::{EpochMetrics, EventWriter, Progress, RunSummary, Step};

use super::net::{image_shape, Net, NetSpec};
use super::optimizer::TrainOptimizer;
use crate::fault;
use crate::options::TrainOptions;

/// Trains the classifier on this rank of `group`.
pub(super) fn run(cfg: &TrainOptions, run_dir: &Path, group: ProcessGroup) -> Result<RunSummary> {
    let mut w = Worker::build(cfg, run_dir, group, None)?;
    if cfg.run.resume {
        w.resume()?;
    }
    w.train()?;
    w.finish()
}

/// A rank of a live job: an original member forms the first world with the others (and
/// resumes with them when asked); a replacement builds everything first, then joins the
/// running world and receives its state.
pub(super) fn run_live(
    cfg: &TrainOptions,
    run_dir: &Path,
    opts: LiveOptions,
) -> Result<RunSummary> {
    let live = LiveTraining::connect_with(opts).context("joining the live job")?;
    let group = if live.is_replacement() {
        // Placeholder until it joins (rank and size for the sampler; resharded on joining).
        tandem_comm::init_from(&tandem_comm::InitMethod::Single)?
    } else {
        live.group()
    };
    let ddp_opts = live.ddp_options(DdpOptions::default());
    let mut w = Worker::build(cfg, run_dir, group, Some((live.collectives(), ddp_opts)))?;
    if cfg.run.resume && !live.is_replacement() {
        w.resume()?;
    }
    let change = live.start(&mut w).context("joining the running job")?;
    w.group = live.group();
    if let Some(change) = change {
        eprintln!("live: member {} joined the running job: {change}", live_member_of(&w));
    }
    w.live = Some(live);
    w.run_to_end()?;
    w.finish()
}

fn live_member_of(w: &Worker<'_>) -> String {
    w.live.as_ref().map_or_else(
        || std::env::var("RANK").unwrap_or_default(),
        |l| l.generation().members[w.group.rank()].to_string(),
    )
}

/// One rank's training job: the model under Ddp, its optimizer and loss scaler, the data, and
/// the counters the summary reports.
struct Worker<'a> {
    cfg: &'a TrainOptions,
    run_dir: &'a Path,
    group: ProcessGroup,
    device: Device,
    ddp: Ddp<Net>,
    opt: TrainOptimizer,
    /// The GradScaler (float16), clipping and the lr schedule around each optimizer step.
    stepper: Step,
    train: Arc<TrainData>,
    eval: Arc<TrainData>,
    options: LoaderOptions,
    loader: DataLoader<TrainData>,
    manager: CheckpointManager,
    saver: Saver,
    global_step: u64,
    train_time: f64,
    samples_seen: u64,
    last_eval: EvalMetrics,
    last_ckpt: Option<PathBuf>,
    /// Live recovery (`tandem run --live-recovery`): the world this rank trains in.
    live: Option<LiveTraining>,
    /// Where the step in progress took its batch from (put back if the step fails).
    in_flight: Option<SamplerState>,
    /// An epoch whose steps are done but whose evaluation, line and checkpoint are not.
    epoch_to_close: Option<(u64, f64)>,
    /// The step of the last checkpoint written (the same on every rank).
    saved_at: Option<u64>,
    /// Every epoch's figures, and rank 0's JSON-lines copy of them (`run_dir/metrics.jsonl`).
    epochs_seen: Vec<EpochMetrics>,
    metrics: Option<MetricsFile>,
}

impl<'a> Worker<'a> {
    /// `live`: the collectives Ddp and SyncBatchNorm use instead of `group` (they follow a live
    /// world's regroups) and Ddp's options.
    fn build(
        cfg: &'a TrainOptions,
        run_dir: &'a Path,
        group: ProcessGroup,
        live: Option<(Arc<dyn Collectives>, DdpOptions)>,
    ) -> Result<Self> {
        let rank = group.rank();
        let device = cfg.model.device.device(group.local_rank())?;
        let (train, eval) = tandem_data::datasets::from_spec(&cfg.data.spec)
            .with_context(|| format!("loading --data {}", cfg.data.spec))?;
        let spec = NetSpec {
            kind: cfg.model.kind,
            hidden: cfg.model.hidden,
            width: cfg.model.width,
            seed: cfg.run.seed,
            compute_dtype: cfg.model.precision.compute_dtype(),
        };
        let net = Net::build(&spec, train.input_dim(), train.num_classes(), &device)?;
        if cfg.model.sync_batchnorm {
            // The ResNet is a VarMap model: Ddp reduces its buckets after backward, so the
            // SyncBatchNorm collectives cannot interleave with them and may share the group.
            let comm: Arc<dyn Collectives> = match &live {
                Some((comm, _)) => Arc::clone(comm),
                None => Arc::new(group.clone()),
            };
            net.convert_sync_batchnorm(comm)?;
        }
        let (train, eval) = image_transforms(cfg, train, eval)?;
        if let Some(path) = &cfg.checkpoint.init_from {
            let report = load_weights(&net, path)?;
            if rank == 0 {
                eprintln!("init-from {}:\n{report}", path.display());
            }
        }
        let ddp = match live {
            Some((comm, opts)) => Ddp::with_comm(net, comm, opts),
            None => Ddp::new(net, &group, DdpOptions::default()),
        }
        .context("wrapping the model in Ddp")?;
        if cfg.comm.comm_hook != "none" {
            let hook = tandem_ddp::comm_hooks::builtin(&cfg.comm.comm_hook)
                .with_context(|| format!("--comm-hook: unknown hook `{}`", cfg.comm.comm_hook))?;
            ddp.register_comm_hook(hook).context("--comm-hook")?;
        } else if fault::armed() {
            ddp.register_comm_hook(fault::hook()).context("the fault-injection hook")?;
        }
        let mut opt = TrainOptimizer::new(cfg, ddp.params(), &group)?;
        let sampler = DistributedSampler::builder(train.len())
            .group(&group)
            .shuffle(cfg.data.shuffle)
            .seed(cfg.run.seed)
            .build()?;
        let options = LoaderOptions {
            batch_size: cfg.data.batch_size,
            drop_last: false,
            num_workers: 1,
            prefetch_factor: 2,
        };
        let train = Arc::new(train);
        let loader = DataLoader::new(Arc::clone(&train), sampler, options.clone(), device.clone())?;
        // The schedule spans --epochs (--steps may stop the run before its end).
        let steps_per_epoch = loader.len() as u64;
        let total_steps = cfg.run.epochs * steps_per_epoch;
        let sched = cfg
            .optim
            .schedule
            .build(opt.get_mut(), cfg.optim.lr, RunLength { steps_per_epoch, total_steps })
            .context("--lr-scheduler")?;
        let stepper = super::step_for(cfg, 2000, sched)?;
        let metrics = metrics_file(run_dir, rank)?;
        let manager = CheckpointManager::new(run_dir.join("checkpoints"), cfg.checkpoint.keep_last);
        let saver = Saver::new(manager.clone(), cfg.checkpoint.background);
        Ok(Worker {
            cfg,
            run_dir,
            group,
            device,
            ddp,
            opt,
            stepper,
            train,
            eval: Arc::new(eval),
            options,
            loader,
            manager,
            saver,
            global_step: 0,
            train_time: 0.0,
            samples_seen: 0,
            last_eval: EvalMetrics::default(),
            last_ckpt: None,
            live: None,
            in_flight: None,
            epoch_to_close: None,
            saved_at: None,
            epochs_seen: Vec::new(),
            metrics,
        })
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// `--resume`: model, optimizer, loader position and loss scale from the newest checkpoint
    /// that verifies (a fresh start when there is none).
    fn resume(&mut self) -> Result<()> {
        let rank = self.rank();
        let found = self.manager.latest_valid().context("looking for a checkpoint to resume")?;
        let Some((path, value)) = found else {
            if rank == 0 {
                let dir = self.manager.dir().display();
                eprintln!("--resume: no checkpoint in {dir}, starting fresh");
            }
            return Ok(());
        };
        let ck = TrainingCheckpoint::from_value(&value)
            .with_context(|| format!("reading {}", path.display()))?;
        let what = path.display().to_string();
        let position = self.apply_state(&ck, &what, None)?;
        if rank == 0 {
            let (step, epoch) = (self.global_step, self.loader.epoch());
            eprintln!("resumed from {what} (epoch {epoch}, step {step})");
            if ck.world_size as usize != self.group.size() {
                eprintln!("{}", reshard_message(&position, self.group.size(), &self.loader));
            }
        }
        Ok(())
    }

    /// Restores `ck` (named `what` in errors) into the job: model, optimizer, loader position,
    /// loss scale, step and schedule (stretched over the steps left). `world`: the rank and
    /// size of a live world the loader moves to (the rest of the epoch split over it); `None`
    /// keeps this one. Returns the saved loader position.
    fn apply_state(
        &mut self,
        ck: &TrainingCheckpoint,
        what: &str,
        world: Option<(usize, usize)>,
    ) -> Result<SamplerState> {
        let rank = self.rank();
        tandem_nn::weights::load_weights_from(&*self.ddp.module(), &ck.model, true)
            .with_context(|| format!("{what}: model"))?;
        self.opt
            .get_mut()
            .load_state_dict(&ck.optimizer)
            .with_context(|| format!("optimizer state in {what}"))?;
        let position = sampler_state_from_value(&ck.sampler).map_err(|problem| {
            TrainError::invalid(format!("{what}: checkpoint `sampler`: {problem}"))
        })?;
        match world {
            None => self.loader.load_state(&position),
            Some((r, n)) => self.loader.reshard(r, n, &position),
        }
        .with_context(|| format!("{what}: checkpoint `sampler` does not fit this run"))?;
        match (self.stepper.grad_scaler_mut(), &ck.scaler) {
            (Some(s), Value::None) if rank == 0 => eprintln!(
                "{what}: no GradScaler state (written without --precision f16); the loss scale \
                 starts at {}",
                s.get_scale()
            ),
            (Some(_), Value::None) | (None, _) => {}
            (Some(s), state) => {
                s.load_state_dict(state).with_context(|| format!("GradScaler state in {what}"))?
            }
        }
        self.global_step = ck.global_step as u64;
        let max_steps = Some(self.global_step + self.steps_to_end());
        let sched = self.stepper.lr_scheduler_mut();
        schedule::load(sched, &ck.scheduler, self.opt.get_mut(), max_steps, what)
            .context("--lr-scheduler")?;
        Ok(position)
    }

    /// The whole training state as a checkpoint value (what `save` writes and a live regroup
    /// sends).
    fn state_value(&mut self, world: usize) -> Result<Value> {
        let optimizer = self.opt.checkpoint_state(self.group.rank())?;
        let scaler = self.stepper.grad_scaler().map_or(Value::None, GradScaler::state_dict);
        let scheduler = schedule::state(self.stepper.lr_scheduler());
        let sampler = self.loader.state();
        let state =
            CheckpointState { optimizer, scaler, scheduler, sampler, step: self.global_step };
        checkpoint_value(&self.ddp.module(), state, world, self.cfg)
    }

    /// Steps to the end of --epochs from where the loader stands (a resumed epoch may have been
    /// split over another world size, so count its batches rather than assume a full epoch).
    fn steps_to_end(&self) -> u64 {
        self.loader.steps_to_end(self.cfg.run.epochs)
    }

    /// A checkpoint of the whole state now (a collective; see [`Saver::save`]).
    fn save(&mut self, name: &str) -> Result<()> {
        let snapshot = Snapshot {
            ddp: &self.ddp,
            opt: &mut self.opt,
            stepper: &self.stepper,
            loader: &self.loader,
            step: self.global_step,
        };
        let written = save_checkpoint(name, snapshot, &mut self.saver, &self.group, self.cfg)?;
        self.last_ckpt = written.or(self.last_ckpt.take());
        self.saved_at = Some(self.global_step);
        Ok(())
    }

    /// Epochs until `--epochs` or `--steps`, each ending with an evaluation, a line (and
    /// TensorBoard scalars) on rank 0, and a checkpoint.
    fn train(&mut self) -> Result<()> {
        let cfg = self.cfg;
        let mut tb = if cfg.run.tensorboard && self.rank() == 0 {
            let dir = self.run_dir.join("tensorboard");
            let writer = EventWriter::create(&dir).with_context(|| {
                format!("creating a TensorBoard event file in {}", dir.display())
            })?;
            Some(writer)
        } else {
            None
        };
        let progress = Progress::new(self.rank() == 0, self.max_steps(), self.global_step);
        while let Some(max_steps) = self.next_epoch_due() {
            let epoch = self.loader.epoch();
            let train_loss = self.train_epoch(max_steps, &progress)?;
            self.epoch_to_close = Some((epoch, train_loss));
            self.close_epoch(&progress, tb.as_mut())?;
        }
        progress.finish();
        Ok(())
    }

    /// The step budget from here: `--steps`, and the steps to the end of `--epochs` (which
    /// depend on the world size, so a live regroup changes them).
    fn max_steps(&self) -> u64 {
        self.cfg.run.max_steps.unwrap_or(u64::MAX).min(self.global_step + self.steps_to_end())
    }

    /// The step budget when another epoch (or the rest of one) is due, else `None`.
    fn next_epoch_due(&self) -> Option<u64> {
        let max_steps = self.max_steps();
        (self.loader.epoch() < self.cfg.run.epochs && self.global_step < max_steps)
            .then_some(max_steps)
    }

    /// An epoch whose steps are done: evaluation, the line and scalars on rank 0, and the
    /// end-of-epoch checkpoint (unless --save-every just wrote this step or the run is over).
    fn close_epoch(&mut self, progress: &Progress, tb: Option<&mut EventWriter>) -> Result<()> {
        let Some((epoch, train_loss)) = self.epoch_to_close else { return Ok(()) };
        self.ddp.module().set_training(false);
        self.last_eval =
            evaluate(&self.ddp.module(), &self.eval, &self.group, &self.options, &self.device)?;
        if self.rank() == 0 {
            self.report_epoch(epoch, train_loss, progress, tb)?;
        }
        let (cfg, step, max_steps) = (self.cfg, self.global_step, self.max_steps());
        let just_saved =
            cfg.checkpoint.save_every > 0 && step.is_multiple_of(cfg.checkpoint.save_every);
        if step < max_steps && self.loader.epoch() < cfg.run.epochs && !just_saved {
            self.save(&format!("step-{step:08}"))?;
        }
        self.epoch_to_close = None;
        Ok(())
    }

    /// Live recovery's outer loop: trains (and writes the last checkpoint) to the end, and
    /// whenever a peer dies or a rank joins, regroups and goes on from the state of the rank
    /// furthest along — the failed step redone, nothing else.
    fn run_to_end(&mut self) -> Result<()> {
        loop {
            let result = self.train().and_then(|()| self.save_last());
            let error = match result {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            let boundary = matches!(error, TrainError::RegroupWanted);
            if !boundary && !error.is_peer_failure() {
                return Err(error);
            }
            let step_failed = self.in_flight.is_some();
            if let Some(position) = self.in_flight.take() {
                // The failed step did not happen: its batch goes back.
                self.loader.load_state(&position)?;
            }
            // A background save this rank started (as the world's rank 0) ends before the
            // world re-forms: the new rank 0 may be another member, and two writers must not
            // share the checkpoint directory. Its failure ends the run as it would without
            // live recovery (the files before it are intact).
            self.saver.settle()?;
            let live = self.live.take().context("live recovery without a live world")?;
            let before = self.global_step;
            let changed = live.regroup(self);
            self.group = live.group();
            self.live = Some(live);
            let change = changed.context("regrouping")?;
            // Said once per regroup, by the rank whose state the world took.
            let source = self.live.as_ref().map(|l| l.generation().source);
            if source == Some(self.rank()) {
                let cause = if boundary { "a rank joins".to_string() } else { root_cause(&error) };
                // The world redoes the failed step unless its source had finished it.
                let redone = u64::from(step_failed && change.step <= before);
                eprintln!("live: regrouped ({cause}): {change}; {redone} step(s) redone");
            }
        }
    }

    /// The final checkpoint of the run (a collective), unless this step's is written.
    fn save_last(&mut self) -> Result<()> {
        if self.saved_at == Some(self.global_step) {
            return Ok(());
        }
        self.save(&format!("step-{:08}", self.global_step))
    }

    /// The rest of the current epoch (up to `max_steps`); returns the world's mean train loss.
    /// In a live world every step starts with the boundary check (a rank waiting to join ends
    /// the epoch here with [`TrainError::RegroupWanted`]), and the step in progress is remembered so a
    /// failure can put its batch back.
    fn train_epoch(&mut self, max_steps: u64, progress: &Progress) -> Result<f64> {
        // Disjoint borrows: the batch iterator holds the loader while checkpoints read it.
        let Worker { cfg, group, ddp, opt, stepper, train, loader, saver, live, in_flight, .. } =
            self;
        let world = group.size();
        ddp.module().set_training(true);
        let (mut loss_sum, mut loss_n) = (0.0f64, 0usize);
        train.set_epoch(loader.epoch());
        let mut batches = loader.iter()?;
        let in_epoch = batches.num_batches();
        let mut taken = 0usize;
        while self.global_step < max_steps {
            if let Some(live) = live.as_ref() {
                if live.regroup_wanted()? {
                    return Err(TrainError::RegroupWanted);
                }
            }
            // Pulling past the last batch is what marks the epoch complete in the sampler
            // state; never pull a batch the step budget will not use (it would count as
            // consumed).
            let before = live.is_some().then(|| loader.state());
            let Some(batch) = batches.next() else { break };
            taken += 1;
            *in_flight = before;
            let started = Instant::now();
            let batch = batch?;
            fault::set_step(self.global_step + 1);
            let loss = ddp.hooked().loss(&batch.x, &batch.y)?;
            fault::hit(fault::Phase::Forward);
            let params = ddp.params();
            let backward = |loss: &candle_core::Tensor| -> Result<_> {
                let grads = ddp.backward(loss)?;
                fault::hit(fault::Phase::Optimizer);
                Ok(grads)
            };
            stepper.run(&loss, backward, opt.get_mut(), &params, self.global_step + 1)?;
            *in_flight = None;
            self.train_time += started.elapsed().as_secs_f64();
            self.global_step += 1;
            self.samples_seen += (batch.len() * world) as u64;
            loss_sum += loss.to_scalar::<f32>()? as f64 * batch.len() as f64;
            loss_n += batch.len();
            progress.step(self.global_step, loss_sum / loss_n.max(1) as f64);
            let (step, every) = (self.global_step, cfg.checkpoint.save_every);
            if every > 0 && step.is_multiple_of(every) && step < max_steps {
                let snapshot = Snapshot { ddp, opt, stepper, loader, step };
                let written =
                    save_checkpoint(&format!("step-{step:08}"), snapshot, saver, group, cfg)?;
                self.last_ckpt = written.or(self.last_ckpt.take());
                self.saved_at = Some(step);
            }
        }
        if taken == in_epoch {
            // The epoch's batches are all used: let the loader close it (moves to the next epoch).
            let _ = batches.next();
        }
        drop(batches);
        let mut train_loss = [loss_sum, loss_n as f64];
        group.all_reduce(&mut train_loss, ReduceOp::Sum)?;
        Ok(train_loss[0] / train_loss[1].max(1.0))
    }

    /// Rank 0's epoch line and TensorBoard scalars.
    fn report_epoch(
        &mut self,
        epoch: u64,
        train_loss: f64,
        progress: &Progress,
        tb: Option<&mut EventWriter>,
    ) -> Result<()> {
        let (cfg, step, eval) = (self.cfg, self.global_step, &self.last_eval);
        let sps = self.samples_seen as f64 / self.train_time.max(1e-9);
        let lr = self.opt.get().lr();
        let skipped = self.stepper.skipped_steps();
        let loss_scale = self.stepper.grad_scaler().map(GradScaler::get_scale);
        let amp = loss_scale
            .map_or(String::new(), |s| format!(" loss_scale={s} skipped_steps={skipped}"));
        let metrics = EpochMetrics {
            epoch: epoch + 1,
            step,
            train_loss,
            eval_loss: Some(eval.mean_loss()),
            eval_accuracy: Some(eval.accuracy()),
            verification: Vec::new(),
            samples_per_s: sps,
            lr,
            loss_scale,
            skipped_steps: skipped,
        };
        if let Some(file) = self.metrics.as_mut() {
            file.write(&MetricsRecord::Epoch(metrics.clone()))?;
        }
        self.epochs_seen.push(metrics);
        progress.line(&format!(
            "epoch {}/{} step {step} loss={train_loss:.4} eval_loss={:.4} eval_accuracy={:.4} samples/s={} lr={lr}{amp}",
            epoch + 1,
            cfg.run.epochs,
            eval.mean_loss(),
            eval.accuracy(),
            three_figures(sps),
        ));
        let Some(tb) = tb else { return Ok(()) };
        let write = |tb: &mut EventWriter| -> std::io::Result<()> {
            let s = step as i64;
            tb.add_scalar("train/loss", train_loss as f32, s)?;
            tb.add_scalar("train/lr", lr as f32, s)?;
            tb.add_scalar("train/samples_per_s", sps as f32, s)?;
            tb.add_scalar("eval/loss", eval.mean_loss() as f32, s)?;
            tb.add_scalar("eval/accuracy", eval.accuracy() as f32, s)?;
            tb.flush()
        };
        write(tb).with_context(|| format!("writing TensorBoard events to {}", tb.path().display()))
    }

    /// The final checkpoint, `--save-final` and `--export-onnx`, then the summary.
    fn finish(mut self) -> Result<RunSummary> {
        let (cfg, rank) = (self.cfg, self.rank());
        let final_name = format!("step-{:08}", self.global_step);
        self.save_last()?;
        self.saver.finish(&self.group)?;
        if let Some(path) = &cfg.checkpoint.save_final {
            if rank == 0 {
                save_weights(&self.ddp.module(), path)?;
            }
            self.group.barrier()?;
        }
        if let Some(path) = &cfg.checkpoint.export_onnx {
            if rank == 0 {
                let value = model_value(&self.ddp.module())?;
                let summary = tandem_onnx::export_to_file(cfg.model.kind, &value, path)
                    .context("--export-onnx")?;
                eprintln!("{summary}");
            }
            self.group.barrier()?;
        }
        let summary = RunSummary {
            rank,
            epochs: self.loader.epoch().min(cfg.run.epochs),
            steps: self.global_step,
            samples_per_s: self.samples_seen as f64 / self.train_time.max(1e-9),
            final_loss: self.epochs_seen.last().map(|e| e.train_loss),
            eval_accuracy: Some(self.last_eval.accuracy()),
            verification_accuracy: None,
            checkpoint: if rank == 0 {
                self.last_ckpt.or_else(|| Some(self.manager.path_for(&final_name)))
            } else {
                None
            },
            skipped_steps: self.stepper.skipped_steps(),
            epochs_seen: self.epochs_seen,
        };
        if let Some(file) = self.metrics.as_mut() {
            file.write(&MetricsRecord::Summary(summary.clone()))?;
        }
        Ok(summary)
    }
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

/// A regroup moves the job's whole checkpoint state (the format `--save-every` writes) from
/// the rank furthest along; every rank then splits the rest of the epoch over the new world
/// and stretches the schedule over the steps that world has left (as `--resume` does on
/// another world size).
impl LiveState for Worker<'_> {
    fn progress(&self) -> u64 {
        self.global_step
    }
    fn save(&mut self, world: usize) -> Result<Vec<u8>, LiveError> {
        fault::hit(fault::Phase::Send);
        let value = self.state_value(world).map_err(|e| LiveError::Other(e.chain_text()))?;
        tandem_ckpt::to_pt_bytes(&value).map_err(|e| LiveError::Other(e.to_string()))
    }
    fn load(&mut self, bytes: Vec<u8>, rank: usize, size: usize) -> Result<(), LiveError> {
        let what = "the live state";
        let value = tandem_ckpt::pt::load_from_bytes(what, bytes, true)
            .map_err(|e| LiveError::Other(e.to_string()))?;
        let ck =
            TrainingCheckpoint::from_value(&value).map_err(|e| LiveError::Other(e.to_string()))?;
        self.apply_state(&ck, what, Some((rank, size)))
            .map_err(|e| LiveError::Other(e.chain_text()))?;
        Ok(())
    }
    fn enter_world(&mut self, rank: usize, size: usize) -> Result<(), LiveError> {
        let fail = |e: TrainError| LiveError::Other(e.chain_text());
        let position = self.loader.state();
        self.loader.reshard(rank, size, &position).map_err(|e| fail(e.into()))?;
        let saved = schedule::state(self.stepper.lr_scheduler());
        let max_steps = Some(self.global_step + self.steps_to_end());
        let sched = self.stepper.lr_scheduler_mut();
        schedule::load(sched, &saved, self.opt.get_mut(), max_steps, "the live state")
            .map_err(|e| fail(e.into()))
    }
}

/// What a checkpoint reads from the job.
struct Snapshot<'b> {
    ddp: &'b Ddp<Net>,
    opt: &'b mut TrainOptimizer,
    stepper: &'b Step,
    loader: &'b DataLoader<TrainData>,
    step: u64,
}

/// A checkpoint of `snapshot` named `name` (a collective; see [`Saver::save`]); the file rank 0
/// writes.
fn save_checkpoint(
    name: &str,
    snapshot: Snapshot<'_>,
    saver: &mut Saver,
    group: &ProcessGroup,
    cfg: &TrainOptions,
) -> Result<Option<PathBuf>> {
    let Snapshot { ddp, opt, stepper, loader, step } = snapshot;
    let optimizer = opt.checkpoint_state(group.rank())?;
    let scaler = stepper.grad_scaler().map_or(Value::None, GradScaler::state_dict);
    let scheduler = schedule::state(stepper.lr_scheduler());
    let state = CheckpointState { optimizer, scaler, scheduler, sampler: loader.state(), step };
    let value = checkpoint_value(&ddp.module(), state, group.size(), cfg)?;
    saver.save(group.rank(), name, value, group)
}

/// Rank 0's checkpoint writes, synchronous or on a background thread (`--async-save`).
enum Saver {
    Sync(CheckpointManager),
    Async(AsyncCheckpointManager),
}

impl Saver {
    fn new(manager: CheckpointManager, background: bool) -> Self {
        if background {
            Saver::Async(AsyncCheckpointManager::new(manager))
        } else {
            Saver::Sync(manager)
        }
    }

    /// A collective. Synchronous: rank 0 writes, every rank meets at the barrier. Background:
    /// rank 0 hands the (host) copy to the writer thread, first waiting for the previous save and
    /// failing with its error; the other ranks go straight on (they meet rank 0 at the next
    /// collective). Returns the file rank 0 writes.
    fn save(
        &mut self,
        rank: usize,
        name: &str,
        value: Value,
        group: &ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        fault::hit(fault::Phase::Save);
        match self {
            Saver::Sync(m) => {
                // The barrier's own error is kept whole (a dead peer there is a peer failure a
                // live world recovers from; the manager would only keep its text).
                let mut barrier_error = None;
                let written = m.save_on_rank(rank, name, &value, || {
                    group.barrier().map_err(|e| {
                        let text = e.to_string();
                        barrier_error = Some(e);
                        text
                    })
                });
                if let Some(e) = barrier_error {
                    let what = format!("the barrier after saving checkpoint `{name}`");
                    return Err(TrainError::Failed { what, source: Box::new(e) });
                }
                Ok(written?)
            }
            Saver::Async(m) if rank == 0 => Ok(Some(m.save(name, value).with_context(|| {
                "a background checkpoint save failed (the run stops here; the files before it are intact)"
            })?)),
            Saver::Async(_) => Ok(None),
        }
    }

    /// Waits for this process's save in flight, if any (its error names the file).
    fn settle(&mut self) -> Result<()> {
        if let Saver::Async(m) = self {
            m.wait().context("a background checkpoint save failed")?;
        }
        Ok(())
    }

    /// At the end: every rank waits for its save in flight (only a rank that was the world's
    /// rank 0 has one; under live recovery that may have been another rank than now; its error
    /// ends the run, naming the file), then every rank meets at a barrier, so no rank reports
    /// success before the last checkpoint is on disk.
    fn finish(&mut self, group: &ProcessGroup) -> Result<()> {
        if let Saver::Async(m) = self {
            let written = m.wait().map(|_| ());
            let synced = group.barrier();
            written.context("the last background checkpoint save failed")?;
            synced.context("barrier after the last checkpoint save")?;
        }
        Ok(())
    }
}

/// What a resume on another world size did with the epoch it resumed (rank 0 prints it).
fn reshard_message(saved: &SamplerState, world: usize, loader: &DataLoader<TrainData>) -> String {
    let was =
        format!("the checkpoint was written by {} ranks, this run has {world}", saved.num_replicas);
    let now = loader.state();
    if now.epoch != saved.epoch {
        format!(
            "{was}: epoch {} was complete (only padding was left); epoch {} starts with the usual \
             split over {world} ranks",
            saved.epoch, now.epoch
        )
    } else if now.start == 0 {
        format!("{was}: epoch {} had not started; it is split over {world} ranks", now.epoch)
    } else {
        format!(
            "{was}: the rest of epoch {} ({} samples not yet seen, after the first {} of its \
             order) is split over {world} ranks, {} steps; later epochs use the usual split",
            now.epoch,
            now.samples_left(),
            now.start,
            loader.batches_left()
        )
    }
}

/// Examples as the model sees them (normalised and augmented as the flags ask).
type TrainData = Transformed<InMemoryDataset>;

/// Applies `--normalize` (statistics of the training set, to both sets) and `--augment`
/// (training set only).
fn image_transforms(
    cfg: &TrainOptions,
    train: InMemoryDataset,
    eval: InMemoryDataset,
) -> Result<(TrainData, TrainData)> {
    if !cfg.data.normalize && !cfg.data.augment {
        return Ok((Transformed::identity(train), Transformed::identity(eval)));
    }
    let Some(chw) = image_shape(train.input_dim()) else {
        bail!(
            "--normalize/--augment need square images with 1 or 3 channels; --data {} has {} \
             features per sample",
            cfg.data.spec,
            train.input_dim()
        )
    };
    let normalize = if cfg.data.normalize { Some(channel_stats(&train, chw.0)?) } else { None };
    let crop_flip = cfg.data.augment.then_some(CropFlip { padding: 4, seed: cfg.run.seed });
    let eval_t = ImageTransforms { chw, normalize: normalize.clone(), crop_flip: None };
    let train_t = ImageTransforms { chw, normalize, crop_flip };
    Ok((Transformed::new(train, train_t)?, Transformed::new(eval, eval_t)?))
}

/// Exact distributed evaluation: every eval sample once, sums all-reduced.
fn evaluate(
    net: &Net,
    eval: &Arc<TrainData>,
    group: &ProcessGroup,
    options: &LoaderOptions,
    device: &Device,
) -> Result<EvalMetrics> {
    let mut local = EvalMetrics::default();
    for batch in tandem_data::eval_batches(
        Arc::clone(eval),
        group.size(),
        group.rank(),
        options,
        device.clone(),
    )? {
        let batch = batch?;
        let logits = net.forward(&batch.x)?;
        let n = batch.len();
        let loss = candle_nn::loss::cross_entropy(&logits, &batch.y)?.to_scalar::<f32>()? as f64
            * n as f64;
        let pred = logits.argmax(1)?.to_vec1::<u32>()?;
        let truth = batch.y.to_vec1::<u32>()?;
        let correct = pred.iter().zip(&truth).filter(|(p, t)| p == t).count() as i64;
        local.add_batch(loss, correct, n as i64);
    }
    Ok(tandem_data::eval::all_reduce_metrics(group, &local)?)
}

/// Rank 0's JSON-lines metrics file, `run_dir/metrics.jsonl` (appended to on resume).
pub fn metrics_file(run_dir: &Path, rank: usize) -> Result<Option<MetricsFile>> {
    if rank != 0 {
        return Ok(None);
    }
    Ok(Some(MetricsFile::append(&run_dir.join("metrics.jsonl"))?))
}

/// Loads weights from a PyTorch or tandem file (any container, any wrapping) through the
/// LoadReport path: strict, so a missing or mis-shaped key is an error listing all of them.
pub fn load_weights(net: &Net, path: &Path) -> Result<tandem_ckpt::LoadReport> {
    tandem_nn::weights::load_weights(net, path, true)
        .with_context(|| format!("loading weights from {}", path.display()))
}

fn model_value(net: &Net) -> Result<Value> {
    Ok(tandem_nn::weights::state_dict_value(net)?)
}

/// Writes the model's weights with canonical keys: safetensors for `.safetensors`, else `.pt`.
fn save_weights(net: &Net, path: &Path) -> Result<()> {
    tandem_nn::weights::save_weights(net, path)
        .with_context(|| format!("saving weights to {}", path.display()))
}

/// The training state a checkpoint holds beside the model.
struct CheckpointState {
    optimizer: Value,
    /// The GradScaler's state (`Value::None` without --precision f16).
    scaler: Value,
    /// The lr scheduler's state (`Value::None` without --lr-scheduler).
    scheduler: Value,
    sampler: SamplerState,
    step: u64,
}

fn checkpoint_value(
    net: &Net,
    state: CheckpointState,
    world: usize,
    cfg: &TrainOptions,
) -> Result<Value> {
    let CheckpointState { optimizer, scaler, scheduler, sampler, step } = state;
    let ck = TrainingCheckpoint {
        epoch: sampler.epoch as i64,
        global_step: step as i64,
        model: model_value(net)?,
        optimizer,
        scheduler,
        sampler: sampler_value(&sampler),
        // No random ops beyond the sampler's shuffle (seeded by seed + epoch): the seed is the state.
        rng: Value::dict_from([("seed", Value::Int(cfg.run.seed as i64))]),
        world_size: world as i64,
        config: Value::Str(cfg.run.record.clone()),
        scaler,
    };
    Ok(ck.to_value()?)
}
