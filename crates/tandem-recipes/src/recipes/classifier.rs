//! The classifier recipe (mlp, cnn, resnet18 on digits, MNIST, CIFAR-10 or synthetic data):
//! the model under Ddp, its optimizer (plain or ZeRO-sharded), per-epoch evaluation on the eval
//! split, and rank 0's checkpoint files (synchronous or in the background), which resume on any
//! world size and move between ranks under live recovery. The [`Trainer`](tandem_train::Trainer)
//! drives it.
use std::path::{Path, PathBuf};
use std::sync::Arc;
#[cfg(feature = "zero")]
use std::time::Instant;

use candle_core::Device;
use tandem_ckpt::{TrainingCheckpoint, Value};
use tandem_comm::{Collectives, ProcessGroup};
use tandem_data::{
    channel_stats, Batch, CropFlip, DataLoader, Dataset, EvalMetrics, ImageTransforms,
    InMemoryDataset, LoaderOptions, SamplerState, Transformed,
};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_optim::amp::GradScaler;
use tandem_optim::TorchOptimizer;
use tandem_train::checkpoint::{Checkpointer, ShardDict, TrainingStateDict};
use tandem_train::events::Reporter;
#[cfg(feature = "zero")]
use tandem_train::events::Resplit;
#[cfg(feature = "zero")]
use tandem_train::live::owned_by;
use tandem_train::live::{Entries, Mirrored};
use tandem_train::schedule::{self, RunLength};
use tandem_train::state::{
    replicated_with_optimizer, reshard_message, sampler_state_from_value, sampler_value,
    OPTIMIZER_SHARD,
};
use tandem_train::{
    evaluate_logits, fault, Context, CustomState, Evaluation, Recipe, Result, ResumeContext,
    Resumed, SaveContext, Step, StepReport, TrainError,
};

use super::net::{image_shape, Net, NetSpec};
use super::optimizer::TrainOptimizer;
use super::LiveComm;
use crate::options::TrainOptions;

/// The classifier's model, optimizer, eval data and checkpoint files.
pub struct Classifier<'a> {
    cfg: &'a TrainOptions,
    device: Device,
    ddp: Ddp<Net>,
    opt: TrainOptimizer,
    train: Arc<TrainData>,
    eval: Arc<TrainData>,
    options: LoaderOptions,
    ckpt: Checkpointer,
    last_eval: EvalMetrics,
    /// `--zero` under live recovery: the optimizer shards' mirror and re-split.
    zero_live: Option<Mirrored<Entries>>,
    /// The hyperparameters a live load brought (the shard's entries move in the re-split).
    zero_pending: Option<Value>,
    reporter: Reporter,
}

