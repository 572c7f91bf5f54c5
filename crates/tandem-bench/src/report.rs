//! `tandem bench report`: measures tandem and PyTorch on the same work in one run and writes
//! docs/BENCHMARKS.md with PNG plots. tandem's figures come from this executable's own
//! `tandem bench allreduce|ddp|ckpt` (run as subprocesses), PyTorch's from the peer scripts in
//! `scripts/peers/`; every figure is printed with its in-run reference (memcpy, plain training,
//! dd) and the ratio, plus min/median/max over repeated runs and the machine's load.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;

use crate::ops::Net;

mod child;
mod gpu;
pub(crate) mod machine;
mod markdown;
mod measure;
mod plots;
mod stats;
mod table;
mod torch;

/// min / median / max of repeated measurements (for the benchmarks outside the report).
pub(crate) fn summary(samples: &[f64]) -> Option<stats::Summary> {
    stats::Summary::of(samples)
}

#[derive(clap::Args)]
pub struct Args {
    /// Directory for BENCHMARKS.md and the PNGs (default: <repo>/docs).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Python with torch for the PyTorch columns (default: $TANDEM_PYTHON, else
    /// <repo>/.venv-torch/bin/python). Without torch the report says "PyTorch not available".
    #[arg(long)]
    python: Option<PathBuf>,
    /// Directory of the PyTorch peer scripts (default: <repo>/scripts/peers).
    #[arg(long)]
    peers: Option<PathBuf>,
    /// A small version for tests: 3 sizes, 2 ranks only, 3 steps, an 8 MiB checkpoint, one run each.
    #[arg(long)]
    quick: bool,
    /// Runs of each measurement (min/median/max are reported). Default 3, or 1 with --quick.
    #[arg(long)]
    repeats: Option<usize>,
    /// Local ranks for all_reduce (tandem and gloo alike).
    #[arg(long, default_value_t = 2)]
    allreduce_nproc: usize,
    /// Measure nothing: write the GPU section of BENCHMARKS.md (and gpu_validate.md) in --out
    /// from the output directory of a `scripts/gpu/validate.sh` run, and its validate.json there.
    #[arg(long, value_name = "DIR")]
    gpu: Option<PathBuf>,
}

