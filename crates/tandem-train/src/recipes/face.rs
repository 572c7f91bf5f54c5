//! The face-recognition recipe (insightface's arcface_torch `train_v2.py`) as one rank of
//! `tandem train --model iresnet18|34|50|100 --data rec:DIR`: an IResNet backbone under Ddp
//! (`broadcast_buffers=False`, 16 MB buckets), a PartialFC head whose class centres are split
//! over the ranks, fed by the all-gathered embeddings, with CombinedMarginLoss; one optimizer
//! over two parameter groups (backbone, head); clipping of the backbone's gradients; a
//! per-iteration schedule; f16 with a GradScaler; verification on `.bin` pair sets every
//! `--verbose` steps and at the end; per-rank checkpoints that resume on any world size.
//!
//! One step, in arcface_torch's order: embeddings = backbone(images); loss = head(embeddings,
//! labels); backward (scaled under f16); unscale; clip the backbone's gradient norm; optimizer
//! step (skipped on inf/NaN under f16); scaler update; scheduler step.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::error::{bail, Context, Result};
use candle_core::{DType, Device, Var};
use tandem_ckpt::Value;
use tandem_comm::{Collectives, ProcessGroup, ReduceOp};
use tandem_data::datasets::faces::FaceRecDataset;
use tandem_data::{DataLoader, Dataset, DistributedSampler, LoaderOptions, SamplerState};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::IResNet;
use tandem_nn::{NamedVars, OrderedVarMap, ParamModule};
use tandem_optim::amp::GradScaler;
use tandem_optim::{AdamWConfig, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};
use tandem_partial_fc::{ClassSplit, CombinedMarginLoss, PartialFc, PartialFcConfig};

use crate::metrics::{MetricsFile, MetricsRecord};
use crate::schedule::RunLength;
use crate::{EpochMetrics, EventWriter, Progress, RunSummary, Step};

use super::classifier::metrics_file;
use super::net::Autocast;
use crate::face::{self as face_state, FaceCheckpoints, FaceState};
use crate::metrics::three_figures;
use crate::options::{OptimizerKind, Precision, TrainOptions};
use crate::state::LoaderPosition;
use crate::verification::{self as verify, ValResult, ValSet};

/// arcface_torch's DDP settings for the backbone.
const BUCKET_CAP_MB: f64 = 16.0;
/// arcface_torch's GradScaler growth interval.
const GROWTH_INTERVAL: i64 = 100;

/// Trains the face recipe on this rank.
pub fn run(cfg: &TrainOptions, run_dir: &Path, group: ProcessGroup) -> Result<RunSummary> {
    let mut w = FaceWorker::build(cfg, run_dir, group)?;
    if cfg.run.resume {
        w.resume()?;
    }
    w.train()?;
    w.finish()
}

/// The model, its head and everything a step changes.
struct Trainer {
    model: IResNet,
    /// The backbone's state-dict names in creation order (torch's `state_dict()` order).
    order: Vec<String>,
    ddp: Ddp<NamedVars>,
    head: PartialFc,
    opt: Box<dyn TorchOptimizer + Send>,
    /// The GradScaler (float16), the backbone's clipping and the lr schedule.
    stepper: Step,
    autocast: Autocast,
    times: StepTimes,
}

/// Where a step's time goes on this rank (seconds, summed over the run's steps).
#[derive(Default)]
struct StepTimes {
    steps: u64,
    /// Waiting for the next batch (decoding runs ahead on the loader's threads).
    data: f64,
    /// The backbone's forward pass.
    forward: f64,
    /// PartialFC: gathering the embeddings and labels, logits, margin, softmax.
    head: f64,
    /// Backward, with Ddp's bucketed all-reduce of the backbone's gradients.
    backward: f64,
    /// Unscale, clipping, the optimizer step and the scheduler.
    optimizer: f64,
}

impl StepTimes {
    fn summary(&self) -> String {
        let per = |t: f64| t * 1e3 / self.steps.max(1) as f64;
        let total = self.data + self.forward + self.head + self.backward + self.optimizer;
        format!(
            "time per step on rank 0: {:.1} ms = data {:.1} + backbone forward {:.1} + PartialFC {:.1} + backward and all-reduce {:.1} + optimizer {:.1}",
            per(total),
            per(self.data),
            per(self.forward),
            per(self.head),
            per(self.backward),
            per(self.optimizer)
        )
    }
}

