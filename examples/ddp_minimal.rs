//! The DDP recipe from the PyTorch tutorials, as a tandem user writes it.
//!
//! Run alone (a world of one) or under any launcher:
//!   cargo build --release --example ddp_minimal
//!   tandem run --nproc-per-node 2 -- target/release/examples/ddp_minimal [CHECKPOINT_DIR]
//! Run it twice with the same CHECKPOINT_DIR and the second run resumes where the first ended.
use std::sync::Arc;

use anyhow::Result;
use candle_core::Device;
use tandem::data::{datasets, DataLoader, Dataset, DistributedSampler, LoaderOptions};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::models::Mlp;
use tandem::optim::{SgdConfig, TorchSgd};
use tandem::TrainingState;

fn main() -> Result<()> {
    tandem::tune_allocator(); // opt-in: glibc keeps freed tensor memory for reuse (faster steps)
    let group = tandem::init()?; // env:// from the launcher, or a world of one
    let ckpt_dir = std::env::args().nth(1).unwrap_or_else(|| "runs/ddp_minimal".into());

    let (train, _eval) = datasets::digits()?;
    let model = Mlp::new(&[train.input_dim(), 64, train.num_classes()], 0, &Device::Cpu)?;
    let ddp = Ddp::new(model, &group, DdpOptions::default())?; // checks shapes, broadcasts rank 0's weights
    let mut opt =
        TorchSgd::new(ddp.params(), SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() })?;
    let sampler = DistributedSampler::builder(train.len()).group(&group).build()?;
    let mut loader =
        DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(32), Device::Cpu)?;

    // Model, optimizer and loader position are restored together (every rank reads the newest
    // checkpoint that verifies).
    let (mut start_epoch, mut step) = (0, 0);
    let mut state = TrainingState::new(&ddp, &mut opt).loader(&mut loader);
    if let Some(r) = tandem::load_state(&ckpt_dir, &mut state)? {
        (start_epoch, step) = (r.epoch, r.step);
        if group.rank() == 0 {
            println!("resumed from {} at epoch {start_epoch}", r.path.display());
        }
    }

    for epoch in start_epoch..start_epoch + 2 {
        loader.set_epoch(epoch); // a new shuffle each epoch, identical on every rank
        let mut last = 0.0;
        for batch in loader.iter()? {
            let batch = batch?;
            let loss = ddp.hooked().loss(&batch.x, &batch.y)?; // the model's own method, through Ddp's hooks
            opt.step(&ddp.backward(&loss)?)?; // gradients averaged over all ranks
            last = loss.to_scalar::<f32>()?;
            step += 1;
        }
        // ... and saved together: rank 0 writes atomically, every rank meets at a barrier inside.
        let state =
            TrainingState::new(&ddp, &mut opt).loader(&mut loader).epoch(epoch + 1).step(step);
        let saved = tandem::save_state(&group, &ckpt_dir, &state)?;
        if let Some(path) = saved {
            println!("epoch {epoch}: last loss {last:.4}, saved {}", path.display());
        }
    }
    Ok(())
}
