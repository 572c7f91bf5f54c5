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

use super::local_ranks::{emit_from_every_rank, median, run_workers, Bench};

#[derive(clap::Args)]
pub struct Args {
    /// World sizes to measure, comma-separated.
    #[arg(long, default_value = "2,4", value_delimiter = ',')]
    nproc: Vec<usize>,
    /// Layer sizes of the MLP, input to classes.
    #[arg(
        long,
        default_value = "784,1024,1024,1024,1024,1024,1024,1024,1024,10",
        value_delimiter = ','
    )]
    dims: Vec<usize>,
    /// Timed steps per run (after 2 warm-up steps).
    #[arg(long, default_value_t = STEPS)]
    steps: usize,
}

/// What a worker rank runs (the parent's settings).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Job {
    pub dims: Vec<usize>,
    pub steps: usize,
}

/// One rank's figures.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RankRow {
    pub rank: usize,
    /// Bytes of optimizer state this rank holds.
    pub state_bytes: usize,
    /// Median seconds of its optimizer step (the broadcasts included).
    pub step_secs: f64,
}

/// What `tandem bench zero` measured: the unsharded reference and each world's ranks.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Results {
    pub dims: Vec<usize>,
    pub unsharded_bytes: usize,
    pub unsharded_step_secs: f64,
    /// (world size, its ranks in rank order).
    pub worlds: Vec<(usize, Vec<RankRow>)>,
}

const BATCH: usize = 64;

/// Timed steps per run, unless `--steps` says otherwise (the report's too).
pub const STEPS: usize = 10;

fn check(job: &Job) -> anyhow::Result<()> {
    if job.dims.len() < 2 || job.dims.contains(&0) || job.steps == 0 {
        bail!("--dims needs at least two sizes, all positive, and --steps at least 1");
    }
    Ok(())
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

/// One rank of a world: ZeRO-1 over AdamW, its state bytes and step time reported.
pub fn worker(job: Job) -> anyhow::Result<i32> {
    check(&job)?;
    let pg = tandem::comm::init().context("worker init")?;
    let model = Mlp::new(&job.dims, 0, &Device::Cpu)?;
    let mut opt = ZeroRedundancyOptimizer::new(model.params(), Arc::new(pg.clone()), adamw)?;
    let step_secs = time_steps(&model, &mut opt, job.steps)?;
    let row = RankRow { rank: pg.rank(), state_bytes: opt.local_state_bytes()?, step_secs };
    emit_from_every_rank(&pg, &row)?;
    Ok(0)
}

/// The unsharded reference on this process, then ZeRO-1 on each world size of `worlds`.
pub fn measure(worlds: &[usize], job: &Job) -> anyhow::Result<Results> {
    check(job)?;
    if worlds.is_empty() || worlds.contains(&0) {
        bail!("--nproc values must be at least 1");
    }
    let model = Mlp::new(&job.dims, 0, &Device::Cpu)?;
    let mut plain = adamw(model.params())?;
    let unsharded_step_secs = time_steps(&model, plain.as_mut(), job.steps)?;
    let unsharded_bytes = state_bytes(&plain.state_dict()?);
    let mut results =
        Results { dims: job.dims.clone(), unsharded_bytes, unsharded_step_secs, worlds: vec![] };
    for &n in worlds {
        let mut rows: Vec<RankRow> =
            run_workers(Bench::Zero, n, job, &[], Duration::from_secs(600))?;
        if rows.len() != n {
            bail!("bench zero with {n} ranks: {} of {n} ranks reported", rows.len());
        }
        rows.sort_by_key(|r| r.rank);
        results.worlds.push((n, rows));
    }
    Ok(results)
}

/// The results as the table `tandem bench zero` prints (and the report shows).
pub fn render(r: &Results) -> String {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut out = format!(
        "MLP {:?} + AdamW: unsharded optimizer state {:.2} MiB, step {:.2} ms (one process)\n",
        r.dims,
        mib(r.unsharded_bytes),
        r.unsharded_step_secs * 1e3
    );
    out += &format!(
        "{:>6} {:>5} {:>12} {:>13} {:>14} {:>10}\n",
        "ranks", "rank", "state MiB", "x unsharded", "x ideal (1/N)", "step ms"
    );
    for (n, rows) in &r.worlds {
        for row in rows {
            let share = row.state_bytes as f64 / r.unsharded_bytes as f64;
            out += &format!(
                "{n:>6} {:>5} {:>12.2} {:>13.3} {:>14.3} {:>10.2}\n",
                row.rank,
                mib(row.state_bytes),
                share,
                share * *n as f64,
                row.step_secs * 1e3
            );
        }
    }
    out
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let job = Job { dims: args.dims, steps: args.steps };
    print!("{}", render(&measure(&args.nproc, &job)?));
    Ok(0)
}
