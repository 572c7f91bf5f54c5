//! A stock candle-nn model under Ddp — the default way to hold a model in tandem: the model is
//! written with candle-nn layers on a `VarBuilder`, exactly as without tandem;
//! `Ddp::from_varmap` wraps it by its `VarMap`, candle-nn's own optimizer steps with the
//! world-averaged gradients, and `tandem::save_state`/`load_state` checkpoint the run (model,
//! candle-nn's SGD, loader position) so a second run resumes where the first ended.
//!
//!   cargo build --release --example ddp_candle_nn
//!   tandem run --nproc-per-node 2 -- target/release/examples/ddp_candle_nn [CHECKPOINT_DIR]
use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap, SGD};
use tandem::data::{datasets, evaluate, DataError, DataLoader, Dataset, DistributedSampler};
use tandem::data::{Batch, LoaderOptions};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::TrainingState;

/// Nothing tandem-specific here.
struct Classifier {
    fc1: Linear,
    fc2: Linear,
}

impl Classifier {
    fn new(inputs: usize, classes: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Classifier {
            fc1: linear(inputs, 64, vb.pp("fc1"))?,
            fc2: linear(64, classes, vb.pp("fc2"))?,
        })
    }
}

impl Module for Classifier {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

fn main() -> Result<()> {
    tandem::tune_allocator();
    let group = tandem::init()?;
    let ckpt_dir = std::env::args().nth(1).unwrap_or_else(|| "runs/ddp_candle_nn".into());
    let (train, eval) = datasets::digits()?;

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Classifier::new(train.input_dim(), train.num_classes(), vb)?;
    let ddp = Ddp::from_varmap(&varmap, &group, DdpOptions::default())?; // rank 0's weights everywhere
    let mut opt = SGD::new(varmap.all_vars(), 0.1)?;

    let sampler = DistributedSampler::builder(train.len()).group(&group).build()?;
    let mut loader =
        DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(32), Device::Cpu)?;
    // Model, candle-nn's SGD (its learning rate) and the loader position resume together.
    let mut state = TrainingState::new(&ddp, &mut opt).loader(&mut loader);
    let (start, mut step) = match tandem::load_state(&ckpt_dir, &mut state)? {
        Some(r) => {
            if group.rank() == 0 {
                println!("resumed from {} at epoch {}", r.path.display(), r.epoch);
            }
            (r.epoch, r.step)
        }
        None => (0, 0),
    };
    for epoch in start..start + 5 {
        loader.set_epoch(epoch);
        for batch in loader.iter()? {
            let batch = batch?;
            let logits = model.forward(&batch.x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &batch.y)?;
            opt.step(&ddp.backward(&loss)?)?; // world-averaged gradients
            step += 1;
        }
        let state =
            TrainingState::new(&ddp, &mut opt).loader(&mut loader).epoch(epoch + 1).step(step);
        tandem::save_state(&group, &ckpt_dir, &state)?;
    }

    // Every rank evaluates its share; the metrics are summed over the world.
    let step = |b: &Batch| -> Result<(f64, i64), DataError> {
        let logits = model.forward(&b.x)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &b.y)?.to_scalar::<f32>()?;
        let hits = logits.argmax(1)?.eq(&b.y)?.to_dtype(DType::F32)?.sum_all()?;
        Ok((f64::from(loss) * b.y.dim(0)? as f64, hits.to_scalar::<f32>()? as i64))
    };
    let metrics = evaluate(&group, Arc::new(eval), &LoaderOptions::new(64), Device::Cpu, step)?;
    if group.rank() == 0 {
        println!(
            "ddp_candle_nn: world={} eval_loss={:.4} eval_accuracy={:.4}",
            group.size(),
            metrics.mean_loss(),
            metrics.accuracy()
        );
    }
    Ok(())
}