struct FaceWorker<'a> {
    cfg: &'a TrainOptions,
    group: ProcessGroup,
    device: Device,
    t: Trainer,
    train: Arc<FaceRecDataset>,
    loader: DataLoader<FaceRecDataset>,
    val: Vec<ValSet>,
    ckpt: FaceCheckpoints,
    tb: Option<EventWriter>,
    global_step: u64,
    samples_seen: u64,
    train_time: f64,
    last_loss: f64,
    last_val: Vec<ValResult>,
    last_ckpt: Option<PathBuf>,
    epochs_seen: Vec<EpochMetrics>,
    metrics: Option<MetricsFile>,
}

/// `{"backbone": state_dict, "partial_fc": {"weight": [C, E]}}` from `--init-from` (a bare
/// backbone state dict, such as arcface_torch's `model.pt`, initialises the backbone only).
struct InitFrom {
    backbone: Value,
    centres: Option<candle_core::Tensor>,
}

fn read_init(path: &Path) -> Result<InitFrom> {
    let v = tandem_ckpt::load(path).with_context(|| format!("--init-from {}", path.display()))?;
    let Some(backbone) = v.get("backbone") else {
        return Ok(InitFrom { backbone: v, centres: None });
    };
    let centres = match v.get("partial_fc") {
        None => None,
        Some(pfc) => {
            let w = pfc.get("weight").and_then(Value::as_tensor).with_context(|| {
                format!("--init-from {}: `partial_fc` has no `weight` tensor", path.display())
            })?;
            Some(tandem_nn::convert::from_ckpt(w, &Device::Cpu)?)
        }
    };
    Ok(InitFrom { backbone: backbone.clone(), centres })
}