impl<'a> Classifier<'a> {
    /// `live`: the collectives Ddp, SyncBatchNorm and ZeRO use instead of `group` (they follow
    /// a live world's regroups).
    pub fn build(
        cfg: &'a TrainOptions,
        group: &ProcessGroup,
        live: Option<LiveComm>,
        reporter: &Reporter,
    ) -> Result<(Self, DataLoader<TrainData>, Step)> {
        let run_dir = cfg.run.dir.as_path();
        let rank = group.rank();
        let device = cfg.model.device.device(group.local_rank())?;
        let (train, eval) = tandem_data::datasets::from_spec(&cfg.data.spec)
            .option("data", Some(cfg.data.spec.clone()))?;
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
                Some(l) => Arc::clone(&l.comm),
                None => Arc::new(group.clone()),
            };
            net.convert_sync_batchnorm(comm)?;
        }
        let (train, eval) = image_transforms(cfg, train, eval)?;
        if let Some(path) = &cfg.checkpoint.init_from {
            let report = load_weights(&net, path)?;
            if rank == 0 {
                super::note(reporter, format!("init-from {}:\n{report}", path.display()))?;
            }
        }
        let zero_live = match &live {
            // A replacement holds no shard until it joins.
            Some(l) if cfg.optim.zero => Some(Mirrored::new(cfg.comm.mirror_every, !l.replacement)),
            _ => None,
        };
        let zero_comm = live.as_ref().map(|l| Arc::clone(&l.comm));
        // The ResNet (a VarMap model of fused layers, each parameter read once) reduces its
        // buckets while backward runs, unless SyncBatchNorm's collectives run in backward too.
        let early = matches!(net, Net::ResNet18(_))
            && !cfg.model.sync_batchnorm
            && super::overlap_allowed();
        let base = DdpOptions { reduce_during_backward: early, ..DdpOptions::default() };
        let ddp = match live {
            Some(l) => {
                // A replacement's parameters come with the state when it joins.
                let opts = DdpOptions { sync_on_init: !l.replacement, ..base };
                Ddp::with_comm(net, l.comm, opts)
            }
            None => Ddp::new(net, group, base),
        }
        .context("wrapping the model in Ddp")?;
        super::register_comm_hook(&ddp, cfg)?;
        let mut opt = match zero_comm {
            Some(comm) => TrainOptimizer::with_comm(cfg, ddp.params(), comm)?,
            None => TrainOptimizer::new(cfg, ddp.params(), group)?,
        };
        let options = LoaderOptions {
            batch_size: cfg.data.batch_size,
            drop_last: false,
            num_workers: cfg.data.num_workers.unwrap_or(1),
            prefetch_factor: 2,
        };
        let train = Arc::new(train);
        let loader = super::training_loader(cfg, &train, group, options.clone(), &device)?;
        // The schedule spans --epochs (--steps may stop the run before its end).
        let steps_per_epoch = loader.len() as u64;
        let total_steps = cfg.run.epochs * steps_per_epoch;
        let sched = cfg
            .optim
            .schedule
            .build(opt.get_mut(), cfg.optim.lr, RunLength { steps_per_epoch, total_steps })
            .option("lr_scheduler", None)?;
        let stepper = super::step_for(cfg, 2000, sched)?;
        let ckpt = Checkpointer::new(run_dir.join("checkpoints"), cfg.checkpoint.keep_last)
            .background(cfg.checkpoint.background);
        let recipe = Classifier {
            cfg,
            device,
            ddp,
            opt,
            train,
            eval: Arc::new(eval),
            options,
            ckpt,
            last_eval: EvalMetrics::default(),
            zero_live,
            zero_pending: None,
            reporter: reporter.clone(),
        };
        Ok((recipe, loader, stepper))
    }

    /// Restores `ck` (named `what` in errors): model, optimizer, loader position (through
    /// `ctx.loader`, which may reshard it), loss scale and schedule (stretched over the steps
    /// left). Returns the saved loader position and step count.
    fn apply_state(
        &mut self,
        ck: &TrainingCheckpoint,
        what: &str,
        ctx: ResumeContext<'_>,
        live: bool,
    ) -> Result<(SamplerState, u64)> {
        let rank = ctx.group.rank();
        tandem_nn::weights::load_weights_from(&*self.ddp.module(), &ck.model, true)
            .with_context(|| format!("{what}: model"))?;
        match self.zero_live.as_ref().filter(|_| live) {
            // The shards move in the re-split that follows; only the hyperparameters came.
            Some(_) => self.zero_pending = Some(ck.optimizer.clone()),
            None => self
                .opt
                .get_mut()
                .load_state_dict(&ck.optimizer)
                .with_context(|| format!("optimizer state in {what}"))?,
        }
        let position = sampler_state_from_value(&ck.sampler).map_err(|problem| {
            TrainError::invalid(format!("{what}: checkpoint `sampler`: {problem}"))
        })?;
        ctx.loader
            .set_position(&position)
            .with_context(|| format!("{what}: checkpoint `sampler` does not fit this run"))?;
        match (ctx.step.grad_scaler_mut(), &ck.scaler) {
            (Some(s), Value::None) if rank == 0 => tracing::warn!(
                "{what}: no GradScaler state (written without f16 precision); the loss scale \
                 starts at {}",
                s.get_scale()
            ),
            (Some(_), Value::None) | (None, _) => {}
            (Some(s), state) => {
                s.load_state_dict(state).with_context(|| format!("GradScaler state in {what}"))?
            }
        }
        let global_step = ck.global_step as u64;
        let max_steps = Some(global_step + ctx.loader.steps_to_end(ctx.epochs));
        let sched = ctx.step.lr_scheduler_mut();
        schedule::load(sched, &ck.scheduler, self.opt.get_mut(), max_steps, what)
            .option("lr_scheduler", None)?;
        Ok((position, global_step))
    }
}

/// The replicated training state (what a save writes once and a live regroup sends): with ZeRO
/// the optimizer's hyperparameters only (each rank's entries are its own shard). A function of
/// the parts it reads, so a save can borrow the recipe's checkpointer beside them.
fn state_value(
    ddp: &Ddp<Net>,
    opt: &TrainOptimizer,
    cfg: &TrainOptions,
    ctx: &SaveContext<'_>,
) -> Result<Value> {
    let optimizer = opt.live_state()?;
    let scaler = ctx.step.grad_scaler().map_or(Value::None, GradScaler::state_dict);
    let scheduler = schedule::state(ctx.step.lr_scheduler());
    let state = CheckpointState {
        optimizer,
        scaler,
        scheduler,
        sampler: ctx.position.clone(),
        step: ctx.global_step,
    };
    checkpoint_value(&ddp.module(), state, ctx.group.size(), cfg)
}

