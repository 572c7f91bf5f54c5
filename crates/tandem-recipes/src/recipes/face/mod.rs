//! The face-recognition recipe (insightface's arcface_torch `train_v2.py`) as one rank of
//! `tandem train --model iresnet18 .. iresnet200 | mbf | mbf_large --data rec:DIR`: a face backbone under Ddp
//! (`broadcast_buffers=False`, 16 MB buckets) or sharded (`--fsdp`: a unit per ViT or IResNet
//! block), a PartialFC head whose class centres are split over the ranks, fed by the
//! all-gathered embeddings, with CombinedMarginLoss; one optimizer
//! over two parameter groups (backbone, head); clipping of the backbone's gradients; a
//! per-iteration schedule; f16 with a GradScaler; verification on `.bin` pair sets every
//! `--verbose` steps and at the end; per-rank checkpoints that resume on any world size.
//!
//! One step, in arcface_torch's order: embeddings = backbone(images); loss = head(embeddings,
//! labels); backward (scaled under f16); unscale; clip the backbone's gradient norm; optimizer
//! step (skipped on inf/NaN under f16); scaler update; scheduler step.

//!
//! The recipe's one home: its training state ([`HeadPart`], the per-rank buffers: `head.rs`),
//! the head's live rows (`live_head.rs`), arcface_torch's config files (`config`) and
//! checkpoint layout (`arcface`), loading a backbone's weights (`weights.rs`) and its own
//! earlier checkpoint format (`old_checkpoints.rs`). Its evaluation is `face_eval`.
pub mod arcface;
pub mod config;
mod head;
mod live_head;
mod old_checkpoints;
mod weights;
pub use head::{head_shape, overlay, HeadPart, BUFFERS_SHARD, HEAD_ROWS, HEAD_SHARD};
pub use live_head::RowBlock;
pub use old_checkpoints::{register_checkpoint_formats, FACE_FORMAT};
pub use weights::load_backbone;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use tandem_ckpt::Value;
use tandem_comm::{Collectives, ProcessGroup};
use tandem_data::datasets::faces::{keyed_hash, FaceRecDataset};
use tandem_data::{Batch, DataLoader, Dataset, LoaderOptions};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_fsdp::{InitialValues, MetaVarMap};
use tandem_models::{FaceBackbone, SeededInit};
use tandem_nn::{Autocast, NamedVars, OrderedVarMap, ParamModule};
use tandem_optim::TorchOptimizer;
use tandem_partial_fc::{ClassSplit, CombinedMarginLoss, PartialFc, PartialFcConfig};
use tandem_train::events::Reporter;
use tandem_train::live::Mirrored;
use tandem_train::metrics::ValidationMetrics;
use tandem_train::{
    bail_option, fault, Context, RankBuffers, Recipe, Result, RunLength, Step, StepReport,
    TrainingState,
};

use super::optimizer::RunOptimizer;
use super::wrapped::{build_options, Wrapped};
use super::LiveComm;
use crate::face_eval::verification::{self as verify, ValSets};
use crate::options::{DataSource, FsdpRunOptions, Precision, TrainOptions};

/// arcface_torch's DDP settings for the backbone.
const BUCKET_CAP_MB: f64 = 16.0;
/// arcface_torch's GradScaler growth interval.
const GROWTH_INTERVAL: i64 = 100;

/// The backbone under Ddp or Fsdp, the PartialFC head, the optimizer over both, the
/// verification sets and the per-rank checkpoints.
pub(crate) struct Face<'a> {
    cfg: &'a TrainOptions,
    device: Device,
    model: FaceBackbone,
    /// The backbone's state-dict names in creation order (torch's `state_dict()` order).
    order: Vec<String>,
    backbone: Wrapped<NamedVars>,
    rank: usize,
    /// The PartialFC head, as state its ranks hold alone.
    head: HeadPart,
    /// Each rank's BatchNorm statistics (`broadcast_buffers=False`).
    buffers: RankBuffers,
    opt: RunOptimizer,
    autocast: Autocast,
    train: Arc<FaceRecDataset>,
    val: ValSets,
    /// The head's gradient summed over the batches of the open gradient-accumulation window
    /// (dense: each batch may sample other rows); the backbone's is kept by Ddp's `no_sync`.
    pending_head_grad: Option<candle_core::Tensor>,
    reporter: Reporter,
}

/// `{"backbone": state_dict, "partial_fc": {"weight": [C, E]}}` from `--init-from` (a bare
/// backbone state dict, such as arcface_torch's `model.pt`, initialises the backbone only).
struct InitFrom {
    backbone: Value,
    centres: Option<candle_core::Tensor>,
}