impl<'a> FaceWorker<'a> {
    fn build(cfg: &'a TrainOptions, run_dir: &'a Path, group: ProcessGroup) -> Result<Self> {
        let rank = group.rank();
        let device = cfg.model.device.device(group.local_rank())?;
        let dir = cfg.data.spec.strip_prefix("rec:").unwrap_or(&cfg.data.spec);
        let mut train = FaceRecDataset::open(Path::new(dir))
            .with_context(|| format!("--data {}", cfg.data.spec))?;
        if cfg.data.augment {
            train = train.with_flip(cfg.run.seed);
        }
        let classes = cfg.face.num_classes.unwrap_or(train.num_classes());
        let depth = cfg.model.kind.iresnet_depth().context("a face model")?;

        let vars = OrderedVarMap::new();
        let model = IResNet::new(
            depth,
            cfg.model.width,
            cfg.face.embedding_size,
            0.0,
            vars.var_builder(DType::F32, &device),
        )?;
        IResNet::reset_parameters(&vars.named(), cfg.run.seed)?;
        let order: Vec<String> = vars.named().into_iter().map(|(n, _)| n).collect();
        let named = vars.named_vars().freeze(IResNet::FROZEN)?;
        let init = cfg.checkpoint.init_from.as_deref().map(read_init).transpose()?;
        if let (Some(init), Some(path)) = (&init, &cfg.checkpoint.init_from) {
            let report = named
                .load_state_dict(&init.backbone)
                .with_context(|| format!("--init-from {}: the backbone", path.display()))?;
            if rank == 0 {
                eprintln!("init-from {}:\n{report}", path.display());
            }
        }
        let opts = DdpOptions {
            bucket_cap_mb: BUCKET_CAP_MB,
            broadcast_buffers: false,
            ..DdpOptions::default()
        };
        let ddp = Ddp::new(named, &group, opts).context("wrapping the backbone in Ddp")?;
        if cfg.comm.comm_hook != "none" {
            let hook = tandem_ddp::comm_hooks::builtin(&cfg.comm.comm_hook)
                .with_context(|| format!("--comm-hook: unknown hook `{}`", cfg.comm.comm_hook))?;
            ddp.register_comm_hook(hook).context("--comm-hook")?;
        }

        let head = build_head(cfg, classes, &group, &device, init.and_then(|i| i.centres))?;
        let mut opt = build_optimizer(cfg, ddp.params(), head.weight().clone())?;

        let sampler = DistributedSampler::builder(train.len())
            .group(&group)
            .shuffle(cfg.data.shuffle)
            .seed(cfg.run.seed)
            .build()?;
        // PartialFC needs the same batch on every rank: the last partial batch is dropped.
        let options = LoaderOptions {
            batch_size: cfg.data.batch_size,
            drop_last: true,
            num_workers: 2,
            prefetch_factor: 2,
        };
        let train = Arc::new(train);
        let loader = DataLoader::new(Arc::clone(&train), sampler, options, device.clone())?;
        if loader.is_empty() {
            bail!(
                "--data {}: {} images give rank {rank} fewer than one batch of {} (over {} ranks)",
                cfg.data.spec,
                train.len(),
                cfg.data.batch_size,
                group.size()
            );
        }
        // The schedule spans --epochs (--steps may stop the run before its end), as
        // arcface_torch's `total_step`, counted in the batches the loader really gives.
        let steps_per_epoch = loader.len() as u64;
        let total_steps = cfg.run.epochs * steps_per_epoch;
        let sched = cfg
            .optim
            .schedule
            .build(opt.as_mut(), cfg.optim.lr, RunLength { steps_per_epoch, total_steps })
            .context("--lr-scheduler")?;
        let stepper = super::step_for(cfg, GROWTH_INTERVAL, sched)?;
        let val = verify::load(&cfg.face.val).context("--val")?;
        let tb = if cfg.run.tensorboard && rank == 0 {
            let dir = run_dir.join("tensorboard");
            Some(EventWriter::create(&dir).with_context(|| {
                format!("creating a TensorBoard event file in {}", dir.display())
            })?)
        } else {
            None
        };
        if rank == 0 {
            eprintln!(
                "face: {} width {} embedding {} | {} images, {classes} classes ({} to {} per rank) | {} ranks x batch {} | {steps_per_epoch} steps per epoch",
                cfg.model.kind,
                cfg.model.width,
                cfg.face.embedding_size,
                train.len(),
                ClassSplit::new(classes, group.size(), group.size() - 1).len,
                head.split().len,
                group.size(),
                cfg.data.batch_size,
            );
        }
        let t = Trainer {
            model,
            order,
            ddp,
            head,
            opt,
            stepper,
            autocast: Autocast(
                (cfg.model.precision != Precision::F32)
                    .then(|| cfg.model.precision.compute_dtype()),
            ),
            times: StepTimes::default(),
        };
        Ok(FaceWorker {
            cfg,
            device,
            t,
            train,
            loader,
            val,
            ckpt: FaceCheckpoints::new(run_dir.join("checkpoints"), cfg.checkpoint.keep_last),
            tb,
            group,
            global_step: 0,
            samples_seen: 0,
            train_time: 0.0,
            last_loss: f64::NAN,
            last_val: Vec::new(),
            last_ckpt: None,
            epochs_seen: Vec::new(),
            metrics: metrics_file(run_dir, rank)?,
        })
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// `--resume`: the newest complete checkpoint, on this world size or another (the head's
    /// centres and their optimizer state re-split over this run's ranks).
    fn resume(&mut self) -> Result<()> {
        let (rank, world, epochs) = (self.rank(), self.group.size(), self.cfg.run.epochs);
        let Trainer { ddp, head, opt, stepper, .. } = &mut self.t;
        let mut state = FaceState::new(ddp, head, opt.as_mut(), stepper);
        let found =
            face_state::resume(&self.ckpt, &mut state, &mut self.loader, epochs, &self.group)?;
        let Some(r) = found else {
            if rank == 0 {
                let dir = self.ckpt.dir().display();
                eprintln!("--resume: no checkpoint in {dir}, starting fresh");
            }
            return Ok(());
        };
        self.global_step = r.step;
        if rank == 0 {
            eprintln!("resumed from {} (epoch {}, step {})", r.dir.display(), r.epoch, r.step);
            if r.world_size != world {
                eprintln!(
                    "the checkpoint was written by {} ranks, this run has {world}: the {} class centres and their optimizer state are re-split ({} per rank here)",
                    r.world_size, r.num_classes, r.rows
                );
            }
        }
        Ok(())
    }

    /// Steps to the end of --epochs from where the loader stands.
    fn steps_to_end(&self) -> u64 {
        self.loader.steps_to_end(self.cfg.run.epochs)
    }

    fn train(&mut self) -> Result<()> {
        let max_steps =
            self.cfg.run.max_steps.unwrap_or(u64::MAX).min(self.global_step + self.steps_to_end());
        let progress = Progress::new(self.rank() == 0, max_steps, self.global_step);
        while self.loader.epoch() < self.cfg.run.epochs && self.global_step < max_steps {
            let epoch = self.loader.epoch();
            let loss = self.train_epoch(max_steps, &progress)?;
            self.last_loss = loss;
            if self.rank() == 0 {
                let sps = self.samples_seen as f64 / self.train_time.max(1e-9);
                let skipped = self.t.stepper.skipped_steps();
                let loss_scale = self.t.stepper.grad_scaler().map(GradScaler::get_scale);
                let amp = loss_scale
                    .map_or(String::new(), |s| format!(" loss_scale={s} skipped_steps={skipped}"));
                progress.line(&format!(
                    "epoch {}/{} step {} loss={loss:.4} samples/s={} lr={}{amp}{}",
                    epoch + 1,
                    self.cfg.run.epochs,
                    self.global_step,
                    three_figures(sps),
                    self.t.opt.lr(),
                    val_text(&self.last_val),
                ));
                let metrics = EpochMetrics {
                    epoch: epoch + 1,
                    step: self.global_step,
                    train_loss: loss,
                    eval_loss: None,
                    eval_accuracy: None,
                    verification: self.last_val.clone(),
                    samples_per_s: sps,
                    lr: self.t.opt.lr(),
                    loss_scale,
                    skipped_steps: skipped,
                };
                if let Some(file) = self.metrics.as_mut() {
                    file.write(&MetricsRecord::Epoch(metrics.clone()))?;
                }
                self.epochs_seen.push(metrics);
                let values = [("train/loss", loss), ("train/samples_per_s", sps)];
                scalars(&mut self.tb, self.global_step, &values)?;
            }
            let step = self.global_step;
            let every = self.cfg.checkpoint.save_every;
            let just_saved = every > 0 && step.is_multiple_of(every);
            if step < max_steps && self.loader.epoch() < self.cfg.run.epochs && !just_saved {
                self.save()?;
            }
        }
        progress.finish();
        Ok(())
    }

    /// The rest of the current epoch (up to `max_steps`); returns the mean loss of its steps
    /// (every rank computes the loss of the global batch, so no reduction is needed).
    fn train_epoch(&mut self, max_steps: u64, progress: &Progress) -> Result<f64> {
        let started = Instant::now();
        // Disjoint borrows: the batch iterator holds the loader while checkpoints read it.
        let FaceWorker { cfg, group, device, t, train, loader, val, ckpt, tb, .. } = self;
        train.set_epoch(loader.epoch());
        let (mut loss_sum, mut steps, mut pause) = (0.0f64, 0u64, 0.0f64);
        let world = group.size() as u64;
        let mut batches = loader.iter()?;
        let in_epoch = batches.num_batches();
        let mut taken = 0usize;
        while self.global_step < max_steps {
            let waited = Instant::now();
            let Some(batch) = batches.next() else { break };
            t.times.data += waited.elapsed().as_secs_f64();
            taken += 1;
            let batch = batch?;
            let labels: Vec<i64> = batch.y.to_vec1::<u32>()?.into_iter().map(i64::from).collect();
            let loss = t.step(&batch.x, &labels, self.global_step + 1)?;
            self.global_step += 1;
            self.samples_seen += batch.len() as u64 * world;
            loss_sum += loss;
            steps += 1;
            let step = self.global_step;
            progress.step(step, loss_sum / steps as f64);
            if step.is_multiple_of(100) {
                scalars(tb, step, &[("train/loss_step", loss), ("train/lr", t.opt.lr())])?;
            }
            if cfg.face.verify_every > 0
                && step.is_multiple_of(cfg.face.verify_every)
                && step < max_steps
            {
                let clock = Instant::now();
                if let Some(results) = verify(t, val, device, tb, step, group)? {
                    self.last_val = results;
                }
                pause += clock.elapsed().as_secs_f64();
            }
            let every = cfg.checkpoint.save_every;
            if every > 0 && step.is_multiple_of(every) && step < max_steps {
                let clock = Instant::now();
                let ctx = SaveCtx { cfg, group, ckpt };
                self.last_ckpt = Some(save_checkpoint(&ctx, t, &loader.state(), step)?);
                pause += clock.elapsed().as_secs_f64();
            }
        }
        if taken == in_epoch {
            // The epoch's batches are all used: let the loader close it (moves to the next epoch).
            let _ = batches.next();
        }
        drop(batches);
        self.train_time += started.elapsed().as_secs_f64() - pause;
        Ok(loss_sum / steps.max(1) as f64)
    }

    fn save(&mut self) -> Result<()> {
        let ctx = SaveCtx { cfg: self.cfg, group: &self.group, ckpt: &self.ckpt };
        let dir = save_checkpoint(&ctx, &mut self.t, &self.loader.state(), self.global_step)?;
        self.last_ckpt = Some(dir);
        Ok(())
    }

    fn finish(mut self) -> Result<RunSummary> {
        let rank = self.rank();
        self.save()?;
        let step = self.global_step;
        if let Some(results) =
            verify(&self.t, &self.val, &self.device, &mut self.tb, step, &self.group)?
        {
            self.last_val = results;
        }
        if rank == 0 && !self.last_val.is_empty() {
            println!("verification:{}", val_text(&self.last_val));
        }
        if rank == 0 && self.t.times.steps > 0 {
            eprintln!("{}", self.t.times.summary());
        }
        if let Some(path) = &self.cfg.checkpoint.save_final {
            if rank == 0 {
                tandem_nn::weights::save_weights(&*self.t.ddp.module(), path)
                    .with_context(|| format!("--save-final {}", path.display()))?;
            }
            self.group.barrier()?;
        }
        if let Some(path) = &self.cfg.checkpoint.export_onnx {
            if rank == 0 {
                let value = self.t.ddp.module().state_dict()?;
                let summary = tandem_onnx::export_to_file(self.cfg.model.kind, &value, path)
                    .context("--export-onnx")?;
                eprintln!("{summary}");
            }
            self.group.barrier()?;
        }
        // Every rank agrees the run is over before any reports it.
        let mut done = [1.0f64];
        self.group.all_reduce(&mut done, ReduceOp::Sum)?;
        let summary = RunSummary {
            rank,
            epochs: self.loader.epoch().min(self.cfg.run.epochs),
            steps: self.global_step,
            samples_per_s: self.samples_seen as f64 / self.train_time.max(1e-9),
            final_loss: self.last_loss.is_finite().then_some(self.last_loss),
            eval_accuracy: None,
            verification_accuracy: self.last_val.first().map(|r| r.accuracy),
            checkpoint: if rank == 0 { self.last_ckpt.clone() } else { None },
            skipped_steps: self.t.stepper.skipped_steps(),
            epochs_seen: std::mem::take(&mut self.epochs_seen),
        };
        if let Some(file) = self.metrics.as_mut() {
            file.write(&MetricsRecord::Summary(summary.clone()))?;
        }
        Ok(summary)
    }
}

/// What a checkpoint save needs besides the state.
struct SaveCtx<'c> {
    cfg: &'c TrainOptions,
    group: &'c ProcessGroup,
    ckpt: &'c FaceCheckpoints,
}

