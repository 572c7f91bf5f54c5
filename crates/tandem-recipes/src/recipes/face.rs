//! The face-recognition recipe (insightface's arcface_torch `train_v2.py`) as one rank of
//! `tandem train --model iresnet18 .. iresnet200 | mbf | mbf_large --data rec:DIR`: a face backbone under Ddp
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
use tandem_ckpt::{TensorData, Value};
use tandem_comm::{Collectives, ProcessGroup};
use tandem_data::datasets::faces::{keyed_hash, FaceRecDataset};
use tandem_data::{Batch, DataLoader, Dataset, LoaderOptions};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::FaceBackbone;
use tandem_nn::{Autocast, NamedVars, OrderedVarMap, ParamModule};
use tandem_optim::TorchOptimizer;
use tandem_partial_fc::{ClassSplit, CombinedMarginLoss, PartialFc, PartialFcConfig};
use tandem_train::checkpoint::{CheckpointError, Checkpointer};
use tandem_train::events::{Reporter, Resplit};
use tandem_train::live::{Mirrored, RegroupCounts};
use tandem_train::metrics::VerificationMetrics;
use tandem_train::{
    bail_option, fault, Context, CustomState, Recipe, Result, ResumeContext, Resumed, RunLength,
    SaveContext, Step, StepReport, TrainError,
};

use super::optimizer::RunOptimizer;
use super::LiveComm;
use crate::face::optimizer_entry::{merge_optimizer, split_optimizer};
use crate::face::{self as face_state, FaceState, RowBlock, HEAD_SHARD};
use crate::options::{Precision, TrainOptions};
use crate::verification::{self as verify, ValSet};

/// arcface_torch's DDP settings for the backbone.
const BUCKET_CAP_MB: f64 = 16.0;
/// arcface_torch's GradScaler growth interval.
const GROWTH_INTERVAL: i64 = 100;

