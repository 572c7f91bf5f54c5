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

use candle_core::{DType, Device, Var};
use tandem_ckpt::Value;
use tandem_comm::{Collectives, ProcessGroup};
use tandem_data::datasets::faces::FaceRecDataset;
use tandem_data::{Batch, DataLoader, Dataset, LoaderOptions};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::IResNet;
use tandem_nn::{NamedVars, OrderedVarMap, ParamModule};
use tandem_optim::{AdamWConfig, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};
use tandem_partial_fc::{ClassSplit, CombinedMarginLoss, PartialFc, PartialFcConfig};

use super::net::Autocast;
use crate::error::{bail, Context, Result};
use crate::face::{self as face_state, FaceCheckpoints, FaceState};
use crate::metrics::VerificationMetrics;
use crate::options::{OptimizerKind, Precision, TrainOptions};
use crate::schedule::RunLength;
use crate::trainer::{
    Recipe, ResumeContext, Resumed, SaveContext, StepReport, Trainer, TrainerOptions,
};
use crate::verification::{self as verify, ValSet};
use crate::{RunSummary, Step};

/// arcface_torch's DDP settings for the backbone.
const BUCKET_CAP_MB: f64 = 16.0;
/// arcface_torch's GradScaler growth interval.
const GROWTH_INTERVAL: i64 = 100;

/// Trains the face recipe on this rank of `group`.
pub(super) fn run(cfg: &TrainOptions, group: ProcessGroup) -> Result<RunSummary> {
    let (recipe, loader, step) = Face::build(cfg, &group)?;
    let opts = TrainerOptions::from_train_options(cfg);
    let mut trainer = Trainer::new(recipe, loader, step, group, opts)?;
    if cfg.run.resume {
        trainer.resume()?;
    }
    trainer.fit()
}

/// The backbone under Ddp, the PartialFC head, the optimizer over both, the verification sets
/// and the per-rank checkpoints.
pub struct Face<'a> {
    cfg: &'a TrainOptions,
    device: Device,
    model: IResNet,
    /// The backbone's state-dict names in creation order (torch's `state_dict()` order).
    order: Vec<String>,
    ddp: Ddp<NamedVars>,
    head: PartialFc,
    opt: Box<dyn TorchOptimizer + Send>,
    autocast: Autocast,
    train: Arc<FaceRecDataset>,
    val: Vec<ValSet>,
    ckpt: FaceCheckpoints,
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

impl<'a> Face<'a> {
    /// The recipe on this rank of `group`, its loader and its step.
    pub fn build(
        cfg: &'a TrainOptions,
        group: &ProcessGroup,
    ) -> Result<(Self, DataLoader<FaceRecDataset>, Step)> {
        let run_dir = cfg.run.dir.as_path();
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
        let ddp = Ddp::new(named, group, opts).context("wrapping the backbone in Ddp")?;
        super::register_comm_hook(&ddp, cfg)?;

        let head = build_head(cfg, classes, group, &device, init.and_then(|i| i.centres))?;
        let mut opt = build_optimizer(cfg, ddp.params(), head.weight().clone())?;

        // PartialFC needs the same batch on every rank: the last partial batch is dropped.
        let options = LoaderOptions {
            batch_size: cfg.data.batch_size,
            drop_last: true,
            num_workers: 2,
            prefetch_factor: 2,
        };
        let train = Arc::new(train);
        let loader = super::training_loader(cfg, &train, group, options, &device)?;
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
        let autocast =
            (cfg.model.precision != Precision::F32).then(|| cfg.model.precision.compute_dtype());
        let recipe = Face {
            cfg,
            device,
            model,
            order,
            ddp,
            head,
            opt,
            autocast: Autocast(autocast),
            train,
            val,
            ckpt: FaceCheckpoints::new(run_dir.join("checkpoints"), cfg.checkpoint.keep_last)
                .background(cfg.checkpoint.background),
        };
        Ok((recipe, loader, stepper))
    }
}

