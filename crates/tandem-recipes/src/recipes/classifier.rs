//! The classifier recipe (mlp, cnn, resnet18 on digits, MNIST, CIFAR-10 or synthetic data):
//! the model under Ddp (or sharded, `--fsdp`: one root unit), its optimizer (plain or
//! ZeRO-sharded) and per-epoch evaluation on the eval split. Its state is the
//! [`Trainer`](tandem_train::Trainer)'s to save (synchronously or in the background, one file
//! or with ZeRO a directory of shards), resume on any world size and move between ranks under
//! live recovery.
use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use tandem_comm::{Collectives, ProcessGroup};
use tandem_data::{
    channel_stats, Batch, CropFlip, DataLoader, Dataset, EvalMetrics, ImageTransforms,
    InMemoryDataset, LoaderOptions, Transformed,
};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_nn::ParamModule;
use tandem_optim::TorchOptimizer;
use tandem_train::events::Reporter;
use tandem_train::schedule::RunLength;
use tandem_train::{
    evaluate_logits, fault, Context, Evaluation, RankBuffers, Recipe, Result, Step, StepReport,
    TrainError, TrainingState,
};

use super::net::{image_shape, Net, NetSpec};
use super::optimizer::RunOptimizer;
use super::wrapped::{build_options, Wrapped};
use super::LiveComm;
use crate::options::{DataSource, TrainOptions};

/// The classifier's model, optimizer and eval data.
pub struct Classifier<'a> {
    cfg: &'a TrainOptions,
    device: Device,
    model: Wrapped<Net>,
    /// Under `--fsdp`, each rank's BatchNorm statistics (FSDP2 leaves buffers per rank).
    buffers: Option<RankBuffers>,
    opt: RunOptimizer,
    train: Arc<TrainData>,
    eval: Arc<TrainData>,
    options: LoaderOptions,
    last_eval: EvalMetrics,
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
        let rank = group.rank();
        let device = cfg.model.device.device(group.local_rank())?;
        let DataSource::Dataset(dataset) = &cfg.data.source else {
            tandem_train::bail_option!(
                "data",
                Some(cfg.data.source.to_string()),
                "not a classifier's dataset"
            );
        };
        let (train, eval) = dataset.load().option("data", Some(cfg.data.source.to_string()))?;
        let spec = NetSpec {
            kind: cfg.model.kind,
            hidden: cfg.model.hidden,
            width: cfg.model.width,
            seed: cfg.run.seed,
            compute_dtype: cfg.model.precision.compute_dtype(),
        };
        let net = Net::build(&spec, train.input_dim(), train.num_classes(), &device)?;
        // Ddp, SyncBatchNorm and ZeRO collect over these.
        let comm: Arc<dyn Collectives> = match &live {
            Some(l) => Arc::clone(&l.comm),
            None => Arc::new(group.clone()),
        };
        if cfg.model.sync_batchnorm {
            // The ResNet is a VarMap model: Ddp reduces its buckets after backward, so the
            // SyncBatchNorm collectives cannot interleave with them and may share the group.
            net.convert_sync_batchnorm(Arc::clone(&comm))?;
        }
        let (train, eval) = image_transforms(cfg, train, eval)?;
        if let Some(path) = &cfg.checkpoint.init_from {
            let report = load_weights(&net, path)?;
            if rank == 0 {
                super::note(reporter, format!("init-from {}:\n{report}", path.display()))?;
            }
        }
        // The ResNet (a VarMap model of fused layers, each parameter read once) reduces its
        // buckets while backward runs, unless SyncBatchNorm's collectives run in backward too.
        let early = matches!(net, Net::ResNet18(_))
            && !cfg.model.sync_batchnorm
            && super::overlap_allowed();
        let base = DdpOptions { reduce_during_backward: early, ..DdpOptions::default() };
        let buffers = cfg
            .model
            .fsdp
            .is_some()
            .then(|| RankBuffers::new(super::face::BUFFERS_SHARD, net.named_buffers(), rank))
            .map(|b| match &live {
                Some(l) => b.live(!l.replacement), // (no replicated model carries them)
                None => b,
            });
        // (A live replacement's placeholder world is not the job's: it says nothing of it.)
        let replacement = live.as_ref().is_some_and(|l| l.replacement);
        let model = match (&cfg.model.fsdp, live) {
            // (The classifiers have no blocks: the whole model is the root unit.)
            (Some(fsdp), live) => {
                let fsdp = build_options(fsdp, live.as_ref());
                Wrapped::sharded(net, group, &fsdp, None, None)?
                    .live(live.as_ref(), cfg.comm.mirror_every)
            }
            (None, Some(l)) => {
                // A replacement's parameters come with the state when it joins.
                let opts = DdpOptions { sync_on_init: !l.replacement, ..base };
                Wrapped::Ddp(
                    Ddp::with_comm(net, l.comm, opts).context("wrapping the model in Ddp")?,
                )
            }
            (None, None) => {
                Wrapped::Ddp(Ddp::new(net, group, base).context("wrapping the model in Ddp")?)
            }
        };
        if let Wrapped::Ddp(ddp) = &model {
            super::register_comm_hook(ddp, cfg)?;
        }
        if let (Some(text), 0, false) = (model.describe(), rank, replacement) {
            super::note(reporter, text)?;
        }
        let mut opt = super::optimizer::for_model(&cfg.optim, model.params(), comm)?;
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
            .build(opt.as_mut(), cfg.optim.lr, RunLength { steps_per_epoch, total_steps })
            .option("lr_scheduler", None)?;
        let stepper = model.step(super::step_for(cfg, 2000, sched)?);
        let recipe = Classifier {
            cfg,
            device,
            model,
            buffers,
            opt,
            train,
            eval: Arc::new(eval),
            options,
            last_eval: EvalMetrics::default(),
            reporter: reporter.clone(),
        };
        Ok((recipe, loader, stepper))
    }
}

