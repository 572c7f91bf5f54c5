//! One rank of `tandem train`: join the process group, build data, model, Ddp and optimizer,
//! optionally resume or load initial weights, then train with per-epoch evaluation,
//! rank-0 checkpoints, TensorBoard scalars and the final summary line.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::Device;
use tandem_ckpt::{AsyncCheckpointManager, CheckpointManager, TrainingCheckpoint, Value};
use tandem_comm::{ProcessGroup, ReduceOp};
use tandem_data::{
    channel_stats, CropFlip, DataLoader, Dataset, DistributedSampler, EvalMetrics, ImageTransforms,
    InMemoryDataset, LoaderOptions, SamplerState, Transformed,
};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_optim::amp::{GradScaler, GradScalerConfig};

use tandem::state::{sampler_state_from_value, sampler_value};

use super::config::{Precision, TrainConfig};
use super::model::{image_shape, Net, NetSpec};
use super::optimizer::TrainOptimizer;
use super::progress::Progress;
use super::schedule::{self, RunLength, Scheduler};
use super::tfevents::EventWriter;

/// What a finished run reports (rank 0 prints it as the `final:` line).
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub rank: usize,
    pub epochs: u64,
    pub steps: u64,
    /// The classifiers' accuracy on the eval split.
    pub eval_accuracy: Option<f64>,
    /// The face models' accuracy on the first --val set.
    pub verification_accuracy: Option<f64>,
    pub samples_per_s: f64,
    pub checkpoint: Option<PathBuf>,
}

/// Trains on this rank. `run_dir` must be the same on every rank.
pub fn run(cfg: &TrainConfig, run_dir: &Path) -> anyhow::Result<RunSummary> {
    let group = join_group(cfg)?;
    if cfg.model.is_face() {
        return super::face::run(cfg, run_dir, group);
    }
    let mut w = Worker::build(cfg, run_dir, group)?;
    if cfg.resume {
        w.resume()?;
    }
    w.train()?;
    w.finish()
}

/// Joins the process group (`--backend` applies under any launcher: mpirun, srun, torchrun,
/// not only our own) and, with `--backend nccl`, makes the NCCL communicator Ddp reduces with.
pub fn join_group(cfg: &TrainConfig) -> anyhow::Result<ProcessGroup> {
    let mut opts = tandem_comm::InitOptions::from_env().context("reading TANDEM_* settings")?;
    if let Some(kind) = cfg.backend.transport() {
        opts.transport = Some(kind);
    }
    let group = tandem_comm::init_with(&tandem_comm::InitMethod::Env, &opts)
        .context("joining the process group")?;
    // (Without the `cuda` feature, validate() has refused --backend nccl.)
    #[cfg(feature = "cuda")]
    if cfg.backend == super::config::Backend::Nccl {
        // Made now, collectively, so Ddp reduces the CUDA gradients with it.
        let comm = group
            .nccl(group.local_rank() as i32)
            .context("--backend nccl: making the NCCL communicator")?;
        if group.rank() == 0 {
            eprintln!("nccl: {} rank(s), rank 0 on cuda:{}", group.size(), comm.device());
        }
    }
    Ok(group)
}

/// One rank's training job: the model under Ddp, its optimizer and loss scaler, the data, and
/// the counters the summary reports.
struct Worker<'a> {
    cfg: &'a TrainConfig,
    run_dir: &'a Path,
    group: ProcessGroup,
    device: Device,
    ddp: Ddp<Net>,
    opt: TrainOptimizer,
    /// float16 needs loss scaling (its range is narrow); bf16 has float32's range and does not.
    scaler: Option<GradScaler>,
    sched: Scheduler,
    train: Arc<TrainData>,
    eval: Arc<TrainData>,
    options: LoaderOptions,
    loader: DataLoader<TrainData>,
    manager: CheckpointManager,
    saver: Saver,
    global_step: u64,
    skipped_steps: u64,
    train_time: f64,
    samples_seen: u64,
    last_eval: EvalMetrics,
    last_ckpt: Option<PathBuf>,
}