impl Recipe for Classifier<'_> {
    type Data = TrainData;

    fn train_step(&mut self, batch: &Batch, step: &mut Step, n: u64) -> Result<StepReport> {
        let clock = std::time::Instant::now();
        let loss = self.ddp.hooked().loss(&batch.x, &batch.y)?;
        fault::hit(fault::Phase::Forward);
        tandem_train::phase_end(batch.x.device())?;
        let forward_secs = clock.elapsed().as_secs_f64();
        let (ddp, params) = (&self.ddp, self.ddp.params());
        let backward = |loss: &candle_core::Tensor| -> Result<_> {
            let grads = ddp.backward(loss)?;
            fault::hit(fault::Phase::Optimizer);
            Ok(grads)
        };
        let out = step.run(&loss, backward, self.opt.get_mut(), &params, n)?;
        if let Some(z) = self.zero_live.as_mut() {
            z.stepped(n);
        }
        // On a GPU the loss stays there: the trainer reads it a few steps later.
        let (value, pending_loss) = if loss.device().is_cpu() {
            (loss.to_scalar::<f32>()? as f64, None)
        } else {
            (f64::NAN, Some(loss.detach()))
        };
        Ok(StepReport {
            loss: value,
            pending_loss,
            samples: batch.len(),
            forward_secs,
            head_secs: 0.0,
            backward_secs: out.backward_secs,
            optimizer_secs: out.optimizer_secs,
        })
    }

    fn optimizer(&mut self) -> &mut dyn TorchOptimizer {
        self.opt.get_mut()
    }

    fn start_epoch(&mut self, epoch: u64) {
        self.train.set_epoch(epoch);
    }

    fn set_training(&mut self, training: bool) -> Result<()> {
        self.ddp.module().set_training(training);
        Ok(())
    }

    fn evaluate(&mut self, group: &ProcessGroup) -> Result<Option<Evaluation>> {
        let net = self.ddp.module();
        let forward = |x: &candle_core::Tensor| net.forward(x);
        self.last_eval = evaluate_logits(forward, &self.eval, group, &self.options, &self.device)?;
        Ok(Some(Evaluation {
            loss: self.last_eval.mean_loss(),
            accuracy: self.last_eval.accuracy(),
        }))
    }

    /// `--save-final` and `--export-onnx` (rank 0 writes, every rank meets).
    fn finish(&mut self, group: &ProcessGroup) -> Result<()> {
        let mirror = self.zero_live.as_ref().map(|z| z.cost("optimizer shard"));
        super::finish_run(self.cfg, group, &self.reporter, mirror, &*self.ddp.module())
    }

    fn custom_state(&mut self) -> Option<&mut dyn CustomState> {
        Some(self)
    }
}

