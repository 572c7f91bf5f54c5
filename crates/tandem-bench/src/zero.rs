//! `tandem bench zero`: optimizer-state bytes per rank with ZeroRedundancyOptimizer (ZeRO-1)
//! against the unsharded optimizer on the same model, and the step time it costs (its shard's
//! update plus one broadcast per rank). The reference — the unsharded optimizer's state bytes
//! and step time on one process — is measured by this process in the same run; the ranks are
//! local processes over tandem's transport (shared memory).
//!
//! Model: an MLP with AdamW, whose two moment buffers per parameter make the state twice the
//! weights; synthetic batches of 64. The default has eight 1024-wide layers (7.3 M parameters),
//! sizes alike as in most deep models; with a few dominant tensors (`--dims 784,1024,1024,10`)
//! the split is uneven, since ZeRO-1 (here as in PyTorch) assigns whole parameters.
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::{Device, Tensor};
use tandem::models::{targets, Mlp};
use tandem::nn::ParamModule;
use tandem::optim::zero::state_bytes;
use tandem::optim::{
    AdamWConfig, ShardOptimizer, TorchAdamW, TorchOptimizer, ZeroRedundancyOptimizer,
};

use super::local_ranks::{median, run_ranks};

#[derive(clap::Args)]
pub struct Args {
    /// World sizes to measure, comma-separated.
    #[arg(long, default_value = "2,4")]
    nproc: String,
    /// Layer sizes of the MLP, input to classes.
    #[arg(long, default_value = "784,1024,1024,1024,1024,1024,1024,1024,1024,10")]
    dims: String,
    /// Timed steps per run (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Internal: run as one rank (set by the parent).
    #[arg(long, hide = true)]
    worker: bool,
}

const BATCH: usize = 64;

fn dims(args: &Args) -> anyhow::Result<Vec<usize>> {
    let d: Vec<usize> = args
        .dims
        .split(',')
        .map(|s| s.trim().parse().with_context(|| format!("--dims: cannot parse {s:?}")))
        .collect::<anyhow::Result<_>>()?;
    if d.len() < 2 || d.contains(&0) {
        bail!("--dims needs at least two sizes, all positive");
    }
    Ok(d)
}

fn adamw(params: Vec<candle_core::Var>) -> Result<ShardOptimizer, tandem::optim::OptimError> {
    Ok(Box::new(TorchAdamW::new(params, AdamWConfig { lr: 1e-3, ..Default::default() })?))
}

/// A fixed synthetic batch (the same on every rank, as after DDP's average).
fn batch(dims: &[usize]) -> anyhow::Result<(Tensor, Tensor)> {
    let (inputs, classes) = (dims[0], dims[dims.len() - 1]);
    let x: Vec<f32> = (0..BATCH * inputs).map(|i| ((i * 37) % 101) as f32 / 101.0).collect();
    let y: Vec<u32> = (0..BATCH).map(|i| (i % classes) as u32).collect();
    Ok((Tensor::from_vec(x, (BATCH, inputs), &Device::Cpu)?, targets(&y, &Device::Cpu)?))
}

/// Median seconds of `steps` optimizer steps after 2 warm-up ones.
fn time_steps(model: &Mlp, opt: &mut dyn TorchOptimizer, steps: usize) -> anyhow::Result<f64> {
    let (x, y) = batch(model.dims())?;
    let mut times = Vec::new();
    for i in 0..steps + 2 {
        let grads = tandem::nn::backward(&model.loss(&x, &y)?)?;
        let t = Instant::now();
        opt.step(&grads)?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

fn worker(args: &Args) -> anyhow::Result<i32> {
    let pg = tandem::comm::init().context("worker init")?;
    let model = Mlp::new(&dims(args)?, 0, &Device::Cpu)?;
    let mut opt = ZeroRedundancyOptimizer::new(model.params(), Arc::new(pg.clone()), adamw)?;
    let secs = time_steps(&model, &mut opt, args.steps)?;
    let line = format!("{} {} {secs}", pg.rank(), opt.local_state_bytes()?);
    let all = pg.all_gather_bytes(line.as_bytes())?;
    if pg.rank() == 0 {
        for l in all {
            println!("RESULT {} {}", pg.size(), String::from_utf8_lossy(&l));
        }
    }
    pg.barrier()?;
    Ok(0)
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.worker {
        return worker(&args);
    }
    let worlds: Vec<usize> = args
        .nproc
        .split(',')
        .map(|s| s.trim().parse().with_context(|| format!("--nproc: cannot parse {s:?}")))
        .collect::<anyhow::Result<_>>()?;
    if worlds.contains(&0) || args.steps == 0 {
        bail!("--nproc values and --steps must be at least 1");
    }
    // The reference: the unsharded optimizer on this process.
    let dims = dims(&args)?;
    let model = Mlp::new(&dims, 0, &Device::Cpu)?;
    let mut plain = adamw(model.params())?;
    let plain_secs = time_steps(&model, plain.as_mut(), args.steps)?;
    let unsharded = state_bytes(&plain.state_dict()?);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "MLP {dims:?} + AdamW: unsharded optimizer state {:.2} MiB, step {:.2} ms (one process)",
        mib(unsharded),
        plain_secs * 1e3
    );
    println!(
        "{:>6} {:>5} {:>12} {:>13} {:>14} {:>10}",
        "ranks", "rank", "state MiB", "x unsharded", "x ideal (1/N)", "step ms"
    );
    for &n in &worlds {
        let steps = args.steps.to_string();
        let worker_args = ["zero", "--worker", "--steps", &steps, "--dims", &args.dims];
        let text = run_ranks(n, "bench-zero", &worker_args, &[], Duration::from_secs(600))?;
        let mut rows = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("RESULT ") else { continue };
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() == 4 {
                rows.push((f[1].parse::<usize>()?, f[2].parse::<usize>()?, f[3].parse::<f64>()?));
            }
        }
        if rows.len() != n {
            bail!("bench zero with {n} ranks: {} of {n} ranks reported", rows.len());
        }
        rows.sort_by_key(|r| r.0);
        for (rank, bytes, secs) in rows {
            println!(
                "{n:>6} {rank:>5} {:>12.2} {:>13.3} {:>14.3} {:>10.2}",
                mib(bytes),
                bytes as f64 / unsharded as f64,
                bytes as f64 * n as f64 / unsharded as f64,
                secs * 1e3
            );
        }
    }
    Ok(0)
}
