//! `tandem bench ddp`: training samples/s of plain single-process training and of Ddp, on the
//! same global batch and the same synthetic MNIST-shaped data (as `scripts/peers/torch_ddp_step.py`).
//!
//! * plain: one process, all cores, batch B, `loss.backward()` + SGD.
//! * Ddp 1 rank: the same, wrapped in Ddp over a world of one (hooks, buckets, comm thread);
//!   measured in rounds alternating with plain, overhead = 1 - median(ddp/plain per round).
//! * Ddp N ranks: N copies of this executable on loopback, B/N per rank, cores/N threads each;
//!   scaling efficiency = samples/s(N ranks) / samples/s(plain), i.e. against one process using
//!   the same cores on the same global batch.
//! * N processes without Ddp: the same ranks each training alone (no all-reduce), an upper bound
//!   that separates communication cost from the tensor engine's speed.
//! * `--torch PYTHON`: runs the PyTorch DDP peer (gloo, same model, B/N per rank) beside it —
//!   the MLP, the Cnn or the ResNet at the same width.
//! * `--mode paramset|varmap`: how Ddp holds the model. paramset: the model reads its parameters
//!   through Ddp's hooks, all-reduce overlaps backward. varmap: Ddp holds the same `Var`s as a
//!   stock candle model's VarMap would (`NamedVars`), the model reads them directly, and the
//!   gradients are reduced after backward. Same model code and kernels in both.
//! * `--model resnet18 [--width N]`: tandem's ResNet-18 for CIFAR (candle-nn layers on an
//!   OrderedVarMap, always the varmap way) on synthetic 3x32x32 data.
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::{Device, Tensor};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::models::{Cnn, Mlp, ModelKind, ResNet};
use tandem::nn::{NamedVars, OrderedVarMap, ParamModule};
use tandem::optim::{SgdConfig, TorchSgd};

use super::local_ranks::{emit, median, run_workers, Bench};

#[derive(clap::Args, Clone, serde::Serialize, serde::Deserialize)]
pub struct Args {
    /// Ranks for the distributed run.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// mlp: 784-1024-1024-10 (the peer script's model); cnn: tandem::models::Cnn on 1x28x28;
    /// resnet18: ResNet-18 for CIFAR on 3x32x32 (a VarMap model, its fused layers reduced as
    /// backward computes them: `reduce_during_backward`).
    #[arg(long, default_value = "mlp")]
    model: ModelKind,
    /// ResNet-18's first-stage width (stages w, 2w, 4w, 8w; torchvision: 64).
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// How Ddp holds the model: through the ParamSet view (overlapped) or as plain named Vars
    /// like a stock candle-nn model's VarMap (reduced after backward).
    #[arg(long, default_value = "paramset", value_parser = ["paramset", "varmap"])]
    mode: String,
    /// Global batch (split evenly over the ranks).
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Timed steps per round (after 3 warm-up steps).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Rounds; the reported samples/s are medians over rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// A Python with torch: also run the PyTorch DDP peer on the same work.
    #[arg(long)]
    torch: Option<PathBuf>,
    /// The peer script (usage: WORLD STEPS PER_RANK_BATCH MODEL WIDTH); default
    /// <repo>/scripts/peers/torch_ddp_step.py, which trains the same three models.
    #[arg(long)]
    torch_script: Option<PathBuf>,
    /// Where every rank trains: cpu, or cuda (rank r on GPU LOCAL_RANK; needs the `cuda` build
    /// feature). The PyTorch peer then uses the same GPUs with NCCL.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Mixed precision on a GPU, ResNet-18 only: `f16` (tandem's autocast and a GradScaler;
    /// PyTorch's torch.autocast and GradScaler) or `bf16`; `f32` everywhere else.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    precision: String,
    /// With --device cuda, how the N-rank run reduces gradients: nccl on the GPUs (one GPU per
    /// rank: NCCL refuses two ranks on one GPU), or host (copied to host memory and reduced by
    /// the shm/tcp transport — what works for several ranks on one GPU).
    #[arg(long, default_value = "nccl", value_parser = ["nccl", "host"])]
    backend: String,
}