/// The repository: the nearest ancestor of the working directory holding crates/tandem, else
/// the checkout this binary was built from.
pub(crate) fn repo_root() -> PathBuf {
    if let Ok(cwd) = std::env::current_dir() {
        if let Some(root) = cwd.ancestors().find(|d| d.join("crates/tandem/Cargo.toml").is_file()) {
            return root.to_path_buf();
        }
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().and_then(Path::parent).unwrap_or(here).to_path_buf()
}

#[allow(clippy::too_many_arguments)]
fn face_plan(
    model: &'static str,
    nproc: usize,
    width: usize,
    embedding: usize,
    classes: Option<usize>,
    sample_rate: f64,
    batch: usize,
    steps: usize,
    rounds: usize,
) -> measure::FacePlan {
    let depth = model.trim_start_matches("iresnet");
    let head = match classes {
        Some(c) => format!(", {c} classes at sample rate {sample_rate}"),
        None => String::new(),
    };
    measure::FacePlan {
        title: format!("IResNet-{depth} width {width}, {embedding}-d, {nproc} rank(s){head}"),
        nproc,
        model,
        width,
        embedding,
        classes,
        sample_rate,
        batch,
        steps,
        rounds,
    }
}

fn workload(
    model: &'static str,
    width: usize,
    ranks: Vec<usize>,
    batch: usize,
    steps: usize,
    rounds: usize,
) -> measure::Workload {
    let title = match model {
        "mlp" => "MLP 784-1024-1024-10".to_string(),
        "cnn" => "Cnn 1x28x28 (conv8-bn-pool-conv16-pool-fc)".to_string(),
        _ => format!("ResNet-18 (CIFAR) width {width}"),
    };
    measure::Workload { model, width: width.max(1), title, ranks, batch, steps, rounds }
}

fn conv_plan(net: Net, width: usize, batch: usize) -> measure::ConvPlan {
    let cli = match net {
        Net::Resnet18 => "resnet18",
        Net::Iresnet18 => "iresnet18",
        Net::VitT => "vit_t",
        Net::Mbf => "mbf",
    };
    measure::ConvPlan { net: cli, title: net.title(), width, batch }
}

fn plan(args: &Args) -> anyhow::Result<measure::Plan> {
    let repeats = args.repeats.unwrap_or(if args.quick { 1 } else { 3 });
    if repeats == 0 {
        anyhow::bail!("--repeats must be at least 1");
    }
    if args.allreduce_nproc < 2 {
        anyhow::bail!("--allreduce-nproc must be at least 2 (busbw of one rank is 0)");
    }
    const K: usize = 1 << 10;
    const M: usize = 1 << 20;
    Ok(if args.quick {
        measure::Plan {
            repeats,
            allreduce_nproc: args.allreduce_nproc,
            allreduce_sizes: vec![4, 4 * K, M],
            seconds_per_size: 0.05,
            ddp: vec![
                workload("mlp", 0, vec![2], 32, 3, 1),
                workload("cnn", 0, vec![2], 16, 2, 1),
                workload("resnet18", 4, vec![2], 8, 1, 1),
            ],
            conv: vec![conv_plan(Net::Resnet18, 4, 4), conv_plan(Net::Iresnet18, 4, 2)],
            conv_repeats: 1,
            ckpt_mib: 8,
            ckpt_tensors: 8,
            stall_mib: 8,
            stall_steps: 4,
            stall_every: 2,
            zero_nproc: vec![2],
            zero_dims: vec![64, 32, 32, 10],
            face: vec![face_plan("iresnet18", 2, 4, 16, None, 1.0, 2, 2, 1)],
        }
    } else {
        measure::Plan {
            repeats,
            allreduce_nproc: args.allreduce_nproc,
            allreduce_sizes: vec![4, 64, K, 16 * K, 256 * K, M, 4 * M, 16 * M, 64 * M],
            seconds_per_size: 0.5,
            ddp: vec![
                workload("mlp", 0, vec![1, 2, 4], 128, 20, 2),
                workload("cnn", 0, vec![1, 2], 128, 10, 2),
                // The convolution-speed targets: widths 16 and 64, batch 32 per rank on 2 ranks.
                workload("resnet18", 16, vec![1, 2], 64, 4, 2),
                workload("resnet18", 64, vec![1, 2], 64, 3, 2),
            ],
            // Every op of both ResNets at the DDP benches' per-rank batches, and of the face
            // backbones at the face benches'.
            conv: vec![
                conv_plan(Net::Resnet18, 16, 32),
                conv_plan(Net::Resnet18, 64, 32),
                conv_plan(Net::Iresnet18, 16, 8),
                conv_plan(Net::VitT, 16, 8),
                conv_plan(Net::Mbf, 16, 16),
            ],
            conv_repeats: 9,
            ckpt_mib: 256,
            ckpt_tensors: 32,
            stall_mib: 256,
            stall_steps: 12,
            stall_every: 4,
            zero_nproc: vec![2, 4],
            zero_dims: vec![784, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 10],
            face: vec![
                // The shape: IResNet-18 at width >= 16 on 2 ranks.
                face_plan("iresnet18", 2, 16, 128, None, 1.0, 8, 12, repeats),
                // One process on both cores (what a world of one sees first).
                face_plan("iresnet18", 1, 16, 128, None, 1.0, 8, 12, repeats),
                // The seed's config: IResNet-50 width 64, 512-d, a million identities at 0.1.
                face_plan("iresnet50", 2, 64, 512, Some(1_000_000), 0.1, 8, 6, repeats),
            ],
        }
    })
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let started = Instant::now();
    let repo = repo_root();
    if let Some(dir) = &args.gpu {
        return gpu::main(dir, &args.out.clone().unwrap_or_else(|| repo.join("docs")));
    }
    let plan = plan(&args)?;
    let out = args.out.clone().unwrap_or_else(|| repo.join("docs"));
    std::fs::create_dir_all(&out).with_context(|| format!("--out: creating {}", out.display()))?;
    let out = out.canonicalize().with_context(|| format!("--out: resolving {}", out.display()))?;
    plots::register_font()?;
    let peers = args.peers.clone().unwrap_or_else(|| repo.join(crate::PEERS_DIR));

    let mut candidates: Vec<PathBuf> = Vec::new();
    candidates.extend(args.python.clone());
    if args.python.is_none() {
        candidates.extend(std::env::var_os("TANDEM_PYTHON").map(PathBuf::from));
        candidates.push(repo.join(".venv-torch/bin/python"));
    }
    // Absolute paths, as some benches run in a scratch directory; not canonicalized, as a venv's
    // python is a symlink that only works under its own name.
    let candidates: Vec<PathBuf> = candidates
        .into_iter()
        .map(|p| if p.components().count() > 1 { std::path::absolute(&p).unwrap_or(p) } else { p })
        .collect();
    let mut torch = torch::find(&candidates);
    if torch.is_ok() && !peers.join("torch_ddp_step.py").is_file() {
        torch = Err(format!(
            "torch found, but the peer scripts are not in {} (--peers)",
            peers.display()
        ));
    }
    match &torch {
        Ok(t) => eprintln!("report: PyTorch {} from {}", t.version, t.python.display()),
        Err(why) => eprintln!("report: {} ({why})", torch::UNAVAILABLE),
    }

    let machine = machine::Machine::probe(&repo);
    let load_before = machine::load_average();
    let scratch = out.join(format!(".bench-report-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let mut ctx = measure::Ctx {
        exe: crate::bench_exe()?,
        torch,
        peers,
        scratch: scratch.clone(),
        failures: Vec::new(),
        retries: Vec::new(),
    };
    let allreduce = measure::allreduce(&mut ctx, &plan);
    let collectives = measure::collectives(&mut ctx, &plan);
    let ddp: Vec<(measure::Workload, table::Table)> =
        plan.ddp.iter().map(|w| (w.clone(), measure::ddp(&mut ctx, plan.repeats, w))).collect();
    let conv_ops: Vec<(measure::ConvPlan, Result<crate::ops::ConvResults, String>)> = plan
        .conv
        .iter()
        .map(|c| (c.clone(), measure::conv_ops(&mut ctx, c, plan.conv_repeats)))
        .collect();
    let ckpt = measure::ckpt(&mut ctx, &plan);
    let save_stall = measure::save_stall(&mut ctx, &plan);
    let zero = measure::zero(&mut ctx, &plan);
    let face: Vec<(String, Result<crate::face::FaceResults, String>)> =
        plan.face.iter().map(|f| (f.title.clone(), measure::face(&mut ctx, f))).collect();
    let face_scale = std::fs::read_to_string(out.join("face_scale.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<crate::face_scale::Results>(&t).ok());
    std::fs::remove_dir_all(&scratch).ok();
    let load_after = machine::load_average();

    let report = markdown::Report {
        machine: &machine,
        load_before,
        load_after,
        torch: ctx
            .torch
            .as_ref()
            .map(|t| (t.version.clone(), t.python.display().to_string()))
            .map_err(Clone::clone),
        release_build: !cfg!(debug_assertions),
        repeats: plan.repeats,
        quick: args.quick,
        wall_s: started.elapsed().as_secs_f64(),
        allreduce_nproc: plan.allreduce_nproc,
        allreduce: &allreduce,
        collectives: &collectives,
        ddp: &ddp,
        conv_ops: &conv_ops,
        ckpt: &ckpt,
        ckpt_mib: plan.ckpt_mib,
        save_stall: &save_stall,
        zero: &zero,
        face: &face,
        face_scale: face_scale.as_ref(),
        failures: &ctx.failures,
        retries: &ctx.retries,
        several_hosts: std::fs::read_to_string(out.join("bench_two_hosts.md")).ok(),
        conv_before_after: std::fs::read_to_string(out.join("bench_conv_before_after.md")).ok(),
        gpu: std::fs::read_to_string(out.join(gpu::SECTION_FILE)).ok().map(|s| gpu::wrapped(&s)),
    };
    let md = out.join("BENCHMARKS.md");
    std::fs::write(&md, markdown::render(&report))
        .with_context(|| format!("writing {}", md.display()))?;
    plots::allreduce(&allreduce, plan.allreduce_nproc, &out.join("allreduce_busbw.png"))?;
    for (w, t) in &ddp {
        plots::ddp(t, &w.title, &out.join(markdown::ddp_plot_name(w)))?;
    }
    plots::ckpt(&ckpt, &out.join("ckpt_throughput.png"))?;
    if let Some(r) = &face_scale {
        plots::face_scale(
            r,
            plots::FaceScaleAxis::SamplesPerS,
            &out.join("face_scale_samples_per_s.png"),
        )?;
        plots::face_scale(r, plots::FaceScaleAxis::PeakGiB, &out.join("face_scale_memory.png"))?;
    }
    println!(
        "wrote {} and {} plots in {:.0} s",
        md.display(),
        2 + ddp.len(),
        started.elapsed().as_secs_f64()
    );
    if ctx.failures.is_empty() {
        Ok(0)
    } else {
        eprintln!(
            "report: {} measurement(s) failed; see the Failures section of {}",
            ctx.failures.len(),
            md.display()
        );
        Ok(1)
    }
}