fn read_init(path: &Path) -> Result<InitFrom> {
    let v = tandem_ckpt::load(path).option("init_from", Some(path.display().to_string()))?;
    let Some(backbone) = v.get("backbone") else {
        return Ok(InitFrom { backbone: v, centres: None });
    };
    let centres = match v.get("partial_fc") {
        None => None,
        Some(pfc) => {
            let Some(w) = pfc.get("weight").and_then(Value::as_tensor) else {
                let path = path.display().to_string();
                bail_option!("init_from", Some(path), "`partial_fc` has no `weight` tensor");
            };
            Some(tandem_nn::convert::from_ckpt(w, &Device::Cpu)?)
        }
    };
    Ok(InitFrom { backbone: backbone.clone(), centres })
}

impl<'a> Face<'a> {
    /// The recipe on this rank of `group`, its loader and its step.
    pub(crate) fn build(
        cfg: &'a TrainOptions,
        group: &ProcessGroup,
        reporter: &Reporter,
    ) -> Result<(Self, DataLoader<FaceRecDataset>, Step)> {
        Self::build_with(cfg, group, None, reporter)
    }

    /// [`Face::build`] in a live world: Ddp and the head on `live`'s collectives.
    pub(crate) fn build_with(
        cfg: &'a TrainOptions,
        group: &ProcessGroup,
        live: Option<LiveComm>,
        reporter: &Reporter,
    ) -> Result<(Self, DataLoader<FaceRecDataset>, Step)> {
        let rank = group.rank();
        let device = cfg.model.device.device(group.local_rank())?;
        let source = &cfg.data.source;
        let (mut train, skipped) = match source {
            DataSource::Folder(dir) => FaceRecDataset::open_folder(dir),
            DataSource::Rec(dir) => FaceRecDataset::open(dir).map(|d| (d, Vec::new())),
            DataSource::Dataset(_) => {
                bail_option!("data", Some(source.to_string()), "not a face identity set")
            }
        }
        .option("data", Some(source.to_string()))?;
        if let (Some((first, why)), 0) = (skipped.first(), rank) {
            let text = format!(
                "{source}: {} image(s) left out, as `tandem data pack` leaves them out (first: \
                 {}: {why}); training on the other {}",
                skipped.len(),
                first.display(),
                train.len()
            );
            super::note(reporter, text)?;
        }
        if cfg.data.augment {
            train = train.with_flip(cfg.run.seed);
        }
        let classes = cfg.face.num_classes.unwrap_or(train.num_classes());
        let kind = cfg.model.kind;
        // Sharded, the backbone is built without values and each rank keeps only its rows of
        // the seeded init, drawn one parameter at a time, or of --init-from's weights, read row
        // by row (a safetensors file by position, a `.pt` through tandem-ckpt's mapping of
        // it): no rank holds the model.
        let on_meta = cfg.model.fsdp.is_some() && device.is_cpu();
        let init_path = cfg.checkpoint.init_from.as_deref();
        let by_position = |p: &&Path| on_meta && p.extension().is_some_and(|e| e == "safetensors");
        let init = init_path.filter(|p| !by_position(p)).map(read_init).transpose()?;
        let rows_from = init_path.filter(|_| on_meta);
        let meta = on_meta.then(|| MetaVarMap::new(cfg.run.seed));
        let vars = OrderedVarMap::new();
        let vb = match &meta {
            Some(meta) => meta.var_builder(),
            None => vars.var_builder(DType::F32, &device),
        };
        let mut model = FaceBackbone::new(kind, cfg.model.width, cfg.face.embedding_size, 0.0, vb)?;
        let all = match &meta {
            Some(meta) => meta.named(),
            None => vars.named(),
        };
        if meta.is_none() {
            FaceBackbone::reset_parameters(kind, &all, cfg.run.seed)?;
        }
        let shapes: Vec<(&str, &[usize])> =
            all.iter().map(|(n, v)| (n.as_str(), v.dims())).collect();
        let mut seeded = SeededInit::new(kind, &shapes, cfg.run.seed);
        let mut initial_values = |name: &str, dims: &[usize]| seeded.values(name, dims);
        let order: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
        let named = NamedVars::new(all.clone()).freeze(FaceBackbone::frozen(kind))?;
        if let (Some(init), Some(path), false) = (&init, &cfg.checkpoint.init_from, on_meta) {
            let report = named
                .load_state_dict(&init.backbone)
                .context("the backbone")
                .option("init_from", Some(path.display().to_string()))?;
            if rank == 0 {
                super::note(reporter, format!("init-from {}:\n{report}", path.display()))?;
            }
        }
        let opts = DdpOptions {
            bucket_cap_mb: BUCKET_CAP_MB,
            broadcast_buffers: false,
            // IResNet reads each parameter once per forward through tandem-nn's fused layers:
            // its buckets can go to the all-reduce while backward runs.
            reduce_during_backward: super::overlap_allowed(),
            ..DdpOptions::default()
        };
        let head_comm: Arc<dyn Collectives> = match &live {
            Some(l) => Arc::clone(&l.comm),
            None => Arc::new(group.clone()),
        };
        let wrapping = "wrapping the backbone in Ddp";
        let backbone = match (&cfg.model.fsdp, &live) {
            (Some(fsdp), _) => {
                let unit_of = Box::new(move |p: &str| FaceBackbone::unit_of(kind, p));
                let mut give = |runner| {
                    model.run_blocks_with(runner);
                };
                // Unless told, a unit recomputes in backward where the model's blocks would.
                let checkpointed = kind.vit().is_some_and(|v| v.using_checkpoint);
                let fsdp = &FsdpRunOptions {
                    activation_checkpointing: fsdp.activation_checkpointing.or(Some(checkpointed)),
                    ..build_options(fsdp, live.as_ref())
                };
                // (Weights read from a file replace the map's own draw of each rank's rows.)
                let mut no_values = |_: &str, _: &[usize]| None;
                let values: &mut InitialValues = match rows_from {
                    Some(_) => &mut no_values,
                    None => &mut initial_values,
                };
                let drawn = meta.as_ref().map(|m| (m, &mut *values));
                let wrapped =
                    Wrapped::sharded(named, group, fsdp, Some((unit_of, &mut give)), drawn)?;
                // The frozen parameters (kept whole with the buffers) after the trained ones,
                // as the seeded stream is asked.
                if let Some(meta) = &meta {
                    meta.materialize_with(FaceBackbone::frozen(kind), values)?;
                }
                if let Some(path) = rows_from {
                    let n = wrapped.load_rows(path, init.as_ref().map(|i| &i.backbone))?;
                    if rank == 0 {
                        let text = format!(
                            "init-from {}: {n} tensors, each rank reading its rows",
                            path.display()
                        );
                        super::note(reporter, text)?;
                    }
                }
                wrapped.keep_order(&order).live(live.as_ref(), cfg.comm.mirror_every)
            }
            (None, Some(l)) => {
                let opts = DdpOptions { sync_on_init: !l.replacement, ..opts };
                Wrapped::Ddp(Ddp::with_comm(named, Arc::clone(&l.comm), opts).context(wrapping)?)
            }
            (None, None) => Wrapped::Ddp(Ddp::new(named, group, opts).context(wrapping)?),
        };
        if let Wrapped::Ddp(ddp) = &backbone {
            super::register_comm_hook(ddp, cfg)?;
        }

        let replacement = live.as_ref().is_some_and(|l| l.replacement);
        let centres = match replacement {
            // Its rows come from the running ranks when it joins.
            true => Centres::Received,
            false => init.and_then(|i| i.centres).map_or(Centres::Initial, Centres::From),
        };
        let head = build_head(cfg, classes, head_comm, &device, centres)?;
        // One optimizer over two parameter groups, backbone then head, as arcface_torch.
        let groups = vec![backbone.params(), vec![head.weight().clone()]];
        let mut opt = super::optimizer::build(&cfg.optim, groups)?;

        // PartialFC needs the same batch on every rank: the last partial batch is dropped.
        let options = LoaderOptions {
            batch_size: cfg.data.batch_size,
            drop_last: true,
            num_workers: cfg.data.num_workers.unwrap_or(2),
            prefetch_factor: 2,
        };
        let train = Arc::new(train);
        let loader = super::training_loader(cfg, &train, group, options, &device)?;
        if loader.is_empty() {
            bail_option!(
                "data",
                Some(cfg.data.source.to_string()),
                "{} images give rank {rank} fewer than one batch of {} (over {} ranks)",
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
            .option("lr_scheduler", None)?;
        let stepper = backbone.step(super::step_for(cfg, GROWTH_INTERVAL, sched)?);
        let val = ValSets::load(&cfg.face.val, replacement).option("val", None)?;
        // (A live replacement's placeholder world is not the job's: it says nothing.)
        if rank == 0 && !replacement {
            let text = format!(
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
            super::note(reporter, text)?;
            if let Some(text) = backbone.describe() {
                super::note(reporter, text)?;
            }
        }
        let autocast =
            (cfg.model.precision != Precision::F32).then(|| cfg.model.precision.compute_dtype());
        // A replacement holds no rows until it joins.
        let mut buffers = RankBuffers::new(BUFFERS_SHARD, backbone.module().named_buffers(), rank);
        if let (Wrapped::Fsdp { .. }, Some(l)) = (&backbone, &live) {
            buffers = buffers.live(!l.replacement); // (no replicated model carries them)
        }
        let mirror = live.map(|l| {
            // (Its mirror after a regroup is the re-split's rows as they are.)
            Mirrored::new(cfg.comm.mirror_every, !l.replacement).keeping_what_it_sends()
        });
        let mut head = HeadPart::new(head, backbone.params().len(), group.size(), mirror);
        head.gradient_acc = cfg.face.gradient_acc;
        let recipe = Face {
            cfg,
            device,
            model,
            order,
            backbone,
            rank,
            head,
            buffers,
            opt,
            autocast: Autocast(autocast),
            train,
            val,
            pending_head_grad: None,
            reporter: reporter.clone(),
        };
        Ok((recipe, loader, stepper))
    }
}

impl Recipe for Face<'_> {
    type Data = FaceRecDataset;

    /// embeddings = backbone(images); loss = head(embeddings, labels); then the step (the
    /// head's gradients come back from Ddp untouched, the backbone's averaged and clipped).
    fn train_step(&mut self, batch: &Batch, step: &mut Step, n: u64) -> Result<StepReport> {
        let labels: Vec<i64> = batch.labels.iter().map(|&l| i64::from(l)).collect();
        let clock = Instant::now();
        let model = &self.model;
        // What the forward draws (a ViT's masks and stochastic depth) is keyed by seed, rank
        // and step: a resumed or regrouped run draws what an uninterrupted one would.
        let seed = keyed_hash(self.cfg.run.seed, self.rank as u64, n);
        model.seed(seed);
        let autocast = &self.autocast;
        let embeddings = self
            .backbone
            .forward(|_| autocast.apply(&batch.x, false, |x| model.forward_t(x, true)))?;
        fault::hit(fault::Phase::Forward);
        tandem_train::phase_end(&self.device)?;
        let forward_secs = clock.elapsed().as_secs_f64();
        let loss = self.head.head.forward(&embeddings, &labels).context("the PartialFC head")?;
        tandem_train::phase_end(&self.device)?;
        // On a GPU the loss stays there: the trainer reads it a few steps later.
        let (value, pending_loss) = if loss.device().is_cpu() {
            (loss.to_scalar::<f32>()? as f64, None)
        } else {
            (f64::NAN, Some(loss.detach()))
        };
        let head_secs = clock.elapsed().as_secs_f64() - forward_secs;
        let (leaf, weight) = (self.head.head.grad_leaf(), self.head.head.weight().clone());
        let rows = self.head.head.grad_rows();
        // arcface_torch's gradient_acc: every batch's gradients are summed, the optimizer steps
        // on the window's last batch (global steps that are multiples of it).
        let window_ends = n.is_multiple_of(self.cfg.face.gradient_acc.max(1));
        let (wrapped, backbone) = (&self.backbone, self.backbone.params());
        let backward = |l: &candle_core::Tensor| -> Result<_> {
            let mut grads = wrapped.backward(l, std::slice::from_ref(&leaf))?;
            if leaf.as_tensor().id() != weight.as_tensor().id() {
                // Filed under the weight, the parameter the optimizer steps.
                if let Some(g) = grads.remove(leaf.as_tensor()) {
                    grads.insert(weight.as_tensor(), g);
                }
            }
            fault::hit(fault::Phase::Optimizer);
            Ok(grads)
        };
        let out = if window_ends {
            let pending = self.pending_head_grad.take();
            // The head's gradient will hold the sampled rows only (a window's sum is dense:
            // this batch's rows go into it).
            if let (Some(rows), None) = (&rows, &pending) {
                self.opt.set_grad_rows(backbone.len(), rows.clone())?;
            }
            let backward = |l: &candle_core::Tensor| -> Result<_> {
                let mut grads = backward(l)?;
                if let Some(sum) = pending {
                    let g = match grads.remove(weight.as_tensor()) {
                        Some(g) => (sum + dense_rows(&weight, rows.as_deref(), &g)?)?,
                        None => sum,
                    };
                    grads.insert(weight.as_tensor(), g);
                }
                Ok(grads)
            };
            let out = step.run(&loss, backward, self.opt.as_mut(), &backbone, n)?;
            self.head.stepped(n);
            self.head.window_open = false;
            out
        } else {
            let (mut grads, out) =
                step.accumulate(&loss, |l| wrapped.no_sync(|| backward(l)), self.opt.as_mut(), n)?;
            if let Some(g) = grads.remove(weight.as_tensor()) {
                let g = dense_rows(&weight, rows.as_deref(), &g)?;
                self.pending_head_grad = Some(match self.pending_head_grad.take() {
                    Some(sum) => (sum + g)?,
                    None => g,
                });
            }
            self.head.window_open = true;
            out
        };
        Ok(StepReport {
            loss: value,
            pending_loss,
            samples: batch.len(),
            forward_secs,
            phases: vec![("head", head_secs)],
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
    fn validate(&mut self, group: &ProcessGroup, _step: u64) -> Result<Vec<ValidationMetrics>> {
        let val = self.val.get().option("val", None)?;
        if val.is_empty() {
            return Ok(Vec::new());
        }
        let buffers = self.backbone.module().named_buffers();
        let (model, backbone) = (&self.model, &self.backbone);
        // Sharded, one unit gathered at a time (a rank never holds the model).
        let embed = |x: &Tensor| backbone.forward_no_grad(|| model.forward_t(x, false));
        verify::evaluate_with(&embed, &buffers, val, &self.device, group).option("val", None)
    }

    /// The backbone and the optimizer (the backbone's entries replicated, in torch's order),
    /// the head's rows and each rank's statistics as parts; the run's settings and seed go
    /// into each checkpoint.
    fn state(&mut self) -> Option<TrainingState<'_>> {
        let state = self
            .backbone
            .state(&mut self.opt)
            .order(&self.order)
            .config(self.cfg.run.record.clone())
            .seed(self.cfg.run.seed);
        Some(state.part(&mut self.head).part(&mut self.buffers))
    }

    /// `--save-final` and `--export-onnx` (rank 0 writes, every rank meets).
    fn finish(&mut self, group: &ProcessGroup) -> Result<()> {
        let (cfg, reporter) = (self.cfg, &self.reporter);
        super::finish_run(cfg, group, reporter, &self.backbone)
    }
}

/// The head's gradient `g` as the whole weight's: `g` itself, or for a sampled step (`rows`)
/// its rows added into zeros.
fn dense_rows(
    weight: &Var,
    rows: Option<&[u32]>,
    g: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    match rows {
        None => Ok(g.clone()),
        Some(rows) => tandem_optim::densify(weight, rows, g),
    }
}

/// Where the head's first rows come from.
enum Centres {
    /// N(0, 0.01) from the seed.
    Initial,
    /// `--init-from`'s whole matrix (this rank takes its rows).
    From(candle_core::Tensor),
    /// The running ranks, when a live replacement joins: zeros until then.
    Received,
}

/// The head, its rows as `centres` says.
fn build_head(
    cfg: &TrainOptions,
    classes: usize,
    comm: Arc<dyn Collectives>,
    device: &Device,
    centres: Centres,
) -> Result<PartialFc> {
    let (m1, m2, m3) = cfg.face.margin.parts();
    let margin = CombinedMarginLoss::new(
        cfg.face.margin_scale,
        m1,
        m2,
        m3,
        cfg.face.interclass_filtering_threshold,
    )
    .option("margin", Some(format!("{m1},{m2},{m3}")))?;
    let mut pcfg = PartialFcConfig::new(classes, cfg.face.embedding_size, margin);
    pcfg.sample_rate = cfg.face.sample_rate;
    pcfg.seed = cfg.run.seed;
    // The sampled rows' gradient alone; the optimizer steps the head from it (no dense
    // [rows, E] gradient: `TorchOptimizer::set_grad_rows`).
    pcfg.sparse_grad = true;
    if cfg.model.precision != Precision::F32 {
        pcfg.autocast = Some(cfg.model.precision.compute_dtype());
    }
    let building = "building the PartialFC head";
    let head = match centres {
        Centres::From(full) => PartialFc::from_full_weight(pcfg, comm, &full.to_device(device)?)
            .context("`partial_fc.weight`")
            .option("init_from", None)?,
        Centres::Initial => PartialFc::new(pcfg, comm, device).context(building)?,
        Centres::Received => PartialFc::zeroed(pcfg, comm, device).context(building)?,
    };
    Ok(head)
}
