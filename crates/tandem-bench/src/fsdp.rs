//! `tandem bench fsdp`: peak memory and throughput of a model trained under tandem's `Fsdp`
//! against the same model under tandem's `Ddp` and under PyTorch FSDP2 (`fully_shard` per
//! block, then the root; gloo), all measured in this run on this host. The model is
//! arcface_torch's ViT (`--model vit_l`: 255.7 M parameters) with AdamW, synthetic 112x112
//! images and the mean square of the embedding as the loss; a unit per block and one for the
//! head (the final norm and the feature head).
//!
//! Fsdp runs twice: with FSDP2's defaults (a unit's activations kept from its forward to its
//! backward, as the PyTorch run keeps them) and with activation checkpointing per unit (no
//! activations kept inside a unit, each recomputed in backward: less memory, one more forward).
//!
//! Each mode runs `--nproc` local ranks for `--steps` timed steps after one warm-up step; a
//! rank's peak RSS is its `VmHWM` at the end. Fsdp's ranks release freed memory
//! (`tandem::release_freed_memory`), as `tandem train --fsdp` does; Ddp's keep it for reuse.
//! The last line (with `--json`) is one JSON object: `peak_rss_over_ddp` (largest Fsdp rank
//! over largest Ddp rank), `samples_per_s_over_torch`, `samples_per_s_over_ddp` (FSDP2's
//! defaults), the same three under `activation_checkpointing`, and the figures they come from.
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use serde::Serialize;
use tandem::ddp::{Ddp, DdpOptions};
use tandem::fsdp::{Fsdp, FsdpOptions, MetaVarMap, Units};
use tandem::models::{ModelKind, Vit, VitConfig};
use tandem::nn::ParamModule;
use tandem::optim::{AdamWConfig, TorchAdamW};

use super::local_ranks::{emit_from_every_rank, median, results, run_workers, Bench};

#[derive(clap::Args)]
pub struct Args {
    /// arcface_torch's ViT: vit_t, vit_s, vit_b or vit_l.
    #[arg(long, default_value = "vit_l")]
    model: String,
    /// Ranks of each run.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Images per rank per step.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Python with torch for the FSDP2 run (default: $TANDEM_PYTHON, ./.venv-torch/bin/python,
    /// python3); without one the torch figures are left out, said so.
    #[arg(long)]
    python: Option<std::path::PathBuf>,
    /// End with the figures as one JSON line.
    #[arg(long)]
    json: bool,
}

/// How a run holds the model.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Mode {
    Ddp,
    Fsdp,
    /// Fsdp with activation checkpointing per unit.
    FsdpAc,
}

/// What a worker rank runs.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Job {
    mode: Mode,
    model: String,
    batch: usize,
    steps: usize,
}

/// One rank's figures (each rank's, from tandem's workers and from the PyTorch peer alike);
/// `phases`: median seconds per step of forward, backward, optimizer and (Fsdp) the waits for
/// the all-gathers and the reduce-scatters, tandem's only.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct RankRow {
    rank: usize,
    peak_rss: u64,
    step_secs: f64,
    #[serde(default)]
    phases: Option<[f64; 5]>,
}

const EMBEDDING: usize = 512;

/// arcface_torch's ViT of `name` (tandem-models' names and arcface_torch's aliases).
fn config(name: &str) -> anyhow::Result<VitConfig> {
    let kind: ModelKind = name.parse().with_context(|| format!("--model {name}"))?;
    kind.vit().with_context(|| format!("--model {name}: not one of arcface_torch's ViTs"))
}

