//! A recipe of your own on the library's `Trainer`: your candle-nn CNN on 8x8 digit images,
//! float16 mixed precision with a GradScaler, a cosine schedule, checkpoints written in the
//! background (and resumed), and live recovery: under `tandem run --live-recovery` a killed rank's
//! peers regroup without it and its replacement joins. The recipe says its step, its evaluation
//! and its state; the Trainer does the loop, checkpoints, resume and recovery.
//!
//!   cargo build --release --example image_classifier
//!   tandem run --nproc-per-node 3 --max-restarts 2 --live-recovery -- \
//!     target/release/examples/image_classifier OUT_DIR
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{conv2d, linear, Conv2d, Conv2dConfig, Linear, VarBuilder, VarMap};
use tandem::data::LoaderOptions;
use tandem::data::{datasets, Batch, DataLoader, Dataset, DistributedSampler, InMemoryDataset};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::nn::Autocast;
use tandem::nn::NamedVars;
use tandem::optim::{GradScaler, GradScalerConfig, SgdConfig, TorchOptimizer, TorchSgd};
use tandem::train::evaluate_logits;
use tandem::train::{Evaluation, Lines, LrSchedule, Periodic, Recipe, Reporter, RunLength};
use tandem::train::{Step, StepReport, Trainer, TrainerOptions, TrainingState, World};

/// Your model: two 3x3 convolutions with max-pooling, then a linear classifier.
struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    fc: Linear,
}

impl Module for Cnn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.reshape((x.dim(0)?, 1, 8, 8))?;
        let x = self.conv1.forward(&x)?.relu()?.max_pool2d(2)?;
        let x = self.conv2.forward(&x)?.relu()?.max_pool2d(2)?;
        self.fc.forward(&x.flatten_from(1)?)
    }
}

/// The recipe: the model, its Ddp wrapper, the optimizer and the eval split.
struct Digits {
    model: Cnn,
    ddp: Ddp<NamedVars>,
    opt: TorchSgd,
    eval: Arc<InMemoryDataset>,
}

impl Recipe for Digits {
    type Data = InMemoryDataset;

    fn train_step(
        &mut self,
        batch: &Batch,
        step: &mut Step,
        n: u64,
    ) -> tandem::train::Result<StepReport> {
        // f16 on a GPU (autocast); on the CPU values are rounded to f16 as autocast's would be.
        let logits = Autocast(Some(DType::F16)).apply(&batch.x, true, |x| self.model.forward(x))?;
        let loss = candle_nn::loss::cross_entropy(&logits, &batch.y)?;
        let (ddp, params) = (&self.ddp, self.ddp.params());
        step.run(&loss, |l| ddp.backward(l), &mut self.opt, &params, n)?;
        let loss = loss.to_scalar::<f32>()? as f64;
        Ok(StepReport { loss, samples: batch.len(), ..StepReport::default() })
    }

    fn optimizer(&mut self) -> &mut dyn TorchOptimizer {
        &mut self.opt
    }

    fn evaluate(
        &mut self,
        group: &tandem::comm::ProcessGroup,
    ) -> tandem::train::Result<Option<Evaluation>> {
        let forward = |x: &Tensor| self.model.forward(x);
        let m = evaluate_logits(forward, &self.eval, group, &LoaderOptions::new(64), &Device::Cpu)?;
        Ok(Some(Evaluation { loss: m.mean_loss(), accuracy: m.accuracy() }))
    }

    /// Model and optimizer: the Trainer adds schedule, loss scale, loader position and step.
    fn state(&mut self) -> Option<TrainingState<'_>> {
        Some(TrainingState::new(&self.ddp, &mut self.opt))
    }
}

fn main() -> Result<()> {
    tandem::tune_allocator();
    let out = std::env::args().nth(1).context("usage: image_classifier OUT_DIR [EPOCHS]")?;
    let epochs: u64 = std::env::args().nth(2).map_or(Ok(60), |e| e.parse())?;
    let world = World::join()?;
    let (train, eval) = datasets::digits()?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let pad = Conv2dConfig { padding: 1, ..Default::default() };
    let model = Cnn {
        conv1: conv2d(1, 16, 3, pad, vb.pp("conv1"))?,
        conv2: conv2d(16, 32, 3, pad, vb.pp("conv2"))?,
        fc: linear(32 * 2 * 2, train.num_classes(), vb.pp("fc"))?,
    };
    let ddp =
        Ddp::from_varmap(&varmap, &world.collectives(), world.ddp_options(DdpOptions::default()))?;
    let sgd = SgdConfig { lr: 0.05, momentum: 0.9, ..SgdConfig::default() };
    let mut opt = TorchSgd::new(ddp.params(), sgd)?;
    let sampler = DistributedSampler::builder(train.len()).group(world.group()).seed(7).build()?;
    let loader = DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(16), Device::Cpu)?;
    let sched =
        LrSchedule::Cosine.build(&mut opt, 0.05, RunLength::epochs(loader.len(), epochs))?;
    let scaler = GradScaler::new(GradScalerConfig::default())?;
    let step = Step::new().scaler(Some(scaler)).clip_grad_norm(Some(5.0)).scheduler(sched);

    let mut opts = TrainerOptions::new(&out, epochs);
    opts.checkpoints = Arc::new(Periodic::every(50).in_background(true));
    opts.resume = true;
    let recipe = Digits { model, ddp, opt, eval: Arc::new(eval) };
    let printed = Reporter::new().with(Lines(std::io::stdout())); // rank 0's events as lines
    let trainer =
        Trainer::new(recipe, loader, step, world.group().clone(), opts)?.reporter(printed);
    let summary = world.fit(trainer)?;
    if summary.rank == 0 {
        let accuracy = summary.eval_accuracy.unwrap_or(f64::NAN);
        println!("done: {} steps, eval_accuracy={accuracy:.4}", summary.steps);
    }
    Ok(())
}