/// The backbone under Ddp, the PartialFC head, the optimizer over both, the verification sets
/// and the per-rank checkpoints.
pub struct Face<'a> {
    cfg: &'a TrainOptions,
    device: Device,
    model: FaceBackbone,
    /// The backbone's state-dict names in creation order (torch's `state_dict()` order).
    order: Vec<String>,
    ddp: Ddp<NamedVars>,
    head: PartialFc,
    opt: RunOptimizer,
    autocast: Autocast,
    train: Arc<FaceRecDataset>,
    val: Vec<ValSet>,
    ckpt: Checkpointer,
    /// The head's rows under live recovery: mirrored, and re-split after a regroup.
    live: Option<Mirrored<RowBlock>>,
    /// The optimizer state without the head's entry that a live load brought; the head's entry
    /// is put back once the rows are re-split.
    pending_rest: Option<Value>,
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
    pub fn build(
        cfg: &'a TrainOptions,
        group: &ProcessGroup,
        reporter: &Reporter,
    ) -> Result<(Self, DataLoader<FaceRecDataset>, Step)> {
        Self::build_with(cfg, group, None, reporter)
    }

    /// [`Face::build`] in a live world: Ddp and the head on `live`'s collectives.
    pub fn build_with(
        cfg: &'a TrainOptions,
        group: &ProcessGroup,
        live: Option<LiveComm>,
        reporter: &Reporter,
    ) -> Result<(Self, DataLoader<FaceRecDataset>, Step)> {
        let run_dir = cfg.run.dir.as_path();
        let rank = group.rank();
        let device = cfg.model.device.device(group.local_rank())?;
        let spec = cfg.data.spec.as_str();
        let mut train = match spec.strip_prefix("folder:") {
            Some(dir) => FaceRecDataset::open_folder(Path::new(dir)),
            None => FaceRecDataset::open(Path::new(spec.strip_prefix("rec:").unwrap_or(spec))),
        }
        .option("data", Some(spec.to_string()))?;
        if cfg.data.augment {
            train = train.with_flip(cfg.run.seed);
        }
        let classes = cfg.face.num_classes.unwrap_or(train.num_classes());
        let kind = cfg.model.kind;
        let vars = OrderedVarMap::new();
        let model = FaceBackbone::new(
            kind,
            cfg.model.width,
            cfg.face.embedding_size,
            0.0,
            vars.var_builder(DType::F32, &device),
        )?;
        FaceBackbone::reset_parameters(kind, &vars.named(), cfg.run.seed)?;
        let order: Vec<String> = vars.named().into_iter().map(|(n, _)| n).collect();
        let named = vars.named_vars().freeze(FaceBackbone::frozen(kind))?;
        let init = cfg.checkpoint.init_from.as_deref().map(read_init).transpose()?;
        if let (Some(init), Some(path)) = (&init, &cfg.checkpoint.init_from) {
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
        let ddp = match &live {
            Some(l) => {
                let opts = DdpOptions { sync_on_init: !l.replacement, ..opts };
                Ddp::with_comm(named, Arc::clone(&l.comm), opts)
            }
            None => Ddp::new(named, group, opts),
        }
        .context("wrapping the backbone in Ddp")?;
        super::register_comm_hook(&ddp, cfg)?;

        let head = build_head(cfg, classes, head_comm, &device, init.and_then(|i| i.centres))?;
        // One optimizer over two parameter groups, backbone then head, as arcface_torch.
        let mut opt =
            super::optimizer::build(&cfg.optim, vec![ddp.params(), vec![head.weight().clone()]])?;

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
                Some(cfg.data.spec.clone()),
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
        let stepper = super::step_for(cfg, GROWTH_INTERVAL, sched)?;
        let val = verify::load(&cfg.face.val).option("val", None)?;
        // (A live replacement's placeholder world is not the job's: it says nothing.)
        if rank == 0 && !live.as_ref().is_some_and(|l| l.replacement) {
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
            ckpt: Checkpointer::new(run_dir.join("checkpoints"), cfg.checkpoint.keep_last)
                .background(cfg.checkpoint.background),
            // A replacement holds no rows until it joins.
            live: live.map(|l| Mirrored::new(cfg.comm.mirror_every, !l.replacement)),
            pending_rest: None,
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
        let seed = keyed_hash(self.cfg.run.seed, self.ddp.rank() as u64, n);
        model.seed(seed);
        let embeddings = self.autocast.apply(&batch.x, false, |x| model.forward_t(x, true))?;
        fault::hit(fault::Phase::Forward);
        tandem_train::phase_end(&self.device)?;
        let forward_secs = clock.elapsed().as_secs_f64();
        let loss = self.head.forward(&embeddings, &labels).context("the PartialFC head")?;
        tandem_train::phase_end(&self.device)?;
        // On a GPU the loss stays there: the trainer reads it a few steps later.
        let (value, pending_loss) = if loss.device().is_cpu() {
            (loss.to_scalar::<f32>()? as f64, None)
        } else {
            (f64::NAN, Some(loss.detach()))
        };
        let head_secs = clock.elapsed().as_secs_f64() - forward_secs;
        let (leaf, weight) = (self.head.grad_leaf(), self.head.weight().clone());
        let rows = self.head.grad_rows();
        // arcface_torch's gradient_acc: every batch's gradients are summed, the optimizer steps
        // on the window's last batch (global steps that are multiples of it).
        let window_ends = n.is_multiple_of(self.cfg.face.gradient_acc.max(1));
        let (ddp, backbone) = (&self.ddp, self.ddp.params());
        let backward = |l: &candle_core::Tensor| -> Result<_> {
            let mut grads = ddp.backward_with_local(l, std::slice::from_ref(&leaf))?;
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
                self.opt.set_grad_rows(self.ddp.params().len(), rows.clone())?;
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
            if let Some(live) = self.live.as_mut() {
                live.stepped(n);
            }
            out
        } else {
            let (mut grads, out) =
                step.accumulate(&loss, |l| ddp.no_sync(|_| backward(l)), self.opt.as_mut(), n)?;
            if let Some(g) = grads.remove(weight.as_tensor()) {
                let g = dense_rows(&weight, rows.as_deref(), &g)?;
                self.pending_head_grad = Some(match self.pending_head_grad.take() {
                    Some(sum) => (sum + g)?,
                    None => g,
                });
            }
            out
        };
        Ok(StepReport {
            loss: value,
            pending_loss,
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
        verify::evaluate(&self.model, &buffers, &self.val, &self.device, group).option("val", None)
    }

    /// `--save-final` and `--export-onnx` (rank 0 writes, every rank meets).
    fn finish(&mut self, group: &ProcessGroup) -> Result<()> {
        // What the mirror cost this rank (its own bytes; every rank sends one shard).
        let mirror = self.live.as_ref().map(|live| live.cost("head"));
        super::finish_run(self.cfg, group, &self.reporter, mirror, &*self.ddp.module())
    }

    fn custom_state(&mut self) -> Option<&mut dyn CustomState> {
        Some(self)
    }
}

impl CustomState for Face<'_> {
    fn save(&mut self, ctx: SaveContext<'_>) -> Result<Option<PathBuf>> {
        if self.pending_head_grad.is_some() && ctx.group.rank() == 0 {
            // Gradients are not part of the training state (nor of arcface_torch's).
            tracing::warn!(
                "checkpoint at step {} is inside a gradient accumulation window of {}: a run \
                 resumed from it starts the window without this window's earlier batches",
                ctx.global_step,
                self.cfg.face.gradient_acc
            );
        }
        let state = FaceState::new(&self.ddp, &mut self.head, self.opt.as_mut(), ctx.step)
            .order(&self.order)
            .global_step(ctx.global_step)
            .config(self.cfg.run.record.clone())
            .seed(self.cfg.run.seed);
        Ok(Some(face_state::save(&mut self.ckpt, &state, ctx.position, ctx.group)?))
    }

    fn settle(&mut self, group: &ProcessGroup) -> Result<()> {
        self.ckpt.settle(group)?;
        Ok(())
    }

    /// The newest complete checkpoint, on this world size or another (the head's centres and
    /// their optimizer state re-split over this run's ranks).
    fn resume(&mut self, ctx: ResumeContext<'_>) -> Result<Option<Resumed>> {
        let ResumeContext { group, loader, step, epochs } = ctx;
        let mut state = FaceState::new(&self.ddp, &mut self.head, self.opt.as_mut(), step);
        let Some(r) = face_state::resume(&self.ckpt, &mut state, loader, epochs, group)? else {
            if group.rank() == 0 {
                let dir = self.ckpt.dir().display();
                super::note(
                    &self.reporter,
                    format!("no checkpoint in {dir} to resume; starting fresh"),
                )?;
            }
            return Ok(None);
        };
        Ok(Some(r))
    }

    /// Under live recovery, every `--mirror-every` steps: this rank's rows to the next
    /// rank, the previous rank's rows kept here.
    fn after_step(&mut self, group: &ProcessGroup, n: u64) -> Result<()> {
        match &self.live {
            Some(live) if live.due(n) => self.mirror(group, n),
            _ => Ok(()),
        }
    }

    /// The replicated state (the head stays on its ranks: [`CustomState::regroup`] re-splits it).
    fn live_state(&mut self, ctx: SaveContext<'_>) -> Result<Value> {
        let head_index = self.ddp.params().len() as i64;
        let (rest, _) = split_optimizer(self.opt.state_dict()?, head_index);
        let state = FaceState::new(&self.ddp, &mut self.head, self.opt.as_mut(), ctx.step)
            .order(&self.order)
            .global_step(ctx.global_step)
            .config(self.cfg.run.record.clone())
            .seed(self.cfg.run.seed);
        Ok(face_state::replicated_value(&state, rest, ctx.position, ctx.group.size())?)
    }

    fn load_live_state(&mut self, value: &Value, ctx: ResumeContext<'_>) -> Result<u64> {
        let ResumeContext { loader, step, epochs, .. } = ctx;
        let buffers = Value::None;
        let mut state = FaceState::new(&self.ddp, &mut self.head, self.opt.as_mut(), step);
        let step = face_state::restore_replicated(
            &mut state,
            value,
            &buffers,
            loader,
            epochs,
            "the live state",
            false,
        )
        .map_err(|(what, why)| TrainError::invalid(format!("the live state: {what}: {why}")))?;
        let rest = value.get("optimizer").cloned().context("the live state: no optimizer")?;
        if self.live.is_some() {
            self.pending_rest = Some(rest);
        }
        Ok(step)
    }

    /// Re-splits the head over the new world: each class from the newest copy any rank holds
    /// (its owner's, else a mirror), else from the last checkpoint, else the initial centres;
    /// then the optimizer is rebuilt over the new rows and a fresh mirror is taken.
    fn regroup(&mut self, group: &ProcessGroup, global_step: u64) -> Result<Option<Resplit>> {
        let Some(mut live) = self.live.take() else { return Ok(None) };
        let head_index = self.ddp.params().len() as i64;
        let own_entry = self.opt.param_state(head_index as usize)?;
        // (Put back whatever happens: a peer lost during the re-split starts another.)
        let regrouped = self.regroup_rows(&mut live, group, global_step, &own_entry);
        self.live = Some(live);
        let (rows, counts) = regrouped?;
        let e = self.head.config().embedding_size;
        let device = self.head.weight().device().clone();
        let weight = candle_core::Tensor::from_vec(rows.weight.clone(), (rows.len, e), &device)?;
        let var = self.head.regroup(&weight).context("re-splitting the PartialFC head")?;
        self.head.set_steps_taken(global_step);
        // The optimizer over the new rows, with the world's state and the rows' own.
        // The world's optimizer state without the head: the source's, or this rank's own.
        let rest = match self.pending_rest.take() {
            Some(rest) => rest,
            None => split_optimizer(self.opt.state_dict()?, head_index).0,
        };
        let entry = head_entry(&rows, &own_entry, &rest, e);
        let lrs = self.opt.group_lrs();
        self.opt = super::optimizer::build(&self.cfg.optim, vec![self.ddp.params(), vec![var]])?;
        self.opt.load_state_dict(&merge_optimizer(&rest, head_index, entry))?;
        self.opt.set_group_lrs(&lrs)?;
        // The new rows are this rank's own now: mirrored at once, so the next death is covered.
        self.send_mirror(group, &rows, Instant::now())?;
        Ok(Some(Resplit::HeadRows(counts)))
    }
}

impl Face<'_> {
    /// This rank's rows as a block: centres and the optimizer's row tensors (`entry`, the
    /// head's entry of the optimizer state), as of `step`.
    fn own_rows(&self, entry: &Value, step: u64) -> Result<RowBlock> {
        let split = self.head.split();
        let e = self.head.config().embedding_size;
        let weight =
            self.head.weight().as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(RowBlock {
            start: split.start,
            len: split.len,
            step,
            weight,
            state: row_tensors(entry, split.len, e),
        })
    }

    /// Sends this rank's rows to the next rank and keeps the previous rank's (a collective).
    fn mirror(&mut self, group: &ProcessGroup, step: u64) -> Result<()> {
        let clock = Instant::now();
        let entry = self.opt.param_state(self.ddp.params().len())?;
        let own = self.own_rows(&entry, step)?;
        self.send_mirror(group, &own, clock)
    }

    /// [`Face::mirror`] of the block `own` (this rank's rows), timed from `clock`.
    fn send_mirror(&mut self, group: &ProcessGroup, own: &RowBlock, clock: Instant) -> Result<()> {
        let classes = self.head.config().num_classes;
        match self.live.as_mut() {
            Some(live) => Ok(live.exchange(group, own, classes, clock)?),
            None => Ok(()),
        }
    }

    /// This rank's rows of the new world `group`, each class from the newest copy any rank
    /// holds, else from [`Face::reload_rows`] (a collective); `own_entry` is the head's entry of
    /// this rank's optimizer state.
    fn regroup_rows(
        &self,
        live: &mut Mirrored<RowBlock>,
        group: &ProcessGroup,
        global_step: u64,
        own_entry: &Value,
    ) -> Result<(RowBlock, RegroupCounts)> {
        let own = live.holds().map(|step| self.own_rows(own_entry, step)).transpose()?;
        let (classes, world) = (self.head.config().num_classes, group.size());
        let want = |rank: usize| {
            let split = ClassSplit::new(classes, world, rank);
            let rows = split.start..split.start + split.len;
            vec![rows]
        };
        let mut fill = |range: std::ops::Range<usize>| {
            let rows = self.reload_rows(range).map_err(Box::new)?;
            Ok(Some(rows))
        };
        Ok(live.regroup(group, global_step, classes, own.as_ref(), &want, &mut fill)?)
    }

    /// Rows no rank holds after a regroup: from the newest complete checkpoint, else the
    /// initial centres (step 0, no optimizer state).
    fn reload_rows(
        &self,
        range: std::ops::Range<usize>,
    ) -> std::result::Result<RowBlock, CheckpointError> {
        let cfg = self.head.config();
        let (classes, e) = (cfg.num_classes, cfg.embedding_size);
        if let Some(saved) = self.ckpt.latest()? {
            if saved.rows_total(HEAD_SHARD) == Some(classes) {
                let rows = saved.read_rows(HEAD_SHARD, range.clone())?;
                let weight = rows.get("weight").and_then(Value::as_tensor);
                if let Some(weight) = weight.filter(|w| w.shape == [range.len(), e]) {
                    return Ok(RowBlock {
                        start: range.start,
                        len: range.len(),
                        step: saved.global_step(),
                        weight: weight.to_f32_vec(),
                        state: row_tensors(
                            rows.get("state").unwrap_or(&Value::None),
                            range.len(),
                            e,
                        ),
                    });
                }
            }
        }
        Ok(RowBlock {
            start: range.start,
            len: range.len(),
            step: 0,
            weight: self.head.initial_centres(range.clone()),
            state: Vec::new(),
        })
    }
}

/// The row tensors (`[rows, e]`) of a parameter's optimizer state entry, by name.
fn row_tensors(entry: &Value, rows: usize, e: usize) -> Vec<(String, Vec<f32>)> {
    let Value::Dict(items) = entry else { return Vec::new() };
    let mut out: Vec<(String, Vec<f32>)> = items
        .iter()
        .filter_map(|(k, v)| {
            let t = v.as_tensor().filter(|t| t.shape == [rows, e])?;
            Some((k.as_str()?.to_string(), t.to_f32_vec()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The head's optimizer entry for the re-split `rows`: their row tensors, and the other
/// entries (AdamW's `step`) from this rank's old entry, else from the first parameter's.
fn head_entry(rows: &RowBlock, own: &Value, rest: &Value, e: usize) -> Value {
    if rows.state.is_empty() {
        return Value::None;
    }
    let scalars_from = match own {
        Value::Dict(items) if !items.is_empty() => own.clone(),
        _ => rest
            .get("state")
            .and_then(|s| match s {
                Value::Dict(items) => items.first().map(|(_, v)| v.clone()),
                _ => None,
            })
            .unwrap_or(Value::None),
    };
    let row_names: Vec<&str> = rows.state.iter().map(|(k, _)| k.as_str()).collect();
    let mut items: Vec<(Value, Value)> = Vec::new();
    if let Value::Dict(src) = &scalars_from {
        for (k, v) in src {
            if k.as_str().is_some_and(|k| !row_names.contains(&k)) {
                items.push((k.clone(), v.clone()));
            }
        }
    }
    for (k, t) in &rows.state {
        items.push((Value::Str(k.clone()), Value::Tensor(TensorData::from_f32(&[rows.len, e], t))));
    }
    Value::Dict(items)
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

/// The head: this rank's rows of `--init-from`'s centres, or N(0, 0.01) from the seed.
fn build_head(
    cfg: &TrainOptions,
    classes: usize,
    comm: Arc<dyn Collectives>,
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
    let head = match centres {
        Some(full) => PartialFc::from_full_weight(pcfg, comm, &full.to_device(device)?)
            .context("`partial_fc.weight`")
            .option("init_from", None)?,
        None => PartialFc::new(pcfg, comm, device).context("building the PartialFC head")?,
    };
    Ok(head)
}
