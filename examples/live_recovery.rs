//! Your own training loop, kept going through rank deaths (`tandem::live`): the survivors
//! regroup and take the state of the rank furthest along (at most the failed step redone), a
//! restarted rank joins at a step boundary and receives the whole state from a peer — no
//! checkpoint file involved. The model is a stock candle-nn one on a VarMap.
//!
//!   cargo build --release --example live_recovery
//!   tandem run --nproc-per-node 4 --max-restarts 3 --live-recovery -- target/release/examples/live_recovery
//!
//! Kill a rank with `kill -9` while it runs: the others print the regroup and go on.
use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap, SGD};
use tandem::data::{datasets, DataLoader, Dataset, DistributedSampler, LoaderOptions};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::live::{is_peer_failure, LiveTraining};
use tandem::TrainingState;

const EPOCHS: u64 = 300;

struct Classifier {
    fc1: Linear,
    fc2: Linear,
}

impl Module for Classifier {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

fn main() -> Result<()> {
    tandem::tune_allocator();
    let live = LiveTraining::connect()?; // started by `tandem run --live-recovery`
    let (train, _eval) = datasets::digits()?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let (inputs, classes) = (train.input_dim(), train.num_classes());
    let model = Classifier {
        fc1: linear(inputs, 64, vb.pp("fc1"))?,
        fc2: linear(64, classes, vb.pp("fc2"))?,
    };
    // Collectives that follow every regroup; a replacement skips Ddp's start-up broadcast.
    let ddp =
        Ddp::from_varmap(&varmap, &live.collectives(), live.ddp_options(DdpOptions::default()))?;
    let mut opt = SGD::new(varmap.all_vars(), 0.05)?;
    let (rank, world) = live.rank_and_size();
    let sampler =
        DistributedSampler::builder(train.len()).num_replicas(world).rank(rank).build()?;
    let mut loader =
        DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(16), Device::Cpu)?;
    let mut step = 0u64;
    // A replacement joins the running world here and receives model, SGD, position and step.
    let mut state = TrainingState::new(&ddp, &mut opt).loader(&mut loader).step(step);
    if let Some(change) = live.start(&mut state)? {
        println!("joined: {change}");
    }
    step = state.step;

    while loader.epoch() < EPOCHS {
        let epoch = loader.epoch();
        let mut failed_at = None; // where a failed step took its batch from
        let mut regroup = false; // a rank waits to join, or a peer failed
        let (mut loss_sum, mut steps) = (0.0, 0);
        let mut batches = loader.iter()?;
        loop {
            // Every step starts at a boundary where a waiting rank can come in.
            match live.regroup_wanted() {
                Ok(false) => {}
                Ok(true) => regroup = true,
                Err(e) if is_peer_failure(&e) => regroup = true,
                Err(e) => return Err(e.into()),
            }
            if regroup {
                break;
            }
            let before = loader.state(); // where this step takes its batch from
            let Some(batch) = batches.next() else { break };
            let batch = batch?;
            let result = (|| -> Result<f32> {
                let loss = candle_nn::loss::cross_entropy(&model.forward(&batch.x)?, &batch.y)?;
                opt.step(&ddp.backward(&loss)?)?; // averaged over whoever is alive
                Ok(loss.to_scalar::<f32>()?)
            })();
            match result {
                Ok(loss) => {
                    step += 1;
                    loss_sum += loss;
                    steps += 1;
                }
                Err(e) if e.chain().any(is_peer_failure) => {
                    failed_at = Some(before);
                    regroup = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        drop(batches);
        if !regroup {
            if live.group().rank() == 0 {
                println!(
                    "epoch {} step {step} mean loss {:.4}",
                    epoch + 1,
                    loss_sum / steps.max(1) as f32
                );
            }
            continue;
        }
        if let Some(position) = failed_at {
            loader.load_state(&position)?; // the failed step did not happen: its batch goes back
        }
        let mut state = TrainingState::new(&ddp, &mut opt).loader(&mut loader).step(step);
        let change = live.regroup(&mut state)?;
        step = state.step;
        if live.group().rank() == live.generation().source {
            println!("regrouped: {change}");
        }
    }
    if live.group().rank() == 0 {
        println!("done: {step} steps on {} rank(s)", live.group().size());
    }
    live.finish()?; // a replacement arriving now is told the job is over
    Ok(())
}