impl Recipe for Classifier<'_> {
    type Data = TrainData;

    fn train_step(&mut self, batch: &Batch, step: &mut Step, n: u64) -> Result<StepReport> {
        let clock = std::time::Instant::now();
        let loss = self.model.forward(|net| net.loss(&batch.x, &batch.y))?;
        fault::hit(fault::Phase::Forward);
        tandem_train::phase_end(batch.x.device())?;
        let forward_secs = clock.elapsed().as_secs_f64();
        let (model, params) = (&self.model, self.model.params());
        let backward = |loss: &candle_core::Tensor| -> Result<_> {
            let grads = model.backward(loss, &[])?;
            fault::hit(fault::Phase::Optimizer);
            Ok(grads)
        };
        let out = step.run(&loss, backward, self.opt.as_mut(), &params, n)?;
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
            phases: Vec::new(),
            backward_secs: out.backward_secs,
            optimizer_secs: out.optimizer_secs,
        })
    }

    fn optimizer(&mut self) -> &mut dyn TorchOptimizer {
        self.opt.as_mut()
    }

    fn start_epoch(&mut self, epoch: u64) {
        self.train.set_epoch(epoch);
    }

    fn set_training(&mut self, training: bool) -> Result<()> {
        self.model.module().set_training(training);
        Ok(())
    }

    fn evaluate(&mut self, group: &ProcessGroup) -> Result<Option<Evaluation>> {
        let (eval, options, device) = (&self.eval, &self.options, &self.device);
        self.last_eval = self.model.summon(|net| {
            let forward = |x: &candle_core::Tensor| net.forward(x);
            evaluate_logits(forward, eval, group, options, device)
        })??;
        Ok(Some(Evaluation {
            loss: self.last_eval.mean_loss(),
            accuracy: self.last_eval.accuracy(),
        }))
    }

    /// The model and optimizer; the run's settings and seed go into each checkpoint.
    fn state(&mut self) -> Option<TrainingState<'_>> {
        let mut state = self.model.state(&mut self.opt);
        if let Some(buffers) = &mut self.buffers {
            state = state.part(buffers);
        }
        Some(state.config(self.cfg.run.record.clone()).seed(self.cfg.run.seed))
    }

    /// `--save-final` and `--export-onnx` (rank 0 writes, every rank meets).
    fn finish(&mut self, group: &ProcessGroup) -> Result<()> {
        let (cfg, reporter) = (self.cfg, &self.reporter);
        super::finish_run(cfg, group, reporter, &self.model)
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
                cfg.data.source,
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
