//! `tandem bench partial-fc`: the memory of PartialFC's class centres per rank. For each world
//! size W, rank 0's head is built (the largest share when C % W != 0) with SGD momentum, one
//! step allocates the momentum buffer, and the bytes of the centres plus the optimizer state
//! are measured from the allocated tensors, against the ideal split `C * E * 4 * 2 / W`
//! (f32 centres and one momentum buffer, divided over the ranks). No collective runs: the
//! head is only built and stepped.
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::{Device, Tensor};
use tandem::comm::Collectives;
use tandem::comm::LocalGroup;
use tandem::optim::zero::state_bytes;
use tandem::optim::{SgdConfig, TorchOptimizer, TorchSgd};
use tandem::partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};

#[derive(clap::Args)]
pub struct Args {
    /// Number of classes (identities).
    #[arg(long, default_value_t = 1_000_000)]
    classes: usize,
    /// Embedding size.
    #[arg(long, default_value_t = 512)]
    embedding: usize,
    /// World sizes, comma-separated.
    #[arg(long, default_value = "1,2,4")]
    nproc: String,
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let worlds: Vec<usize> = args
        .nproc
        .split(',')
        .map(|s| s.trim().parse().with_context(|| format!("--nproc: cannot parse {s:?}")))
        .collect::<anyhow::Result<_>>()?;
    if worlds.contains(&0) || args.classes == 0 || args.embedding == 0 {
        anyhow::bail!("--nproc, --classes and --embedding must be positive");
    }
    println!(
        "partial-fc memory: C={} classes, E={}, f32 centres + SGD momentum, rank 0 of each world",
        args.classes, args.embedding
    );
    for w in worlds {
        let start = Instant::now();
        let comm: Arc<dyn Collectives> = Arc::new(LocalGroup::new(w).swap_remove(0));
        let cfg = PartialFcConfig::new(
            args.classes,
            args.embedding,
            CombinedMarginLoss::arcface(64.0, 0.5),
        );
        let head = PartialFc::new(cfg, comm, &Device::Cpu)?;
        let weight = head.weight();
        let sgd = SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 5e-4, ..Default::default() };
        let mut opt = TorchSgd::new(vec![weight.clone()], sgd)?;
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(weight.as_tensor(), Tensor::zeros_like(weight.as_tensor())?);
        opt.step(&grads)?;
        let centres = weight.elem_count() * weight.dtype().size_in_bytes();
        let state = state_bytes(&opt.state_dict()?);
        let measured = centres + state;
        let ideal = args.classes as f64 * args.embedding as f64 * 4.0 * 2.0 / w as f64;
        println!(
            "W={w}: rank 0 holds {} classes: centres {:.1} MiB + momentum {:.1} MiB = {:.1} MiB; \
             C*E*4*2/W = {:.1} MiB; measured/ideal = {:.4} ({:.1} s)",
            head.split().len,
            mib(centres),
            mib(state),
            mib(measured),
            ideal / (1 << 20) as f64,
            measured as f64 / ideal,
            start.elapsed().as_secs_f64()
        );
    }
    Ok(0)
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}