/// What a worker rank runs: the parent's settings, one round, and whether it trains without
/// Ddp (no communication: the upper bound).
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Job {
    args: Args,
    local_only: bool,
}

const WARMUP: usize = 3;
const SGD_LR: f64 = 0.01;

enum Net {
    Mlp(Mlp),
    Cnn(Cnn),
}

impl Net {
    /// The ParamSet models (the ResNet is built by [`ResNetSteps`]).
    fn new(kind: ModelKind, dev: &Device) -> anyhow::Result<Net> {
        Ok(match kind {
            ModelKind::Mlp => Net::Mlp(Mlp::new(&[784, 1024, 1024, 10], 0, dev)?),
            ModelKind::Cnn => Net::Cnn(Cnn::new(1, 28, 28, 10, 0, dev)?),
            ModelKind::ResNet18 => anyhow::bail!("resnet18 is built by ResNetSteps"),
            face => anyhow::bail!("{face} is a face backbone: `tandem bench face` runs it"),
        })
    }
    fn describe(kind: ModelKind, width: usize) -> String {
        match kind {
            ModelKind::Mlp => "Mlp 784-1024-1024-10".into(),
            ModelKind::ResNet18 => format!("ResNet-18 (CIFAR stem) width {width} on 3x32x32"),
            ModelKind::Cnn => "Cnn 1x28x28 (conv8-bn-conv16-fc)".into(),
            face => format!("{face} width {width}"),
        }
    }
}

/// ResNet-18 as users hold it: candle-nn layers on a VarMap, BatchNorm in training mode; Ddp
/// (when given a group) wraps its variables.
struct ResNetSteps {
    model: ResNet,
    ddp: Option<Ddp<NamedVars>>,
    opt: TorchSgd,
    /// Autocast's type (f16, bf16) on a GPU, with f16's GradScaler.
    autocast: Option<candle_core::DType>,
    scaler: Option<tandem::optim::GradScaler>,
}

impl ResNetSteps {
    fn new(
        width: usize,
        comm: Option<&tandem::comm::ProcessGroup>,
        dev: &Device,
        precision: &str,
    ) -> anyhow::Result<Self> {
        let vars = OrderedVarMap::new();
        let model =
            ResNet::resnet18_cifar(width, 10, vars.var_builder(candle_core::DType::F32, dev))?;
        ResNet::reset_parameters(&vars.named(), 0)?;
        let named = vars.named_vars();
        let opt = sgd(named.params())?;
        // TANDEM_DDP_OVERLAP=0: reduce after backward instead (the A/B of the overlap).
        let early = std::env::var("TANDEM_DDP_OVERLAP").map_or(true, |v| v != "0");
        let opts = DdpOptions { reduce_during_backward: early, ..DdpOptions::default() };
        let ddp = comm.map(|pg| Ddp::new(named, pg, opts)).transpose()?;
        let autocast = match precision {
            "f16" => Some(candle_core::DType::F16),
            "bf16" => Some(candle_core::DType::BF16),
            _ => None,
        };
        anyhow::ensure!(
            autocast.is_none() || !dev.is_cpu(),
            "--precision {precision}: mixed precision runs on a GPU (--device cuda)"
        );
        let scaler = (autocast == Some(candle_core::DType::F16))
            .then(|| tandem::optim::GradScaler::new(tandem::optim::GradScalerConfig::default()))
            .transpose()?;
        Ok(ResNetSteps { model, ddp, opt, autocast, scaler })
    }
}

