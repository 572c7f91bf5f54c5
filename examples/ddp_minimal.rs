//! The DDP recipe from the PyTorch tutorials, as a tandem user writes it.
//!
//! Run alone (a world of one) or under any launcher:
//!   cargo build --release --example ddp_minimal
//!   tandem run --nproc-per-node 2 -- target/release/examples/ddp_minimal [CHECKPOINT_DIR]
//! Run it twice with the same CHECKPOINT_DIR and the second run resumes where the first ended.
use std::sync::Arc;

use anyhow::Result;
use candle_core::Device;
use tandem::ckpt::{CheckpointManager, TrainingCheckpoint, Value};
use tandem::data::{datasets, DataLoader, Dataset, DistributedSampler, LoaderOptions};
use tandem::ddp::models::Mlp;
use tandem::ddp::optim::{Sgd, SgdConfig, TorchOptimizer};
use tandem::ddp::{Ddp, DdpOptions, ParamModule};

fn main() -> Result<()> {
    tandem::tune_allocator(); // opt-in: glibc keeps freed tensor memory for reuse (faster steps)
    let group = tandem::init()?; // env:// from the launcher, or a world of one
    let (rank, world) = (group.rank(), group.size());
    let ckpt_dir = std::env::args().nth(1).unwrap_or_else(|| "runs/ddp_minimal".into());

    let (train, _eval) = datasets::digits()?;
    let model = Mlp::new(&[train.input_dim(), 64, train.num_classes()], 0, &Device::Cpu)?;
    let ddp = Ddp::new(model, &group, DdpOptions::default())?; // checks shapes, broadcasts rank 0's weights
    let params = ddp.named_parameters().into_iter().map(|(_, v)| v).collect();
    let mut opt = Sgd::new(params, SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() })?;

    let sampler = DistributedSampler::builder(train.len()).group(&group).build()?;
    let mut loader =
        DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(32), Device::Cpu)?;

    // Resume: every rank reads the newest checkpoint that verifies.
    let manager = CheckpointManager::new(&ckpt_dir, 2);
    let mut start_epoch = 0;
    if let Some((path, value)) = manager.latest_valid()? {
        let ck = TrainingCheckpoint::from_value(&value)?;
        let names: Vec<_> = ddp
            .named_parameters()
            .into_iter()
            .map(|(n, v)| (n, v.dims().to_vec(), tandem::ckpt::DType::F32))
            .collect();
        let (tensors, _report) = tandem::ckpt::load_state_dict(&ck.model, &names, true)?;
        ddp.load_state_dict(tandem::ddp::convert::state_dict_from_ckpt(&tensors, &Device::Cpu)?)?;
        opt.load_state_dict(&ck.optimizer)?;
        start_epoch = ck.epoch as u64;
        if rank == 0 {
            println!("resumed from {} at epoch {start_epoch}", path.display());
        }
    }

    for epoch in start_epoch..start_epoch + 2 {
        loader.set_epoch(epoch); // a new shuffle each epoch, identical on every rank
        let mut last = 0.0;
        for batch in loader.iter()? {
            let batch = batch?;
            let loss = ddp.loss(&batch.x, &batch.y)?; // the model's own method, through the wrapper
            let grads = ddp.backward(&loss)?; // gradients averaged over all ranks
            opt.step(&grads)?;
            last = loss.to_scalar::<f32>()?;
        }
        // Rank 0 writes (atomically); every rank meets at the barrier inside save_on_rank.
        let model = tandem::ddp::convert::state_dict_to_ckpt(&ddp.state_dict())?;
        let ck = TrainingCheckpoint {
            epoch: epoch as i64 + 1,
            global_step: 0,
            model: Value::dict_from(model.into_iter().map(|(k, t)| (k, Value::Tensor(t)))),
            optimizer: opt.state_dict()?,
            scheduler: Value::None,
            sampler: Value::None,
            rng: Value::None,
            world_size: world as i64,
            config: Value::None,
        };
        let saved = manager.save_on_rank(
            rank,
            &format!("epoch-{:03}", epoch + 1),
            &ck.to_value()?,
            || group.barrier(),
        )?;
        if let Some(path) = saved {
            println!("epoch {epoch}: last loss {last:.4}, saved {}", path.display());
        }
    }
    Ok(())
}