impl CustomState for Classifier<'_> {
    /// One file rank 0 writes; with `--zero` a directory: the replicated part once and every
    /// rank's optimizer entries in parallel (nothing gathered).
    fn save(&mut self, ctx: SaveContext<'_>) -> Result<Option<PathBuf>> {
        let (ddp, opt, cfg) = (&self.ddp, &self.opt, self.cfg);
        let build = || -> Result<TrainingStateDict> {
            let replicated = state_value(ddp, opt, cfg, &ctx)?;
            let mut dict = TrainingStateDict::new(ctx.global_step, ctx.position.epoch, replicated);
            if let Some(s) = opt.get().shard()? {
                dict = dict.shard(ShardDict::entries(OPTIMIZER_SHARD, s.indices, s.entries));
            }
            Ok(dict)
        };
        let path = self.ckpt.save_built(ctx.group, ctx.name, build).with_context(|| {
            "a checkpoint save failed (the run stops here; the checkpoints before it are intact)"
        })?;
        Ok((ctx.group.rank() == 0).then_some(path))
    }

    fn settle(&mut self, group: &ProcessGroup) -> Result<()> {
        self.ckpt.settle(group).context("a background checkpoint save failed")?;
        Ok(())
    }

    /// Model, optimizer, loader position and loss scale from the newest checkpoint that
    /// verifies (a fresh start when there is none).
    fn resume(&mut self, ctx: ResumeContext<'_>) -> Result<Option<Resumed>> {
        let (rank, world) = (ctx.group.rank(), ctx.group.size());
        let found = self.ckpt.latest().context("looking for a checkpoint to resume")?;
        let Some(saved) = found else {
            if rank == 0 {
                let dir = self.ckpt.dir().display();
                super::note(
                    &self.reporter,
                    format!("no checkpoint in {dir} to resume; starting fresh"),
                )?;
            }
            return Ok(None);
        };
        let path = saved.path().to_path_buf();
        let owned = self.opt.get().owned_params();
        let value = replicated_with_optimizer(&saved, owned.as_deref())
            .with_context(|| format!("reading {}", path.display()))?;
        let ck = TrainingCheckpoint::from_value(&value)
            .with_context(|| format!("reading {}", path.display()))?;
        let what = path.display().to_string();
        let ResumeContext { group, loader, step, epochs } = ctx;
        let ctx = ResumeContext { group, loader: &mut *loader, step, epochs };
        let (position, global_step) = self.apply_state(&ck, &what, ctx, false)?;
        let world_size = ck.world_size as usize;
        let note = (world_size != world).then(|| reshard_message(&position, world, &*loader));
        let epoch = loader.position().epoch;
        Ok(Some(Resumed { path, step: global_step, epoch, world_size, note }))
    }

    /// Not a collective: only the source builds it (with ZeRO, the shards move in the
    /// re-split that follows).
    fn live_state(&mut self, ctx: SaveContext<'_>) -> Result<Value> {
        state_value(&self.ddp, &self.opt, self.cfg, &ctx)
    }

    /// `--zero` under live recovery: every `--mirror-every` steps this rank's optimizer shard
    /// goes to the next rank.
    #[cfg(feature = "zero")]
    fn after_step(&mut self, group: &ProcessGroup, n: u64) -> Result<()> {
        match &self.zero_live {
            Some(z) if z.due(n) => self.mirror_shard(group, n),
            _ => Ok(()),
        }
    }

    /// `--zero` under live recovery: the optimizer state re-split over the new world's
    /// partition (each parameter's from its newest holder, fresh where nobody holds it).
    #[cfg(feature = "zero")]
    fn regroup(&mut self, group: &ProcessGroup, global_step: u64) -> Result<Option<Resplit>> {
        let (Some(z), TrainOptimizer::Zero(opt)) = (self.zero_live.as_mut(), &self.opt) else {
            return Ok(None);
        };
        let shard = opt.shard_state_dict()?;
        let own = z
            .holds()
            .map(|step| Entries::from_state(shard.get("state").unwrap_or(&Value::None), step));
        let owner = opt.partition_for(group.size()).owner;
        let want = |rank: usize| owned_by(&owner, rank);
        let (entries, counts) =
            z.regroup(group, global_step, owner.len(), own.as_ref(), &want, &mut |_| Ok(None))?;
        let groups = match self.zero_pending.take() {
            Some(p) => p.get("param_groups").cloned().unwrap_or(Value::List(vec![])),
            None => {
                self.opt.live_state()?.get("param_groups").cloned().unwrap_or(Value::List(vec![]))
            }
        };
        let state = Value::dict_from([("state", entries.into_state()), ("param_groups", groups)]);
        let lr = self.opt.get().lr();
        self.opt
            .repartition(self.cfg, &state)
            .context("taking the new world's shard")
            .option("zero", None)?;
        if self.opt.get().group_lrs().len() == 1 && lr > 0.0 {
            // The schedule's rate (set before the shard changed hands).
            self.opt.get_mut().set_lr(lr);
        }
        self.mirror_shard(group, global_step)?;
        Ok(Some(Resplit::OptimizerShards(counts)))
    }

    fn load_live_state(&mut self, value: &Value, ctx: ResumeContext<'_>) -> Result<u64> {
        let ck = TrainingCheckpoint::from_value(value).context("the live state")?;
        Ok(self.apply_state(&ck, "the live state", ctx, true)?.1)
    }
}

impl Classifier<'_> {
    /// Sends this rank's ZeRO shard to the next rank, keeps the previous rank's (a collective).
    #[cfg(feature = "zero")]
    fn mirror_shard(&mut self, group: &ProcessGroup, step: u64) -> Result<()> {
        let clock = Instant::now();
        let params = self.ddp.params().len();
        let (Some(z), TrainOptimizer::Zero(opt)) = (self.zero_live.as_mut(), &self.opt) else {
            return Ok(());
        };
        let shard = opt.shard_state_dict()?;
        let own = Entries::from_state(shard.get("state").unwrap_or(&Value::None), step);
        Ok(z.exchange(group, &own, params, clock)?)
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
        let key = if cfg.data.normalize { "normalize" } else { "augment" };
        return Err(TrainError::option(
            key,
            None,
            format!(
                "needs square images with 1 or 3 channels; the data ({}) has {} features per \
                 sample",
                cfg.data.spec,
                train.input_dim()
            ),
        ));
    };
    let normalize = if cfg.data.normalize { Some(channel_stats(&train, chw.0)?) } else { None };
    let crop_flip = cfg.data.augment.then_some(CropFlip { padding: 4, seed: cfg.run.seed });
    let eval_t = ImageTransforms { chw, normalize: normalize.clone(), crop_flip: None };
    let train_t = ImageTransforms { chw, normalize, crop_flip };
    Ok((Transformed::new(train, train_t)?, Transformed::new(eval, eval_t)?))
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