/// A checkpoint of the whole state at `step` (a collective); returns its directory.
fn save_checkpoint(
    ctx: &SaveCtx<'_>,
    t: &mut Trainer,
    position: &SamplerState,
    step: u64,
) -> Result<PathBuf> {
    let SaveCtx { cfg, group, ckpt } = *ctx;
    let Trainer { ddp, head, opt, stepper, order, .. } = t;
    let state = FaceState::new(ddp, head, opt.as_mut(), stepper)
        .order(order)
        .global_step(step)
        .config(cfg.run.record.clone())
        .seed(cfg.run.seed);
    Ok(face_state::save(ckpt, &state, position, group)?)
}

/// The verification sets on rank 0's model, the images shared over the ranks (a collective);
/// rank 0 reports. `None` without sets.
fn verify(
    t: &Trainer,
    val: &[ValSet],
    device: &Device,
    tb: &mut Option<EventWriter>,
    step: u64,
    group: &ProcessGroup,
) -> Result<Option<Vec<ValResult>>> {
    if val.is_empty() {
        return Ok(None);
    }
    let buffers = t.ddp.module().named_buffers();
    let results = verify::evaluate(&t.model, &buffers, val, device, group).context("--val")?;
    if group.rank() == 0 {
        for r in &results {
            eprintln!("[{}][{step}] accuracy-flip: {:.5}+-{:.5}", r.name, r.accuracy, r.std);
        }
    }
    let names: Vec<(String, f64)> =
        results.iter().map(|r| (format!("verification/{}", r.name), r.accuracy)).collect();
    let refs: Vec<(&str, f64)> = names.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    scalars(tb, step, &refs)?;
    Ok(Some(results))
}