impl StepLoop for ResNetSteps {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<()> {
        let model = &self.model;
        let logits = tandem::nn::autocast(self.autocast, || model.forward_t(x, true))?;
        let loss =
            tandem::nn::functional::cross_entropy(&logits.to_dtype(candle_core::DType::F32)?, y)?;
        let loss = match &self.scaler {
            Some(s) => s.scale(&loss)?,
            None => loss,
        };
        let mut grads = match &self.ddp {
            Some(ddp) => ddp.backward(&loss)?,
            None => tandem::nn::backward(&loss)?,
        };
        match self.scaler.as_mut() {
            Some(s) => {
                s.unscale_(&self.opt, &mut grads)?;
                s.step(&mut self.opt, &mut grads)?;
                s.update()?;
            }
            None => self.opt.step(&grads)?,
        }
        Ok(())
    }
}

fn batch(kind: ModelKind, n: usize, seed: u64, dev: &Device) -> anyhow::Result<(Tensor, Tensor)> {
    // Drawn on the CPU (the same numbers on any device), then moved.
    let cpu = &Device::Cpu;
    let x = match kind {
        ModelKind::Mlp => Tensor::randn(0f32, 1.0, n * 784, cpu)?.reshape((n, 784))?,
        ModelKind::ResNet18 => Tensor::randn(0f32, 1.0, n * 3072, cpu)?.reshape((n, 3, 32, 32))?,
        ModelKind::Cnn => Tensor::randn(0f32, 1.0, n * 784, cpu)?.reshape((n, 1, 28, 28))?,
        face => anyhow::bail!("{face} is a face backbone: `tandem bench face` runs it"),
    };
    let y = Tensor::from_vec(
        (0..n as u32)
            .map(|i| (i.wrapping_mul(7).wrapping_add(seed as u32)) % 10)
            .collect::<Vec<u32>>(),
        n,
        cpu,
    )?;
    Ok((x.to_device(dev)?, y.to_device(dev)?))
}

/// One training step function, the same for plain and Ddp (Ddp adds its backward).
trait StepLoop {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<()>;
}