impl Recipe for Face<'_> {
    type Data = FaceRecDataset;

    /// embeddings = backbone(images); loss = head(embeddings, labels); then the step (the
    /// head's gradients come back from Ddp untouched, the backbone's averaged and clipped).
    fn train_step(&mut self, batch: &Batch, step: &mut Step, n: u64) -> Result<StepReport> {
        let labels: Vec<i64> = batch.y.to_vec1::<u32>()?.into_iter().map(i64::from).collect();
        let clock = Instant::now();
        let embeddings = self.autocast.round(&self.model.forward_t(&batch.x, true)?)?;
        let forward_secs = clock.elapsed().as_secs_f64();
        let loss = self.head.forward(&embeddings, &labels)?;
        let value = loss.to_scalar::<f32>()? as f64;
        let head_secs = clock.elapsed().as_secs_f64() - forward_secs;
        let local = [self.head.weight().clone()];
        let (ddp, backbone) = (&self.ddp, self.ddp.params());
        let backward = |l: &candle_core::Tensor| ddp.backward_with_local(l, &local);
        let out = step.run(&loss, backward, self.opt.as_mut(), &backbone, n)?;
        Ok(StepReport {
            loss: value,
            samples: batch.len(),
            forward_secs,
            head_secs,
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

    /// The verification sets on rank 0's model, the images shared over the ranks.
    fn validate(&mut self, group: &ProcessGroup, _step: u64) -> Result<Vec<VerificationMetrics>> {
        if self.val.is_empty() {
            return Ok(Vec::new());
        }
        let buffers = self.ddp.module().named_buffers();
        verify::evaluate(&self.model, &buffers, &self.val, &self.device, group).context("--val")
    }

    fn save(&mut self, ctx: SaveContext<'_>) -> Result<Option<PathBuf>> {
        let state = FaceState::new(&self.ddp, &mut self.head, self.opt.as_mut(), ctx.step)
            .order(&self.order)
            .global_step(ctx.global_step)
            .config(self.cfg.run.record.clone())
            .seed(self.cfg.run.seed);
        Ok(Some(face_state::save(&mut self.ckpt, &state, ctx.position, ctx.group)?))
    }

    fn settle(&mut self, group: &ProcessGroup) -> Result<()> {
        Ok(self.ckpt.settle(group)?)
    }

    /// The newest complete checkpoint, on this world size or another (the head's centres and
    /// their optimizer state re-split over this run's ranks).
    fn resume(&mut self, ctx: ResumeContext<'_>) -> Result<Option<Resumed>> {
        let ResumeContext { group, loader, step, epochs } = ctx;
        let mut state = FaceState::new(&self.ddp, &mut self.head, self.opt.as_mut(), step);
        let Some(r) = face_state::resume(&self.ckpt, &mut state, loader, epochs, group)? else {
            if group.rank() == 0 {
                let dir = self.ckpt.dir().display();
                eprintln!("--resume: no checkpoint in {dir}, starting fresh");
            }
            return Ok(None);
        };
        let world = group.size();
        let note = (r.world_size != world).then(|| {
            format!(
                "the checkpoint was written by {} ranks, this run has {world}: the {} class centres and their optimizer state are re-split ({} per rank here)",
                r.world_size, r.num_classes, r.rows
            )
        });
        Ok(Some(Resumed { path: r.dir, global_step: r.step, note }))
    }

    /// `--save-final` and `--export-onnx` (rank 0 writes, every rank meets).
    fn finish(&mut self, group: &ProcessGroup) -> Result<()> {
        let cfg = self.cfg;
        if let Some(path) = &cfg.checkpoint.save_final {
            if group.rank() == 0 {
                tandem_nn::weights::save_weights(&*self.ddp.module(), path)
                    .with_context(|| format!("--save-final {}", path.display()))?;
            }
            group.barrier()?;
        }
        if let Some(path) = &cfg.checkpoint.export_onnx {
            if group.rank() == 0 {
                let value = self.ddp.module().state_dict()?;
                let summary = tandem_onnx::export_to_file(cfg.model.kind, &value, path)
                    .context("--export-onnx")?;
                eprintln!("{summary}");
            }
            group.barrier()?;
        }
        Ok(())
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