/// One rank of `job.mode`; rank 0 reports every rank's [`RankRow`].
pub fn worker(job: Job) -> anyhow::Result<i32> {
    let pg = tandem::comm::init().context("worker init")?;
    let sharded = job.mode != Mode::Ddp;
    if sharded {
        tandem::release_freed_memory(); // as `tandem train --fsdp` does
    }
    let cfg = config(&job.model)?;
    // Ddp's model is built whole; Fsdp's on meta (no rank holds it whole, as for a model
    // larger than one rank), each rank drawing its rows when it is sharded.
    let (varmap, meta) = (VarMap::new(), MetaVarMap::new(0));
    let vb = if sharded {
        meta.var_builder()
    } else {
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)
    };
    let mut vit = Vit::new(cfg, EMBEDDING, vb)?;
    vit.seed(pg.rank() as u64);
    let adamw = AdamWConfig { lr: 1e-4, ..Default::default() };
    let x = Tensor::randn(0f32, 1.0, (job.batch, 3, 112, 112), &Device::Cpu)?;
    // Per timed step: forward, backward, optimizer step, and (Fsdp) the waits for collectives.
    let mut phases: Vec<[f64; 5]> = Vec::new();
    let mut timed =
        |i: usize, f: &mut dyn FnMut() -> anyhow::Result<[f64; 5]>| -> anyhow::Result<()> {
            let p = f()?;
            if i > 0 {
                phases.push(p);
            }
            Ok(())
        };
    let clock = Instant::now;
    match job.mode {
        Mode::Ddp => {
            let ddp = Ddp::from_varmap(&varmap, &pg, DdpOptions::default())?;
            let mut opt =
                TorchAdamW::new(tandem::nn::NamedVars::from_varmap(&varmap).params(), adamw)?;
            for i in 0..=job.steps {
                timed(i, &mut || {
                    let t = clock();
                    let loss = vit.forward_t(&x, true)?.sqr()?.mean_all()?;
                    let fwd = t.elapsed().as_secs_f64();
                    let grads = ddp.backward(&loss)?;
                    let bwd = t.elapsed().as_secs_f64() - fwd;
                    opt.step(&grads)?;
                    Ok([fwd, bwd, t.elapsed().as_secs_f64() - fwd - bwd, 0.0, 0.0])
                })?;
            }
        }
        Mode::Fsdp | Mode::FsdpAc => {
            let opts = FsdpOptions {
                units: Units::by_name(Vit::unit_of), // a unit per block, and the head
                activation_checkpointing: job.mode == Mode::FsdpAc,
                ..Default::default()
            };
            let fsdp = Fsdp::from_meta(&meta, &pg, opts)?;
            let runner = fsdp.clone();
            vit.run_blocks_with(Arc::new(move |name, x, f| {
                runner.run_unit(name, x, move |x| f(x)).map_err(candle_core::Error::wrap)
            }));
            let mut opt = TorchAdamW::new(fsdp.params(), adamw)?;
            for i in 0..=job.steps {
                timed(i, &mut || {
                    fsdp.take_comm_stats();
                    let t = clock();
                    let loss = fsdp.forward(|| vit.forward_t(&x, true)?.sqr()?.mean_all())?;
                    let fwd = t.elapsed().as_secs_f64();
                    let grads = fsdp.backward(&loss)?;
                    let bwd = t.elapsed().as_secs_f64() - fwd;
                    opt.step(&grads)?;
                    let c = fsdp.take_comm_stats();
                    let step = t.elapsed().as_secs_f64() - fwd - bwd;
                    Ok([fwd, bwd, step, c.all_gather_wait_secs, c.reduce_wait_secs])
                })?;
            }
        }
    }
    let total: Vec<f64> = phases.iter().map(|p| p[0] + p[1] + p[2]).collect();
    let phase = |k: usize| median(phases.iter().map(|p| p[k]).collect());
    let row = RankRow {
        rank: pg.rank(),
        peak_rss: tandem::comm::procfs::peak_rss().unwrap_or(0),
        step_secs: median(total),
        phases: Some([phase(0), phase(1), phase(2), phase(3), phase(4)]),
    };
    emit_from_every_rank(&pg, &row)?;
    Ok(0)
}

/// What one run measured: each rank's peak RSS (bytes), the slowest rank's median step time,
/// and rank 0's median phases (tandem's runs).
#[derive(Serialize)]
struct Run {
    peak_rss: Vec<u64>,
    step_secs: f64,
    samples_per_s: f64,
    phases: Option<Phases>,
}

/// Median seconds per step of each phase on rank 0; the waits are the parts of forward and
/// backward spent waiting for collectives that compute did not hide (Fsdp's; 0 for Ddp, whose
/// all-reduce waits are inside its backward).
#[derive(Serialize)]
struct Phases {
    forward: f64,
    backward: f64,
    optimizer: f64,
    all_gather_wait: f64,
    reduce_scatter_wait: f64,
}

/// One run from its ranks' rows.
fn run_of(mut rows: Vec<RankRow>, nproc: usize, batch: usize, what: &str) -> anyhow::Result<Run> {
    if rows.len() != nproc {
        bail!("{what}: {} of {nproc} ranks reported", rows.len());
    }
    rows.sort_by_key(|r| r.rank);
    let step_secs = rows.iter().map(|r| r.step_secs).fold(0.0, f64::max);
    let phases = rows[0].phases.map(|[forward, backward, optimizer, ag, rs]| Phases {
        forward,
        backward,
        optimizer,
        all_gather_wait: ag,
        reduce_scatter_wait: rs,
    });
    Ok(Run {
        peak_rss: rows.iter().map(|r| r.peak_rss).collect(),
        step_secs,
        samples_per_s: (nproc * batch) as f64 / step_secs,
        phases,
    })
}

fn tandem_run(args: &Args, mode: Mode) -> anyhow::Result<Run> {
    let job = Job { mode, model: args.model.clone(), batch: args.batch, steps: args.steps };
    let rows = run_workers(Bench::Fsdp, args.nproc, &job, &[], Duration::from_secs(3600))?;
    run_of(rows, args.nproc, args.batch, &format!("{mode:?}"))
}