/// TensorBoard scalars at `step` (nothing without --tensorboard or off rank 0).
fn scalars(tb: &mut Option<EventWriter>, step: u64, values: &[(&str, f64)]) -> Result<()> {
    let Some(tb) = tb.as_mut() else { return Ok(()) };
    let mut write = || -> std::io::Result<()> {
        for (k, v) in values {
            tb.add_scalar(k, *v as f32, step as i64)?;
        }
        tb.flush()
    };
    write().with_context(|| format!("writing TensorBoard events to {}", tb.path().display()))
}

impl Trainer {
    /// One optimizer step on this rank's batch; returns the loss of the global batch.
    fn step(&mut self, x: &candle_core::Tensor, labels: &[i64], step: u64) -> Result<f64> {
        let clock = Instant::now();
        let embeddings = self.autocast.round(&self.model.forward_t(x, true)?)?;
        let forward = clock.elapsed().as_secs_f64();
        let loss = self.head.forward(&embeddings, labels)?;
        let value = loss.to_scalar::<f32>()? as f64;
        let head = clock.elapsed().as_secs_f64();
        let local = [self.head.weight().clone()];
        let backbone = self.ddp.params();
        let ddp = &self.ddp;
        let out = self.stepper.run(
            &loss,
            |l| ddp.backward_with_local(l, &local),
            self.opt.as_mut(),
            &backbone,
            step,
        )?;
        let t = &mut self.times;
        t.steps += 1;
        t.forward += forward;
        t.head += head - forward;
        t.backward += out.backward_secs;
        t.optimizer += out.optimizer_secs;
        Ok(value)
    }
}