struct Plain<M: ParamModule> {
    model: M,
    loss: fn(&M, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    opt: TorchSgd,
}

impl<M: ParamModule> StepLoop for Plain<M> {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<()> {
        let grads = tandem::nn::backward(&(self.loss)(&self.model, x, y)?)?;
        self.opt.step(&grads)?;
        Ok(())
    }
}

struct Wrapped<M: ParamModule> {
    ddp: Ddp<M>,
    loss: fn(&M, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    opt: TorchSgd,
}

impl<M: ParamModule> StepLoop for Wrapped<M> {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<()> {
        let loss = (self.loss)(self.ddp.hooked(), x, y)?;
        let grads = self.ddp.backward(&loss)?;
        self.opt.step(&grads)?;
        Ok(())
    }
}

/// Ddp over the model's Vars as a stock candle model's VarMap holds them: the model reads its
/// own (unhooked) parameters and Ddp reduces the gradients after backward.
struct WrappedVars<M: ParamModule> {
    ddp: Ddp<NamedVars>,
    model: M,
    loss: fn(&M, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    opt: TorchSgd,
}

impl<M: ParamModule> StepLoop for WrappedVars<M> {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<()> {
        let loss = (self.loss)(&self.model, x, y)?;
        let grads = self.ddp.backward(&loss)?;
        self.opt.step(&grads)?;
        Ok(())
    }
}

fn sgd(params: Vec<candle_core::Var>) -> anyhow::Result<TorchSgd> {
    Ok(TorchSgd::new(params, SgdConfig { lr: SGD_LR, ..Default::default() })?)
}

fn trainer(
    args: &Args,
    comm: Option<&tandem::comm::ProcessGroup>,
    dev: &Device,
) -> anyhow::Result<Box<dyn StepLoop>> {
    let (kind, mode) = (args.model, args.mode.as_str());
    if kind == ModelKind::ResNet18 {
        return Ok(Box::new(ResNetSteps::new(args.width, comm, dev, &args.precision)?));
    }
    let opts = DdpOptions::default();
    Ok(match (Net::new(kind, dev)?, comm) {
        (Net::Mlp(m), Some(pg)) if mode == "varmap" => {
            let ddp = Ddp::new(as_varmap(&m), pg, opts)?;
            Box::new(WrappedVars { opt: sgd(ddp.params())?, ddp, model: m, loss: Mlp::loss })
        }
        (Net::Cnn(m), Some(pg)) if mode == "varmap" => {
            let ddp = Ddp::new(as_varmap(&m), pg, opts)?;
            Box::new(WrappedVars { opt: sgd(ddp.params())?, ddp, model: m, loss: Cnn::loss })
        }
        (Net::Mlp(m), None) => Box::new(Plain { opt: sgd(m.params())?, model: m, loss: Mlp::loss }),
        (Net::Cnn(m), None) => Box::new(Plain { opt: sgd(m.params())?, model: m, loss: Cnn::loss }),
        (Net::Mlp(m), Some(pg)) => {
            let ddp = Ddp::new(m, pg, opts)?;
            Box::new(Wrapped { opt: sgd(ddp.params())?, ddp, loss: Mlp::loss })
        }
        (Net::Cnn(m), Some(pg)) => {
            let ddp = Ddp::new(m, pg, opts)?;
            Box::new(Wrapped { opt: sgd(ddp.params())?, ddp, loss: Cnn::loss })
        }
    })
}

/// The model's parameters and buffers as a stock candle model's VarMap would hold them.
fn as_varmap<M: ParamModule>(m: &M) -> NamedVars {
    NamedVars::new(m.named_parameters().into_iter().chain(m.named_buffers()).collect())
}

/// Seconds for `steps` steps (after the warm-up steps). A GPU's queued work is waited for at
/// both ends, so the time is the device's, not only the host's.
fn timed(
    t: &mut dyn StepLoop,
    (x, y): (&Tensor, &Tensor),
    steps: usize,
    sync: &dyn Fn() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    x.device().synchronize()?;
    sync()?;
    let start = Instant::now();
    for _ in 0..steps {
        t.step(x, y)?;
    }
    x.device().synchronize()?;
    sync()?;
    Ok(start.elapsed().as_secs_f64())
}

/// This rank's device for `--device`.
fn device(args: &Args, local_rank: usize) -> anyhow::Result<Device> {
    let location = match args.device.as_str() {
        "cpu" => tandem::ckpt::MapLocation::Cpu,
        _ => tandem::ckpt::MapLocation::Cuda(local_rank),
    };
    tandem::nn::convert::map_location_device(location)
        .with_context(|| format!("--device {} (LOCAL_RANK {local_rank})", args.device))
}

/// One rank of the N-rank run; rank 0 reports the world's samples/s.
pub fn worker(job: Job) -> anyhow::Result<i32> {
    let Job { args, local_only } = job;
    let args = &args;
    let pg = tandem::comm::init().context("worker: initialising the process group")?;
    let per_rank = args.batch / pg.size();
    let dev = device(args, pg.local_rank())?;
    #[cfg(feature = "cuda")]
    if dev.is_cuda() && args.backend == "nccl" && !local_only {
        pg.nccl(pg.local_rank() as i32).context("--backend nccl: making the communicator")?;
    }
    let (x, y) = batch(args.model, per_rank, pg.rank() as u64, &dev)?;
    let mut t = trainer(args, if local_only { None } else { Some(&pg) }, &dev)?;
    for _ in 0..WARMUP {
        t.step(&x, &y)?;
    }
    let barrier = || pg.barrier().map_err(anyhow::Error::from);
    let mut sps = Vec::new();
    for _ in 0..args.rounds {
        let secs = timed(t.as_mut(), (&x, &y), args.steps, &barrier)?;
        sps.push((args.steps * per_rank * pg.size()) as f64 / secs);
    }
    if pg.rank() == 0 {
        emit(&median(sps))?;
    }
    pg.barrier()?;
    Ok(0)
}

/// Plain vs 1-rank Ddp in this process, alternating rounds. Returns (plain, ddp, overhead).
fn single_process(args: &Args) -> anyhow::Result<(f64, f64, f64)> {
    let dev = device(args, 0)?;
    let (x, y) = batch(args.model, args.batch, 0, &dev)?;
    let one = tandem::comm::init_from(&tandem::comm::InitMethod::Single)?;
    let mut plain = trainer(args, None, &dev)?;
    let mut ddp = trainer(args, Some(&one), &dev)?;
    for _ in 0..WARMUP {
        plain.step(&x, &y)?;
        ddp.step(&x, &y)?;
    }
    let none = || Ok(());
    let (mut p, mut d, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        // Alternate which goes first so drift in machine load does not favour either.
        let (tp, td) = if round % 2 == 0 {
            let tp = timed(plain.as_mut(), (&x, &y), args.steps, &none)?;
            (tp, timed(ddp.as_mut(), (&x, &y), args.steps, &none)?)
        } else {
            let td = timed(ddp.as_mut(), (&x, &y), args.steps, &none)?;
            (timed(plain.as_mut(), (&x, &y), args.steps, &none)?, td)
        };
        let n = (args.steps * args.batch) as f64;
        p.push(n / tp);
        d.push(n / td);
        ratio.push(tp / td);
    }
    Ok((median(p), median(d), 1.0 - median(ratio)))
}

/// N ranks: with Ddp, or (`local_only`) each rank training alone on its shard, which bounds
/// what any communication scheme could reach on these cores.
fn distributed(args: &Args, local_only: bool) -> anyhow::Result<f64> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = (cores / args.nproc).max(1);
    let job = Job { args: Args { rounds: 1, ..args.clone() }, local_only };
    let env = [("RAYON_NUM_THREADS", threads.to_string())];
    let rates: Vec<f64> = run_workers(Bench::Ddp, args.nproc, &job, &env, Duration::from_secs(600))
        .with_context(|| format!("the {}-rank Ddp run did not complete", args.nproc))?;
    Ok(rates[0])
}

/// What `tandem bench ddp --json` prints: one line, read back typed by the report.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DdpResult {
    pub model: String,
    pub width: usize,
    pub mode: String,
    pub global_batch: usize,
    pub nproc: usize,
    pub steps: usize,
    pub rounds: usize,
    pub cores: usize,
    pub device: String,
    pub backend: String,
    pub plain_samples_per_s: f64,
    pub ddp1_samples_per_s: f64,
    pub ddp1_overhead: f64,
    #[serde(rename = "ddpN_samples_per_s")]
    pub ddp_n_samples_per_s: f64,
    pub scaling_efficiency: f64,
    #[serde(rename = "localN_samples_per_s")]
    pub local_n_samples_per_s: f64,
    #[serde(rename = "ddpN_over_localN")]
    pub ddp_n_over_local_n: f64,
    pub torch_ddp_samples_per_s: Option<f64>,
    #[serde(rename = "ddpN_over_torch")]
    pub ddp_n_over_torch: Option<f64>,
}

/// One run of the PyTorch DDP peer: its samples/s.
fn torch_peer(args: &Args, python: &PathBuf) -> anyhow::Result<f64> {
    let script = args.torch_script.clone().unwrap_or_else(|| {
        crate::report::repo_root().join(crate::PEERS_DIR).join("torch_ddp_step.py")
    });
    let out = Command::new(python)
        .arg(&script)
        .args([
            args.nproc.to_string(),
            args.steps.to_string(),
            (args.batch / args.nproc).to_string(),
            args.model.name().to_string(),
            args.width.to_string(),
            args.device.clone(),
            args.precision.clone(),
        ])
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("samples/s=").and_then(|v| v.parse::<f64>().ok()))
        .with_context(|| format!("{}: no samples/s in its output: {text:?}", script.display()))
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.model.is_face() {
        bail!("--model {}: a face backbone trains with a PartialFC head; `tandem bench face` measures that recipe", args.model);
    }
    // The ResNet is a VarMap model: it always runs the varmap way.
    let mode = if args.model == ModelKind::ResNet18 { "varmap" } else { args.mode.as_str() };
    if args.nproc == 0 || args.batch == 0 || args.steps == 0 || args.rounds == 0 {
        bail!("--nproc, --batch, --steps and --rounds must be at least 1");
    }
    if !args.batch.is_multiple_of(args.nproc) {
        bail!("--batch {} is not divisible by --nproc {}", args.batch, args.nproc);
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let (plain, ddp1, overhead) = single_process(&args)?;
    // Multi-process measurements interleaved round by round (Ddp, no-communication bound,
    // torch), so slow drift in machine load hits all of them alike; ratios are medians of
    // per-round ratios.
    let (mut dn, mut ln, mut tn) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        dn.push(distributed(&args, false)?);
        ln.push(distributed(&args, true)?);
        if let Some(py) = &args.torch {
            tn.push(torch_peer(&args, py)?);
        }
    }
    let ratio = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(x, y)| x / y).collect());
    let ddp_over_local = ratio(&dn, &ln);
    let ddp_over_torch = (!tn.is_empty()).then(|| ratio(&dn, &tn));
    let (ddp_n, local_n) = (median(dn), median(ln));
    let torch = (!tn.is_empty()).then(|| median(tn));
    let efficiency = ddp_n / plain;
    if args.json {
        let result = DdpResult {
            model: args.model.name().to_string(),
            width: args.width,
            mode: mode.to_string(),
            global_batch: args.batch,
            nproc: args.nproc,
            steps: args.steps,
            rounds: args.rounds,
            cores,
            device: args.device.clone(),
            backend: args.backend.clone(),
            plain_samples_per_s: plain,
            ddp1_samples_per_s: ddp1,
            ddp1_overhead: overhead,
            ddp_n_samples_per_s: ddp_n,
            scaling_efficiency: efficiency,
            local_n_samples_per_s: local_n,
            ddp_n_over_local_n: ddp_over_local,
            torch_ddp_samples_per_s: torch,
            ddp_n_over_torch: ddp_over_torch,
        };
        println!("{}", serde_json::to_string(&result)?);
        return Ok(0);
    }
    let on = match args.device.as_str() {
        "cpu" => "cpu".to_string(),
        _ => format!("cuda, N ranks reduce via {}", args.backend),
    };
    println!(
        "{} (Ddp mode {}) on {on}, global batch {}, {} steps x {} rounds (medians), {} cores, SGD lr {SGD_LR}",
        Net::describe(args.model, args.width),
        mode,
        args.batch,
        args.steps,
        args.rounds,
        cores
    );
    println!("{:<28} {:>5} {:>10} {:>11}  note", "config", "ranks", "batch/rank", "samples/s");
    println!(
        "{:<28} {:>5} {:>10} {:>11.0}  reference",
        "plain (one process)", 1, args.batch, plain
    );
    println!(
        "{:<28} {:>5} {:>10} {:>11.0}  overhead {:+.1}%",
        "tandem Ddp",
        1,
        args.batch,
        ddp1,
        overhead * 100.0
    );
    println!(
        "{:<28} {:>5} {:>10} {:>11.0}  scaling efficiency {:.2} (vs plain, same cores)",
        "tandem Ddp",
        args.nproc,
        args.batch / args.nproc,
        ddp_n,
        efficiency
    );
    println!(
        "{:<28} {:>5} {:>10} {:>11.0}  Ddp reaches {:.2} of this bound",
        "N processes, no all-reduce",
        args.nproc,
        args.batch / args.nproc,
        local_n,
        ddp_over_local
    );
    if let (Some(t), Some(r)) = (torch, ddp_over_torch) {
        println!(
            "{:<28} {:>5} {:>10} {:>11.0}  tandem/torch {:.2} (median of per-round ratios)",
            "torch DDP (gloo)",
            args.nproc,
            args.batch / args.nproc,
            t,
            r
        );
    }
    Ok(0)
}
