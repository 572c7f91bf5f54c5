//! insightface's arcface_torch trainer as a library user writes it: IResNet under Ddp, a PartialFc
//! margin head split over the ranks, SGD over two groups, poly warm-up, clipping, float16 with a
//! GradScaler, verification on a `.bin` set, and per-rank checkpoints that resume on any world size
//! (the head's rows and each rank's BatchNorm statistics are parts of the one training state).
//!   tandem data synth-faces DATA --classes 16 --per-class 8
//!   tandem run --nproc-per-node 2 -- target/release/examples/arcface DATA OUT [EPOCHS]
use std::{path::PathBuf, sync::Arc};

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use tandem::data::LoaderOptions;
use tandem::data::{datasets::faces::FaceRecDataset, DataLoader, Dataset, DistributedSampler};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::models::IResNet;
use tandem::nn::{OrderedVarMap, ParamModule};
use tandem::optim::{GradScaler, GradScalerConfig, SgdConfig, TorchOptimizer, TorchSgd};
use tandem::partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};
use tandem::recipes::face::{HeadPart, BUFFERS_SHARD};
use tandem::recipes::face_eval::verification;
use tandem::train::{load_state, save_state, RankBuffers, TrainingState};
use tandem::train::{LrSchedule, RunLength, Step, Warmup};

const SEED: u64 = 7;

fn main() -> Result<()> {
    tandem::tune_allocator();
    let mut args = std::env::args().skip(1).map(PathBuf::from);
    let (data, out) = (args.next().context("DATA_DIR")?, args.next().context("OUT_DIR")?);
    let epochs: u64 = args.next().map_or(Ok(2), |e| e.to_string_lossy().parse())?;
    let group = tandem::init()?;
    let (dev, rank) = (Device::Cpu, group.rank());

    let train = FaceRecDataset::open(&data)?.with_flip(SEED);
    let classes = train.num_classes();
    let vars = OrderedVarMap::new();
    let model = IResNet::new(18, 8, 32, 0.0, vars.var_builder(DType::F32, &dev))?;
    IResNet::reset_parameters(&vars.named(), SEED)?;
    let ddp_opts =
        DdpOptions { bucket_cap_mb: 16.0, broadcast_buffers: false, ..Default::default() };
    let ddp = Ddp::new(vars.named_vars().freeze(IResNet::FROZEN)?, &group, ddp_opts)?;
    let mut pfc = PartialFcConfig::new(classes, 32, CombinedMarginLoss::arcface(64.0, 0.5));
    (pfc.autocast, pfc.seed) = (Some(DType::F16), SEED);
    let pfc = PartialFc::new(pfc, Arc::new(group.clone()), &dev)?;
    let sgd = SgdConfig { lr: 0.01, momentum: 0.9, weight_decay: 5e-4, ..Default::default() };
    let mut opt = TorchSgd::with_groups(vec![
        (ddp.params(), sgd.clone()),
        (vec![pfc.weight().clone()], sgd),
    ])?;
    // The head is the optimizer's parameter after the backbone's; its rows are this rank's alone.
    let mut head = HeadPart::new(pfc, ddp.params().len(), group.size(), None);
    let mut stats = RankBuffers::new(BUFFERS_SHARD, ddp.module().named_buffers(), rank);

    let sampler = DistributedSampler::builder(train.len()).group(&group).seed(SEED).build()?;
    let options = LoaderOptions { drop_last: true, ..LoaderOptions::new(4) };
    let mut loader = DataLoader::new(Arc::new(train), sampler, options, dev.clone())?;
    let per_epoch = loader.len() as u64;
    let run = RunLength { steps_per_epoch: per_epoch, total_steps: epochs * per_epoch };
    let sched = LrSchedule::Poly { warmup: Warmup::Steps(2) }.build(&mut opt, 0.01, run)?;
    let scaler = GradScaler::new(GradScalerConfig { growth_interval: 100, ..Default::default() })?;
    let mut step = Step::new().scaler(Some(scaler)).clip_grad_norm(Some(5.0)).scheduler(sched);

    let ckpts = out.join("checkpoints");
    let mut global_step = 0;
    let state = TrainingState::new(&ddp, &mut opt).scaler_and_scheduler(&mut step);
    let mut state = state.loader(&mut loader).part(&mut head).part(&mut stats);
    if let Some(r) = load_state(&ckpts, &mut state)? {
        global_step = r.step;
        if rank == 0 {
            println!("resumed from {} (step {})", r.path.display(), r.step);
        }
    }
    while loader.epoch() < epochs {
        let (mut loss_sum, mut n) = (0.0, 0);
        for batch in loader.iter()? {
            let batch = batch?;
            let labels: Vec<i64> = batch.labels.iter().map(|&l| i64::from(l)).collect();
            let loss = head.head.forward(&model.forward_t(&batch.x, true)?, &labels)?;
            let (local, params) = ([head.head.weight().clone()], ddp.params());
            let backward = |l: &_| ddp.backward_with_local(l, &local);
            global_step += 1;
            step.run(&loss, backward, &mut opt, &params, global_step)?;
            (loss_sum, n) = (loss_sum + loss.to_scalar::<f32>()?, n + 1);
        }
        if rank == 0 {
            let (epoch, loss) = (loader.epoch(), loss_sum / n as f32);
            println!("epoch {epoch} step {global_step} loss={loss:.4} lr={:.5}", opt.lr());
        }
        let epoch = loader.epoch();
        let state = TrainingState::new(&ddp, &mut opt).scaler_and_scheduler(&mut step);
        let state = state.loader(&mut loader).part(&mut head).part(&mut stats).seed(SEED);
        save_state(&group, &ckpts, &state.step(global_step).epoch(epoch))?;
    }

    let sets = verification::load(&[data.join("pairs.bin")])?;
    let buffers = ddp.module().named_buffers();
    for r in verification::evaluate(&model, &buffers, &sets, &dev, &group)? {
        if rank == 0 {
            println!("{}: verification_accuracy={:.4} (+-{:.4})", r.name, r.accuracy, r.std);
        }
    }
    Ok(())
}