/// The head: this rank's rows of `--init-from`'s centres, or N(0, 0.01) from the seed.
fn build_head(
    cfg: &TrainOptions,
    classes: usize,
    group: &ProcessGroup,
    device: &Device,
    centres: Option<candle_core::Tensor>,
) -> Result<PartialFc> {
    let (m1, m2, m3) = cfg.face.margin;
    let margin = CombinedMarginLoss::new(
        cfg.face.margin_scale,
        m1,
        m2,
        m3,
        cfg.face.interclass_filtering_threshold,
    )
    .with_context(|| format!("--margin {m1},{m2},{m3}"))?;
    let mut pcfg = PartialFcConfig::new(classes, cfg.face.embedding_size, margin);
    pcfg.sample_rate = cfg.face.sample_rate;
    pcfg.seed = cfg.run.seed;
    if cfg.model.precision != Precision::F32 {
        pcfg.autocast = Some(cfg.model.precision.compute_dtype());
    }
    let comm: Arc<dyn Collectives> = Arc::new(group.clone());
    let head = match centres {
        Some(full) => PartialFc::from_full_weight(pcfg, comm, &full.to_device(device)?)
            .context("--init-from: `partial_fc.weight`")?,
        None => PartialFc::new(pcfg, comm, device)?,
    };
    Ok(head)
}

/// One optimizer over two parameter groups, backbone then head, as arcface_torch.
fn build_optimizer(
    cfg: &TrainOptions,
    backbone: Vec<Var>,
    centres: Var,
) -> Result<Box<dyn TorchOptimizer + Send>> {
    Ok(match cfg.optim.kind {
        OptimizerKind::Sgd => {
            let c = SgdConfig {
                lr: cfg.optim.lr,
                momentum: cfg.optim.momentum,
                weight_decay: cfg.optim.weight_decay,
                ..SgdConfig::default()
            };
            Box::new(TorchSgd::with_groups(vec![(backbone, c.clone()), (vec![centres], c)])?)
        }
        OptimizerKind::Adamw => {
            let c = AdamWConfig {
                lr: cfg.optim.lr,
                weight_decay: cfg.optim.weight_decay,
                ..AdamWConfig::default()
            };
            Box::new(TorchAdamW::with_groups(vec![(backbone, c.clone()), (vec![centres], c)])?)
        }
    })
}

/// ` verification_accuracy=X lfw=X±S ...` for the epoch line.
fn val_text(results: &[ValResult]) -> String {
    let Some(first) = results.first() else { return String::new() };
    let mut s = format!(" verification_accuracy={:.4}", first.accuracy);
    for r in results {
        s += &format!(" {}={:.4}+-{:.4}", r.name, r.accuracy, r.std);
    }
    s
}