fn torch_run(args: &Args, python: &std::path::Path) -> anyhow::Result<Run> {
    let script = std::path::Path::new(crate::PEERS_DIR).join("torch_fsdp_vit.py");
    let out = Command::new(python)
        .arg(&script)
        .args(["--model", &args.model, "--nproc", &args.nproc.to_string()])
        .args(["--steps", &args.steps.to_string(), "--batch", &args.batch.to_string()])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
    let rows = results(&String::from_utf8_lossy(&out.stdout), "torch FSDP2")?;
    run_of(rows, args.nproc, args.batch, "torch FSDP2")
}

/// One Fsdp run against the references.
#[derive(Serialize)]
struct Ratios {
    peak_rss_over_ddp: f64,
    samples_per_s_over_ddp: f64,
    samples_per_s_over_torch: Option<f64>,
}

impl Ratios {
    fn of(fsdp: &Run, ddp: &Run, torch: Option<&Run>) -> Ratios {
        let max = |r: &Run| r.peak_rss.iter().copied().max().unwrap_or(0) as f64;
        Ratios {
            peak_rss_over_ddp: max(fsdp) / max(ddp),
            samples_per_s_over_ddp: fsdp.samples_per_s / ddp.samples_per_s,
            samples_per_s_over_torch: torch.map(|t| fsdp.samples_per_s / t.samples_per_s),
        }
    }

    fn line(&self, what: &str) -> String {
        format!(
            "{what} over Ddp: peak RSS {:.3}x, samples/s {:.3}x; over torch FSDP2: samples/s {}",
            self.peak_rss_over_ddp,
            self.samples_per_s_over_ddp,
            self.samples_per_s_over_torch.map_or("-".into(), |r| format!("{r:.3}x"))
        )
    }
}

#[derive(Serialize)]
struct Summary<'a> {
    model: &'a str,
    parameters: usize,
    nproc: usize,
    batch_per_rank: usize,
    cpu: String,
    ddp: Run,
    fsdp: Run,
    fsdp_activation_checkpointing: Run,
    torch_fsdp2: Option<Run>,
    #[serde(flatten)]
    ratios: Ratios,
    activation_checkpointing: Ratios,
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.nproc == 0 || args.steps == 0 || args.batch == 0 {
        bail!("--nproc, --steps and --batch must be at least 1");
    }
    let cfg = config(&args.model)?;
    let parameters = {
        let varmap = VarMap::new();
        Vit::new(cfg, EMBEDDING, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
        tandem::nn::NamedVars::from_varmap(&varmap).params().iter().map(|v| v.elem_count()).sum()
    };
    let cpu = super::report::machine::host_cpu();
    println!(
        "{} ({:.1} M parameters), AdamW, {} ranks x {} images; {cpu}",
        args.model,
        parameters as f64 / 1e6,
        args.nproc,
        args.batch
    );
    let ddp = tandem_run(&args, Mode::Ddp)?;
    let fsdp = tandem_run(&args, Mode::Fsdp)?;
    let fsdp_ac = tandem_run(&args, Mode::FsdpAc)?;
    let torch = match crate::ckpt::find_python(args.python.clone()) {
        Some(python) => Some(torch_run(&args, &python)?),
        None => {
            println!("torch FSDP2: skipped, no Python with torch (--python, $TANDEM_PYTHON or ./.venv-torch)");
            None
        }
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!("{:>14} {:>22} {:>10} {:>10}", "run", "peak RSS GiB per rank", "step s", "samples/s");
    let runs = [
        ("tandem Ddp", Some(&ddp)),
        ("tandem Fsdp", Some(&fsdp)),
        ("Fsdp+AC", Some(&fsdp_ac)),
        ("torch FSDP2", torch.as_ref()),
    ];
    for (name, run) in runs {
        let Some(run) = run else { continue };
        let rss: Vec<String> = run.peak_rss.iter().map(|&b| format!("{:.2}", gib(b))).collect();
        println!(
            "{name:>14} {:>22} {:>10.2} {:>10.2}",
            rss.join(" "),
            run.step_secs,
            run.samples_per_s
        );
    }
    println!("rank 0's median phases, s: forward / backward / optimizer (all-gather wait, reduce-scatter wait)");
    for (name, run) in [("tandem Ddp", &ddp), ("tandem Fsdp", &fsdp), ("Fsdp+AC", &fsdp_ac)] {
        if let Some(p) = &run.phases {
            println!(
                "{name:>14} {:.2} / {:.2} / {:.2} ({:.2}, {:.2})",
                p.forward, p.backward, p.optimizer, p.all_gather_wait, p.reduce_scatter_wait
            );
        }
    }
    let summary = Summary {
        model: &args.model,
        parameters,
        nproc: args.nproc,
        batch_per_rank: args.batch,
        cpu,
        ratios: Ratios::of(&fsdp, &ddp, torch.as_ref()),
        activation_checkpointing: Ratios::of(&fsdp_ac, &ddp, torch.as_ref()),
        ddp,
        fsdp,
        fsdp_activation_checkpointing: fsdp_ac,
        torch_fsdp2: torch,
    };
    println!("{}", summary.ratios.line("Fsdp"));
    println!("{}", summary.activation_checkpointing.line("Fsdp with activation checkpointing"));
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(0)
}