impl<'a> Worker<'a> {
    fn build(cfg: &'a TrainConfig, run_dir: &'a Path, group: ProcessGroup) -> anyhow::Result<Self> {
        let rank = group.rank();
        let device = cfg.device.device(group.local_rank())?;
        let (train, eval) = tandem_data::datasets::from_spec(&cfg.data)
            .with_context(|| format!("loading --data {}", cfg.data))?;
        let spec = NetSpec {
            kind: cfg.model,
            hidden: cfg.hidden,
            width: cfg.width,
            seed: cfg.seed,
            compute_dtype: cfg.precision.compute_dtype(),
        };
        let net = Net::build(&spec, train.input_dim(), train.num_classes(), &device)?;
        if cfg.sync_batchnorm {
            // The ResNet is a VarMap model: Ddp reduces its buckets after backward, so the
            // SyncBatchNorm collectives cannot interleave with them and may share the group.
            net.convert_sync_batchnorm(Arc::new(group.clone()))?;
        }
        let (train, eval) = image_transforms(cfg, train, eval)?;
        if let Some(path) = &cfg.init_from {
            let report = load_weights(&net, path)?;
            if rank == 0 {
                eprintln!("init-from {}:\n{report}", path.display());
            }
        }
        let ddp =
            Ddp::new(net, &group, DdpOptions::default()).context("wrapping the model in Ddp")?;
        if cfg.comm_hook != "none" {
            let hook = tandem_ddp::comm_hooks::builtin(&cfg.comm_hook)
                .with_context(|| format!("--comm-hook: unknown hook `{}`", cfg.comm_hook))?;
            ddp.register_comm_hook(hook).context("--comm-hook")?;
        }
        let mut opt = TrainOptimizer::new(cfg, ddp.params(), &group)?;
        let scaler = grad_scaler(cfg, 2000)?;
        let sampler = DistributedSampler::builder(train.len())
            .group(&group)
            .shuffle(!cfg.no_shuffle)
            .seed(cfg.seed)
            .build()?;
        let options = LoaderOptions {
            batch_size: cfg.batch_size,
            drop_last: false,
            num_workers: 1,
            prefetch_factor: 2,
        };
        let train = Arc::new(train);
        let loader = DataLoader::new(Arc::clone(&train), sampler, options.clone(), device.clone())?;
        // The schedule spans --epochs (--steps may stop the run before its end).
        let steps_per_epoch = loader.len() as u64;
        let total_steps = cfg.epochs as u64 * steps_per_epoch;
        let sched =
            schedule::build(cfg, opt.get_mut(), RunLength { steps_per_epoch, total_steps })?;
        let manager = CheckpointManager::new(run_dir.join("checkpoints"), cfg.keep_last);
        let saver = Saver::new(manager.clone(), cfg.async_save);
        Ok(Worker {
            cfg,
            run_dir,
            group,
            device,
            ddp,
            opt,
            scaler,
            sched,
            train,
            eval: Arc::new(eval),
            options,
            loader,
            manager,
            saver,
            global_step: 0,
            skipped_steps: 0,
            train_time: 0.0,
            samples_seen: 0,
            last_eval: EvalMetrics::default(),
            last_ckpt: None,
        })
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// `--resume`: model, optimizer, loader position and loss scale from the newest checkpoint
    /// that verifies (a fresh start when there is none).
    fn resume(&mut self) -> anyhow::Result<()> {
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
        load_weights(&self.ddp.module(), &path)?;
        self.opt
            .get_mut()
            .load_state_dict(&ck.optimizer)
            .with_context(|| format!("optimizer state in {}", path.display()))?;
        let position = sampler_state_from_value(&ck.sampler).map_err(|problem| {
            anyhow::anyhow!("{}: checkpoint `sampler`: {problem}", path.display())
        })?;
        self.loader.load_state(&position).with_context(|| {
            format!("{}: checkpoint `sampler` does not fit this run", path.display())
        })?;
        match (self.scaler.as_mut(), &ck.scaler) {
            (Some(s), Value::None) if rank == 0 => eprintln!(
                "{}: no GradScaler state (written without --precision f16); the loss scale \
                 starts at {}",
                path.display(),
                s.get_scale()
            ),
            (Some(_), Value::None) | (None, _) => {}
            (Some(s), state) => s
                .load_state_dict(state)
                .with_context(|| format!("GradScaler state in {}", path.display()))?,
        }
        self.global_step = ck.global_step as u64;
        let what = path.display().to_string();
        let max_steps = Some(self.global_step + self.steps_to_end());
        schedule::load(&mut self.sched, &ck.scheduler, self.opt.get_mut(), max_steps, &what)?;
        if rank == 0 {
            let (step, epoch) = (self.global_step, self.loader.epoch());
            eprintln!("resumed from {} (epoch {epoch}, step {step})", path.display());
            if ck.world_size as usize != self.group.size() {
                eprintln!("{}", reshard_message(&position, self.group.size(), &self.loader));
            }
        }
        Ok(())
    }

    /// Steps to the end of --epochs from where the loader stands (a resumed epoch may have been
    /// split over another world size, so count its batches rather than assume a full epoch).
    fn steps_to_end(&self) -> u64 {
        let epochs_left = (self.cfg.epochs as u64).saturating_sub(self.loader.epoch());
        match epochs_left {
            0 => 0,
            n => self.loader.batches_left() as u64 + (n - 1) * self.loader.len() as u64,
        }
    }

    /// A checkpoint of the whole state now (a collective; see [`Saver::save`]).
    fn save(&mut self, name: &str) -> anyhow::Result<()> {
        let snapshot = Snapshot {
            ddp: &self.ddp,
            opt: &mut self.opt,
            scaler: self.scaler.as_ref(),
            sched: &self.sched,
            loader: &self.loader,
            step: self.global_step,
        };
        let written = save_checkpoint(name, snapshot, &mut self.saver, &self.group, self.cfg)?;
        self.last_ckpt = written.or(self.last_ckpt.take());
        Ok(())
    }

    /// Epochs until `--epochs` or `--steps`, each ending with an evaluation, a line (and
    /// TensorBoard scalars) on rank 0, and a checkpoint.
    fn train(&mut self) -> anyhow::Result<()> {
        let cfg = self.cfg;
        let mut tb = if cfg.tensorboard && self.rank() == 0 {
            let dir = self.run_dir.join("tensorboard");
            let writer = EventWriter::create(&dir).with_context(|| {
                format!("creating a TensorBoard event file in {}", dir.display())
            })?;
            Some(writer)
        } else {
            None
        };
        let max_steps = cfg.steps.unwrap_or(u64::MAX).min(self.global_step + self.steps_to_end());
        let progress = Progress::new(self.rank() == 0, max_steps, self.global_step);
        while (self.loader.epoch() as usize) < cfg.epochs && self.global_step < max_steps {
            let epoch = self.loader.epoch();
            let train_loss = self.train_epoch(max_steps, &progress)?;
            self.ddp.module().set_training(false);
            self.last_eval =
                evaluate(&self.ddp.module(), &self.eval, &self.group, &self.options, &self.device)?;
            if self.rank() == 0 {
                self.report_epoch(epoch, train_loss, &progress, tb.as_mut())?;
            }
            // End-of-epoch checkpoint, unless --save-every just wrote this step or the run is
            // over (the final checkpoint is written by `finish`).
            let step = self.global_step;
            let just_saved = cfg.save_every > 0 && step.is_multiple_of(cfg.save_every);
            if step < max_steps && (self.loader.epoch() as usize) < cfg.epochs && !just_saved {
                self.save(&format!("step-{step:08}"))?;
            }
        }
        progress.finish();
        Ok(())
    }

    /// The rest of the current epoch (up to `max_steps`); returns the world's mean train loss.
    fn train_epoch(&mut self, max_steps: u64, progress: &Progress) -> anyhow::Result<f64> {
        // Disjoint borrows: the batch iterator holds the loader while checkpoints read it.
        let Worker { cfg, group, ddp, opt, scaler, sched, train, loader, saver, .. } = self;
        let world = group.size();
        ddp.module().set_training(true);
        let started = Instant::now();
        let (mut loss_sum, mut loss_n) = (0.0f64, 0usize);
        train.set_epoch(loader.epoch());
        let mut batches = loader.iter()?;
        let in_epoch = batches.num_batches();
        let mut taken = 0usize;
        while self.global_step < max_steps {
            // Pulling past the last batch is what marks the epoch complete in the sampler
            // state; never pull a batch the step budget will not use (it would count as
            // consumed).
            let Some(batch) = batches.next() else { break };
            taken += 1;
            let batch = batch?;
            let loss = ddp.hooked().loss(&batch.x, &batch.y)?;
            let (clip, step) = (cfg.clip_grad_norm, self.global_step + 1);
            match scaler.as_mut() {
                // torch's recipe: backward of the scaled loss, unscale, clip, step (skipped on
                // inf/NaN), update.
                Some(s) => {
                    let mut grads = ddp.backward(&s.scale(&loss)?)?;
                    if clip.is_some() {
                        s.unscale_(opt.get(), &mut grads)?;
                        schedule::clip(clip, &ddp.params(), &mut grads, true, step)?;
                    }
                    if !s.step(opt.get_mut(), &mut grads)? {
                        self.skipped_steps += 1;
                    }
                    s.update()?;
                }
                None => {
                    let mut grads = ddp.backward(&loss)?;
                    schedule::clip(clip, &ddp.params(), &mut grads, false, step)?;
                    opt.get_mut().step(&grads)?;
                }
            }
            if let Some(sched) = sched.as_mut() {
                sched.step_optimizer(opt.get_mut())?;
            }
            self.global_step += 1;
            self.samples_seen += (batch.len() * world) as u64;
            loss_sum += loss.to_scalar::<f32>()? as f64 * batch.len() as f64;
            loss_n += batch.len();
            progress.step(self.global_step, loss_sum / loss_n.max(1) as f64);
            let (step, every) = (self.global_step, cfg.save_every);
            if every > 0 && step.is_multiple_of(every) && step < max_steps {
                let snapshot = Snapshot { ddp, opt, scaler: scaler.as_ref(), sched, loader, step };
                let written =
                    save_checkpoint(&format!("step-{step:08}"), snapshot, saver, group, cfg)?;
                self.last_ckpt = written.or(self.last_ckpt.take());
            }
        }
        if taken == in_epoch {
            // The epoch's batches are all used: let the loader close it (moves to the next epoch).
            let _ = batches.next();
        }
        drop(batches);
        self.train_time += started.elapsed().as_secs_f64();
        let mut train_loss = [loss_sum, loss_n as f64];
        group.all_reduce(&mut train_loss, ReduceOp::Sum)?;
        Ok(train_loss[0] / train_loss[1].max(1.0))
    }

    /// Rank 0's epoch line and TensorBoard scalars.
    fn report_epoch(
        &self,
        epoch: u64,
        train_loss: f64,
        progress: &Progress,
        tb: Option<&mut EventWriter>,
    ) -> anyhow::Result<()> {
        let (cfg, step, eval) = (self.cfg, self.global_step, &self.last_eval);
        let sps = self.samples_seen as f64 / self.train_time.max(1e-9);
        let lr = self.opt.get().lr();
        let amp = self.scaler.as_ref().map_or(String::new(), |s| {
            format!(" loss_scale={} skipped_steps={}", s.get_scale(), self.skipped_steps)
        });
        progress.line(&format!(
            "epoch {}/{} step {step} loss={train_loss:.4} eval_loss={:.4} eval_accuracy={:.4} samples/s={sps:.0} lr={lr}{amp}",
            epoch + 1,
            cfg.epochs,
            eval.mean_loss(),
            eval.accuracy(),
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
    fn finish(mut self) -> anyhow::Result<RunSummary> {
        let (cfg, rank) = (self.cfg, self.rank());
        let final_name = format!("step-{:08}", self.global_step);
        self.save(&final_name)?;
        self.saver.finish(rank, &self.group)?;
        if let Some(path) = &cfg.save_final {
            if rank == 0 {
                save_weights(&self.ddp.module(), path)?;
            }
            self.group.barrier()?;
        }
        if let Some(path) = &cfg.export_onnx {
            if rank == 0 {
                let value = model_value(&self.ddp.module())?;
                let summary =
                    crate::cmd::export::write(cfg.model, &value, path).context("--export-onnx")?;
                eprintln!("{summary}");
            }
            self.group.barrier()?;
        }
        Ok(RunSummary {
            rank,
            epochs: self.loader.epoch().min(cfg.epochs as u64),
            steps: self.global_step,
            eval_accuracy: Some(self.last_eval.accuracy()),
            verification_accuracy: None,
            samples_per_s: self.samples_seen as f64 / self.train_time.max(1e-9),
            checkpoint: if rank == 0 {
                self.last_ckpt.or_else(|| Some(self.manager.path_for(&final_name)))
            } else {
                None
            },
        })
    }
}

/// What a checkpoint reads from the job.
struct Snapshot<'b> {
    ddp: &'b Ddp<Net>,
    opt: &'b mut TrainOptimizer,
    scaler: Option<&'b GradScaler>,
    sched: &'b Scheduler,
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
    cfg: &TrainConfig,
) -> anyhow::Result<Option<PathBuf>> {
    let Snapshot { ddp, opt, scaler, sched, loader, step } = snapshot;
    let optimizer = opt.checkpoint_state(group.rank())?;
    let scaler = scaler.map_or(Value::None, GradScaler::state_dict);
    let scheduler = schedule::state(sched);
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
    ) -> anyhow::Result<Option<PathBuf>> {
        match self {
            Saver::Sync(m) => Ok(m.save_on_rank(rank, name, &value, || group.barrier())?),
            Saver::Async(m) if rank == 0 => Ok(Some(m.save(name, value).with_context(|| {
                "a background checkpoint save failed (the run stops here; the files before it are intact)"
            })?)),
            Saver::Async(_) => Ok(None),
        }
    }

    /// At the end: rank 0 waits for the save in flight (its error ends the run, naming the
    /// file), then every rank meets at a barrier, so no rank reports success before the last
    /// checkpoint is on disk.
    fn finish(&mut self, rank: usize, group: &ProcessGroup) -> anyhow::Result<()> {
        if let Saver::Async(m) = self {
            let written = if rank == 0 { m.wait().map(|_| ()) } else { Ok(()) };
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
    cfg: &TrainConfig,
    train: InMemoryDataset,
    eval: InMemoryDataset,
) -> anyhow::Result<(TrainData, TrainData)> {
    if !cfg.normalize && !cfg.augment {
        return Ok((Transformed::identity(train), Transformed::identity(eval)));
    }
    let Some(chw) = image_shape(train.input_dim()) else {
        bail!(
            "--normalize/--augment need square images with 1 or 3 channels; --data {} has {} \
             features per sample",
            cfg.data,
            train.input_dim()
        )
    };
    let normalize = if cfg.normalize { Some(channel_stats(&train, chw.0)?) } else { None };
    let crop_flip = cfg.augment.then_some(CropFlip { padding: 4, seed: cfg.seed });
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
) -> anyhow::Result<EvalMetrics> {
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

/// The GradScaler of `--precision f16` (`None` otherwise), growing every
/// `--grad-scaler-growth-interval` clean steps (`default_interval` without the flag).
pub fn grad_scaler(cfg: &TrainConfig, default_interval: i64) -> anyhow::Result<Option<GradScaler>> {
    Ok(match cfg.precision {
        Precision::F16 => Some(GradScaler::new(GradScalerConfig {
            growth_interval: cfg.grad_scaler_growth_interval.unwrap_or(default_interval),
            ..GradScalerConfig::default()
        })?),
        _ => None,
    })
}

/// Loads weights from a PyTorch or tandem file (any container, any wrapping) through the
/// LoadReport path: strict, so a missing or mis-shaped key is an error listing all of them.
pub fn load_weights(net: &Net, path: &Path) -> anyhow::Result<tandem_ckpt::LoadReport> {
    tandem_nn::weights::load_weights(net, path, true)
        .with_context(|| format!("loading weights from {}", path.display()))
}

fn model_value(net: &Net) -> anyhow::Result<Value> {
    Ok(tandem_nn::weights::state_dict_value(net)?)
}

/// Writes the model's weights with canonical keys: safetensors for `.safetensors`, else `.pt`.
fn save_weights(net: &Net, path: &Path) -> anyhow::Result<()> {
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
    cfg: &TrainConfig,
) -> anyhow::Result<Value> {
    let CheckpointState { optimizer, scaler, scheduler, sampler, step } = state;
    let ck = TrainingCheckpoint {
        epoch: sampler.epoch as i64,
        global_step: step as i64,
        model: model_value(net)?,
        optimizer,
        scheduler,
        sampler: sampler_value(&sampler),
        // No random ops beyond the sampler's shuffle (seeded by seed + epoch): the seed is the state.
        rng: Value::dict_from([("seed", Value::Int(cfg.seed as i64))]),
        world_size: world as i64,
        config: Value::Str(cfg.to_toml()?),
        scaler,
    };
    Ok(ck.to_value()?)
}
