//! The three measurements of the report. Each repeat runs every contender once, one after the
//! other, so a busy phase of the machine hits all of them alike; tandem's figures come from the
//! `tandem bench ...` subcommands of this same executable, PyTorch's from the peer scripts.
use crate::allreduce::AllreduceRow;
use crate::ckpt::CkptRow;
use crate::ddp::DdpResult;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;

use super::child::stdout_of;
use super::stats::Figure;
use super::table::{Row, Table};
use super::torch::{self, Torch, UNAVAILABLE};

/// What to run; `--quick` picks a small one.
/// `tandem bench face` settings.
#[derive(Clone, Debug)]
pub struct FacePlan {
    /// The line the report heads its output with.
    pub title: String,
    pub nproc: usize,
    pub model: &'static str,
    pub width: usize,
    pub embedding: usize,
    /// Rows of the head (None: the data's identities).
    pub classes: Option<usize>,
    pub sample_rate: f64,
    pub batch: usize,
    pub steps: usize,
    pub rounds: usize,
}

/// One `tandem bench ops` table: a network's ops at a width and batch.
#[derive(Clone, Debug)]
pub struct ConvPlan {
    /// `--net` value.
    pub net: &'static str,
    /// How the report names the network (the line `bench ops` starts its table with).
    pub title: &'static str,
    pub width: usize,
    pub batch: usize,
}

pub struct Plan {
    pub repeats: usize,
    pub allreduce_nproc: usize,
    pub allreduce_sizes: Vec<usize>,
    pub seconds_per_size: f64,
    pub ddp: Vec<Workload>,
    /// `tandem bench ops` runs (one table each), and their repetitions per op.
    pub conv: Vec<ConvPlan>,
    pub conv_repeats: usize,
    pub ckpt_mib: usize,
    pub ckpt_tensors: usize,
    /// `tandem bench save-stall` settings: state MiB, steps, a save every N steps.
    pub stall_mib: usize,
    pub stall_steps: usize,
    pub stall_every: usize,
    /// `tandem bench zero` settings: world sizes and MLP layer sizes.
    pub zero_nproc: Vec<usize>,
    pub zero_dims: Vec<usize>,
    pub face: Vec<FacePlan>,
}

/// One model's DDP measurement: `tandem bench ddp --model M [--width W]` at these ranks, and
/// the PyTorch peer on the same model.
#[derive(Clone, Debug)]
pub struct Workload {
    pub model: &'static str,
    pub width: usize,
    /// How the report names the model.
    pub title: String,
    pub ranks: Vec<usize>,
    pub batch: usize,
    pub steps: usize,
    pub rounds: usize,
}

pub struct Ctx {
    pub exe: PathBuf,
    /// Ok: torch found; Err: why not (the report prints it).
    pub torch: Result<Torch, String>,
    pub peers: PathBuf,
    pub scratch: PathBuf,
    /// Every measurement that failed, in words; the report lists them and the command exits 1.
    pub failures: Vec<String>,
    /// PyTorch peer runs that failed once and were run again (the peers use fixed ports and
    /// wait forever when a worker dies, so one bad run is retried rather than lost).
    pub retries: Vec<String>,
}

/// Runs a PyTorch peer measurement, once more if the first try fails.
fn retry_once<T>(
    retries: &mut Vec<String>,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    f().or_else(|e| {
        let first = format!("{e:#}").lines().next().unwrap_or_default().to_string();
        eprintln!("report: {e:#}\nreport: retrying once");
        retries.push(first);
        f()
    })
}

impl Ctx {
    fn tandem(&self, args: &[String], limit: Duration, what: &str) -> anyhow::Result<String> {
        self.tandem_with_env(args, &[], limit, what)
    }
    fn tandem_with_env(
        &self,
        args: &[String],
        env: &[(&str, &str)],
        limit: Duration,
        what: &str,
    ) -> anyhow::Result<String> {
        let mut cmd = Command::new(&self.exe);
        // Run in the scratch directory: `bench ckpt` looks for a Python with torch relative to its
        // working directory when it is given none, which must not happen when torch is unavailable.
        cmd.args(args).current_dir(&self.scratch).envs(env.iter().copied());
        stdout_of(&mut cmd, limit, what)
    }
    fn torch(&self) -> Option<&Torch> {
        self.torch.as_ref().ok()
    }
    fn note(&mut self, e: anyhow::Error) -> String {
        let first = format!("{e:#}").lines().next().unwrap_or_default().to_string();
        eprintln!("report: {e:#}");
        self.failures.push(first.clone());
        format!("failed: {first}")
    }
}

/// `tandem bench save-stall` run here (its typed results), or why it failed.
pub fn save_stall(ctx: &mut Ctx, plan: &Plan) -> Result<crate::save_stall::Results, String> {
    eprintln!("report: checkpoint save stall, {} MiB of state", plan.stall_mib);
    let args = crate::save_stall::Args {
        size_mib: plan.stall_mib,
        steps: plan.stall_steps,
        save_every: plan.stall_every,
        repeat: plan.repeats,
        dir: Some(ctx.scratch.join("save-stall")),
        face: false,
        classes: 0,
        embedding: 0,
    };
    let results = crate::save_stall::measure(&args);
    if let Some(dir) = &args.dir {
        std::fs::remove_dir_all(dir).ok();
    }
    results.map_err(|e| ctx.note(e))
}

/// `tandem bench zero` run here (its typed results), or why it failed.
pub fn zero(ctx: &mut Ctx, plan: &Plan) -> Result<crate::zero::Results, String> {
    eprintln!("report: ZeRO-1 optimizer state per rank, ranks {:?}", plan.zero_nproc);
    let job = crate::zero::Job { dims: plan.zero_dims.clone(), steps: crate::zero::STEPS };
    crate::zero::measure(&plan.zero_nproc, &job).map_err(|e| ctx.note(e))
}

/// A `tandem bench ...` child (its own process: a deadline, and thread settings of its own)
/// that writes its typed results with `--json FILE`; the results, read back.
fn tandem_json<T: serde::de::DeserializeOwned>(
    ctx: &Ctx,
    mut args: Vec<String>,
    env: &[(&str, &str)],
    limit: Duration,
    what: &str,
) -> anyhow::Result<T> {
    let file = ctx.scratch.join(format!("{}.json", what.replace(' ', "-")));
    args.extend(["--json".into(), file.display().to_string()]);
    ctx.tandem_with_env(&args, env, limit, what)?;
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("{what} wrote no {}", file.display()))?;
    std::fs::remove_file(&file).ok();
    serde_json::from_str(&text).with_context(|| format!("{what}: {}", file.display()))
}

/// `tandem bench face`: the face recipe against the PyTorch peer (typed), or why it was not
/// measured.
pub fn face(ctx: &mut Ctx, plan: &FacePlan) -> Result<crate::face::FaceResults, String> {
    let Some(python) = ctx.torch().map(|t| t.python.display().to_string()) else {
        return Err("PyTorch not available (the recipe is measured against it)".into());
    };
    eprintln!("report: the face recipe, {}, {} rounds", plan.title, plan.rounds);
    let n = |v: usize| v.to_string();
    let mut args: Vec<String> = vec![
        "face".into(),
        "--nproc".into(),
        n(plan.nproc),
        "--model".into(),
        plan.model.into(),
        "--sample-rate".into(),
        plan.sample_rate.to_string(),
        "--width".into(),
        n(plan.width),
        "--embedding".into(),
        n(plan.embedding),
        "--batch".into(),
        n(plan.batch),
        "--steps".into(),
        n(plan.steps),
        "--rounds".into(),
        n(plan.rounds),
        "--python".into(),
        python,
    ];
    if let Some(c) = plan.classes {
        args.extend(["--classes".into(), n(c)]);
    }
    let limit = Duration::from_secs(1800);
    tandem_json(ctx, args, &[], limit, "tandem bench face").map_err(|e| ctx.note(e))
}

/// `tandem bench ops` (with the PyTorch peer when torch is available) on one thread, as each
/// rank of the 2-rank DDP runs has: its typed rows, or why it failed.
pub fn conv_ops(
    ctx: &mut Ctx,
    plan: &ConvPlan,
    repeats: usize,
) -> Result<crate::ops::ConvResults, String> {
    let (net, width, batch) = (plan.net, plan.width, plan.batch);
    eprintln!("report: per-op times of {net} at width {width}, batch {batch}");
    let mut args: Vec<String> =
        ["ops", "--net", net, "--width", &width.to_string()].map(String::from).to_vec();
    args.extend(["--batch".to_string(), batch.to_string()]);
    args.extend(["--repeats".to_string(), repeats.to_string()]);
    if let Some(t) = ctx.torch() {
        args.extend(["--torch".to_string(), t.python.display().to_string()]);
    }
    let one_thread = [("RAYON_NUM_THREADS", "1")];
    let limit = Duration::from_secs(900);
    tandem_json(ctx, args, &one_thread, limit, "tandem bench ops").map_err(|e| ctx.note(e))
}

const MIB: usize = 1 << 20;

pub fn size_label(bytes: usize) -> String {
    match bytes {
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= 1024 && b % 1024 == 0 => format!("{} KiB", b / 1024),
        b => format!("{b} B"),
    }
}

/// Why the MPI all_reduce cannot be measured here, if so.
fn mpi_unavailable() -> Option<String> {
    if !cfg!(feature = "mpi") {
        return Some(
            "not measured: built without the `mpi` feature (cargo build --release --features \
             mpi, then tandem bench report)"
                .into(),
        );
    }
    match std::process::Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("not measured: no mpirun on PATH".into()),
    }
}

fn missing_reason(errors: &Option<String>, default: &str) -> String {
    errors.clone().unwrap_or_else(|| default.to_string())
}

/// all_reduce busbw per size: tandem tcp, shm and mpi, gloo, and memcpy (the reference, measured by
/// `tandem bench allreduce` itself before its ranks start).
pub fn allreduce(ctx: &mut Ctx, plan: &Plan) -> Table {
    let sizes = plan.allreduce_sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    let mut bus: BTreeMap<(&str, usize), Vec<f64>> = BTreeMap::new();
    let mut memcpy: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut gloo: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut err: BTreeMap<&str, String> = BTreeMap::new();
    let gloo_sizes: Vec<usize> =
        plan.allreduce_sizes.iter().copied().filter(|s| s % MIB == 0).collect();
    // mpi: the ranks under mpirun with MPI's own all_reduce, where this build and machine
    // have it; otherwise its row says why (not a failure of the report).
    let mut backends = vec!["tcp", "shm"];
    match mpi_unavailable() {
        None => backends.push("mpi"),
        Some(why) => {
            err.insert("mpi", why);
        }
    }
    for rep in 0..plan.repeats {
        for &backend in &backends {
            eprintln!("report: all_reduce {backend}, run {}/{}", rep + 1, plan.repeats);
            let args = bench_allreduce_args(plan, &sizes, backend, "all_reduce");
            match ctx
                .tandem(
                    &args,
                    Duration::from_secs(600),
                    &format!("tandem bench allreduce --backend {backend}"),
                )
                .and_then(|o| crate::json_lines::<AllreduceRow>(&o, "bench allreduce"))
            {
                Ok(rows) => {
                    for r in rows {
                        bus.entry((backend, r.size_bytes)).or_default().push(r.busbw_gbs);
                        memcpy.entry(r.size_bytes).or_default().push(r.memcpy_gbs);
                    }
                }
                Err(e) => {
                    let why = ctx.note(e);
                    err.entry(backend).or_insert(why);
                }
            }
        }
        if let Some(t) = ctx.torch() {
            let (python, version) = (t.python.clone(), t.version.clone());
            let t = Torch { python, version };
            for &size in &gloo_sizes {
                eprintln!(
                    "report: all_reduce gloo {}, run {}/{}",
                    size_label(size),
                    rep + 1,
                    plan.repeats
                );
                // About half a second of all_reduce at gloo's usual ~1 GB/s.
                let iters = ((0.5e9 / size as f64) as usize).clamp(5, 200);
                let peers = ctx.peers.clone();
                match retry_once(&mut ctx.retries, || {
                    torch::gloo_busbw(&t, &peers, plan.allreduce_nproc, size / MIB, iters)
                }) {
                    Ok(v) => gloo.entry(size).or_default().push(v),
                    Err(e) => {
                        let why = ctx.note(e);
                        err.entry("gloo").or_insert(why);
                    }
                }
            }
        }
    }
    let torch_missing = match &ctx.torch {
        Ok(_) => None,
        Err(_) => Some(UNAVAILABLE.to_string()),
    };
    let mut rows = Vec::new();
    for &size in &plan.allreduce_sizes {
        let reference = memcpy
            .get(&size)
            .map(|v| Figure::from_samples(v, String::new))
            .and_then(|f| f.median());
        let gloo_fig = match (&torch_missing, gloo.get(&size)) {
            (Some(why), _) => Figure::Missing(why.clone()),
            (None, Some(v)) => Figure::from_samples(v, String::new),
            (None, None) if size % MIB != 0 => {
                Figure::Missing("not measured (the gloo peer takes whole MiB)".into())
            }
            (None, None) => Figure::Missing(missing_reason(&err.get("gloo").cloned(), "failed")),
        };
        let torch = gloo_fig.median();
        let row = |contender: &str, figure: Figure, torch: Option<f64>| Row {
            x: size as f64,
            case: size_label(size),
            contender: contender.into(),
            figure,
            reference,
            torch,
        };
        let memcpy_fig =
            Figure::from_samples(memcpy.get(&size).map(Vec::as_slice).unwrap_or(&[]), || {
                "failed (no run completed)".into()
            });
        let tcp =
            Figure::from_samples(bus.get(&("tcp", size)).map(Vec::as_slice).unwrap_or(&[]), || {
                missing_reason(&err.get("tcp").cloned(), "failed")
            });
        let shm =
            Figure::from_samples(bus.get(&("shm", size)).map(Vec::as_slice).unwrap_or(&[]), || {
                missing_reason(&err.get("shm").cloned(), "failed")
            });
        let mpi =
            Figure::from_samples(bus.get(&("mpi", size)).map(Vec::as_slice).unwrap_or(&[]), || {
                missing_reason(&err.get("mpi").cloned(), "failed")
            });
        let r = [
            row("memcpy", memcpy_fig, None),
            row("tandem tcp", tcp, torch),
            row("tandem shm", shm, torch),
            row("tandem mpi (OpenMPI's all_reduce)", mpi, torch),
            row("gloo (PyTorch)", gloo_fig, None),
        ];
        rows.extend(r);
    }
    Table { unit: "busbw GB/s", reference_name: "memcpy", rows }
}

/// `tandem bench allreduce` for the report: `ops` at the plan's sizes on `backend`, as JSON.
fn bench_allreduce_args(plan: &Plan, sizes: &str, backend: &str, ops: &str) -> Vec<String> {
    [
        "allreduce",
        "--nproc",
        &plan.allreduce_nproc.to_string(),
        "--sizes",
        sizes,
        "--backend",
        backend,
        "--ops",
        ops,
        "--json",
        "--seconds-per-size",
        &plan.seconds_per_size.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// The collectives past all_reduce that `tandem bench allreduce --ops` measures.
pub const SPLIT_COLLECTIVES: [&str; 2] = ["reduce_scatter", "all_to_all"];

/// reduce_scatter and all_to_all busbw per size: tandem tcp and shm, and PyTorch gloo measured by
/// the tcp run itself (`--torch`, the same sizes, warm-up and timing), against memcpy.
pub fn collectives(ctx: &mut Ctx, plan: &Plan) -> Table {
    let sizes = plan.allreduce_sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
    // (backend or "gloo", op, size) -> busbw runs; (op, size) -> memcpy runs.
    let mut bus: BTreeMap<(&str, String, usize), Vec<f64>> = BTreeMap::new();
    let mut memcpy: BTreeMap<(String, usize), Vec<f64>> = BTreeMap::new();
    let mut err: BTreeMap<&str, String> = BTreeMap::new();
    let python = ctx.torch().map(|t| t.python.display().to_string());
    for rep in 0..plan.repeats {
        for backend in ["tcp", "shm"] {
            eprintln!(
                "report: reduce_scatter, all_to_all {backend}, run {}/{}",
                rep + 1,
                plan.repeats
            );
            let mut args =
                bench_allreduce_args(plan, &sizes, backend, &SPLIT_COLLECTIVES.join(","));
            if let (Some(py), "tcp") = (&python, backend) {
                args.extend(["--torch".to_string(), py.clone()]);
            }
            let what = format!(
                "tandem bench allreduce --ops reduce_scatter,all_to_all --backend {backend}"
            );
            match ctx
                .tandem(&args, Duration::from_secs(900), &what)
                .and_then(|o| crate::json_lines::<AllreduceRow>(&o, "bench allreduce"))
            {
                Ok(rows) => {
                    for r in rows {
                        let (op, size) = (r.op, r.size_bytes);
                        bus.entry((backend, op.clone(), size)).or_default().push(r.busbw_gbs);
                        memcpy.entry((op.clone(), size)).or_default().push(r.memcpy_gbs);
                        if let Some(g) = r.gloo_busbw_gbs {
                            bus.entry(("gloo", op, size)).or_default().push(g);
                        }
                    }
                }
                Err(e) => {
                    let why = ctx.note(e);
                    err.entry(backend).or_insert(why.clone());
                    if backend == "tcp" {
                        err.entry("gloo").or_insert(why);
                    }
                }
            }
        }
    }
    let torch_missing = ctx.torch().is_none().then(|| UNAVAILABLE.to_string());
    let mut rows = Vec::new();
    let mut cases: Vec<(String, usize)> = memcpy.keys().cloned().collect();
    cases.sort_by_key(|(op, size)| (SPLIT_COLLECTIVES.iter().position(|o| o == op), *size));
    for (op, size) in cases {
        let samples = |who: &str| bus.get(&(who, op.clone(), size)).cloned().unwrap_or_default();
        let fig = |who: &str| {
            let why = match (who, &torch_missing) {
                ("gloo", Some(why)) => why.clone(),
                _ => missing_reason(&err.get(who).cloned(), "failed"),
            };
            Figure::from_samples(&samples(who), || why)
        };
        let reference = Figure::from_samples(&memcpy[&(op.clone(), size)], String::new).median();
        let torch = fig("gloo").median();
        let case = format!("{op} {}", size_label(size));
        let row = |contender: &str, figure: Figure, torch: Option<f64>| Row {
            x: size as f64,
            case: case.clone(),
            contender: contender.into(),
            figure,
            reference,
            torch,
        };
        rows.extend([
            row("tandem tcp", fig("tcp"), torch),
            row("tandem shm", fig("shm"), torch),
            row("gloo (PyTorch)", fig("gloo"), None),
        ]);
    }
    Table { unit: "busbw GB/s", reference_name: "memcpy", rows }
}

/// DDP training samples/s: plain single-process training (the reference, measured by every
/// `tandem bench ddp` run), tandem Ddp and PyTorch DDP with 1, 2, 4 ranks on the same global batch.
pub fn ddp(ctx: &mut Ctx, repeats: usize, w: &Workload) -> Table {
    let mut plain = Vec::new();
    let mut tandem: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut pytorch: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut err: BTreeMap<(&str, usize), String> = BTreeMap::new();
    for rep in 0..repeats {
        for &n in &w.ranks {
            eprintln!("report: DDP {} with {n} rank(s), run {}/{repeats}", w.title, rep + 1);
            let args = [
                "ddp",
                "--nproc",
                &n.to_string(),
                "--model",
                w.model,
                "--width",
                &w.width.to_string(),
                "--batch",
                &w.batch.to_string(),
                "--steps",
                &w.steps.to_string(),
                "--rounds",
                &w.rounds.to_string(),
                "--json",
            ]
            .map(String::from);
            let parsed = ctx
                .tandem(&args, Duration::from_secs(900), &format!("tandem bench ddp --nproc {n}"))
                .and_then(|o| crate::json_lines::<DdpResult>(&o, "bench ddp"))
                .map(|rows| {
                    let r = &rows[rows.len() - 1];
                    (r.plain_samples_per_s, r.ddp_n_samples_per_s)
                });
            match parsed {
                Ok((p, d)) => {
                    plain.push(p);
                    tandem.entry(n).or_default().push(d);
                }
                Err(e) => {
                    let why = ctx.note(e);
                    err.entry(("tandem", n)).or_insert(why);
                }
            }
            if let Some(t) = ctx.torch() {
                let t = Torch { python: t.python.clone(), version: t.version.clone() };
                let peers = ctx.peers.clone();
                match retry_once(&mut ctx.retries, || {
                    torch::ddp_samples_per_s(
                        &t,
                        &peers,
                        (n, w.steps, w.batch / n),
                        (w.model, w.width),
                    )
                }) {
                    Ok(v) => pytorch.entry(n).or_default().push(v),
                    Err(e) => {
                        let why = ctx.note(e);
                        err.entry(("torch", n)).or_insert(why);
                    }
                }
            }
        }
    }
    let plain_fig = Figure::from_samples(&plain, || "failed (no run completed)".into());
    let reference = plain_fig.median();
    let mut rows = vec![Row {
        x: 0.0,
        case: "1 process".into(),
        contender: "plain (no Ddp)".into(),
        figure: plain_fig,
        reference,
        torch: None,
    }];
    for &n in &w.ranks {
        let torch_fig = match &ctx.torch {
            Err(_) => Figure::Missing(UNAVAILABLE.into()),
            Ok(_) => {
                Figure::from_samples(pytorch.get(&n).map(Vec::as_slice).unwrap_or(&[]), || {
                    missing_reason(&err.get(&("torch", n)).cloned(), "failed")
                })
            }
        };
        let tandem_fig =
            Figure::from_samples(tandem.get(&n).map(Vec::as_slice).unwrap_or(&[]), || {
                missing_reason(&err.get(&("tandem", n)).cloned(), "failed")
            });
        let torch = torch_fig.median();
        let case = format!("{n} rank{}", if n == 1 { "" } else { "s" });
        rows.push(Row {
            x: n as f64,
            case: case.clone(),
            contender: "tandem Ddp".into(),
            figure: tandem_fig,
            reference,
            torch,
        });
        rows.push(Row {
            x: n as f64,
            case,
            contender: "PyTorch DDP (gloo)".into(),
            figure: torch_fig,
            reference,
            torch: None,
        });
    }
    Table { unit: "samples/s", reference_name: "plain", rows }
}

const CKPT_ROWS: [(&str, &str, &str); 12] = [
    // (name printed by `tandem bench ckpt`, case, contender in the report)
    ("dd conv=fsync (write)", "save", "dd conv=fsync (write)"),
    ("tandem save .pt", "save", "tandem .pt"),
    ("tandem save .safetensors", "save", "tandem safetensors"),
    ("torch.save + fsync", "save", "torch.save + fsync"),
    (DD_READ, "load", DD_READ),
    ("fresh memory (first touch)", "load", "fresh memory (first touch)"),
    ("tandem load .pt (read)", "load", "tandem .pt (read)"),
    ("torch.load (read)", "load", "torch.load (read)"),
    ("tandem load .pt (read, memory reused)", "load", "tandem .pt (read, memory reused)"),
    ("tandem load .pt (mmap)", "load", "tandem .pt (mmap)"),
    ("tandem load .safetensors", "load", "tandem safetensors"),
    ("torch.load(mmap=True)", "load", "torch.load(mmap=True)"),
];
const DD_READ: &str = "dd (read, warm cache)";

/// Checkpoint save/load GB/s: tandem .pt and safetensors, torch.save / torch.load, and the
/// references dd write (saves) and dd read (loads), all measured by `tandem bench ckpt`.
pub fn ckpt(ctx: &mut Ctx, plan: &Plan) -> Table {
    let mut samples: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut err: Option<String> = None;
    let dir = ctx.scratch.join("ckpt");
    for rep in 0..plan.repeats {
        eprintln!("report: checkpoint {} MiB, run {}/{}", plan.ckpt_mib, rep + 1, plan.repeats);
        let mut args = vec![
            "ckpt".to_string(),
            "--size-mib".into(),
            plan.ckpt_mib.to_string(),
            "--tensors".into(),
            plan.ckpt_tensors.to_string(),
        ];
        args.extend(["--repeat".into(), "1".into(), "--dir".into(), dir.display().to_string()]);
        // One repetition per process: rotate which writer goes first across the runs.
        args.extend(["--first-writer".into(), rep.to_string(), "--json".into()]);
        if let Some(t) = ctx.torch() {
            args.extend(["--python".into(), t.python.display().to_string()]);
        }
        let res = std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating {}", dir.display()))
            .and_then(|_| ctx.tandem(&args, Duration::from_secs(900), "tandem bench ckpt"))
            .and_then(|o| crate::json_lines::<CkptRow>(&o, "bench ckpt"));
        match res {
            Ok(rows) => {
                for r in rows {
                    if let Some((name, _, _)) = CKPT_ROWS.iter().find(|(n, ..)| *n == r.name) {
                        let gbs = r.median_mib_s * MIB as f64 / 1e9;
                        samples.entry(name).or_default().push(gbs);
                    }
                }
            }
            Err(e) => {
                let why = ctx.note(e);
                err.get_or_insert(why);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    let fig = |samples: &BTreeMap<&str, Vec<f64>>, name: &str, torch_row: bool| -> Figure {
        if torch_row && ctx.torch.is_err() {
            return Figure::Missing(UNAVAILABLE.into());
        }
        Figure::from_samples(samples.get(name).map(Vec::as_slice).unwrap_or(&[]), || {
            missing_reason(&err, "failed")
        })
    };
    let med = |name: &str| {
        Figure::from_samples(samples.get(name).map(Vec::as_slice).unwrap_or(&[]), String::new)
            .median()
    };
    let (save_ref, load_ref) = (med("dd conv=fsync (write)"), med(DD_READ));
    // Each tandem row is compared with torch doing the same: a save, a full read, a mapped load.
    let torch_peer = |bench_name: &str| -> Option<f64> {
        let peer = if bench_name.starts_with("tandem save") {
            "torch.save + fsync"
        } else if bench_name.starts_with("tandem load .pt (read") {
            "torch.load (read)"
        } else if bench_name.starts_with("tandem load") {
            "torch.load(mmap=True)"
        } else {
            return None;
        };
        ctx.torch.is_ok().then(|| med(peer)).flatten()
    };
    let rows = CKPT_ROWS
        .iter()
        .enumerate()
        .map(|(i, (bench_name, case, contender))| Row {
            x: i as f64,
            case: case.to_string(),
            contender: contender.to_string(),
            figure: fig(&samples, bench_name, bench_name.starts_with("torch")),
            reference: if *case == "save" { save_ref } else { load_ref },
            torch: torch_peer(bench_name),
        })
        .collect();
    Table { unit: "GB/s", reference_name: "dd", rows }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_bench_allreduce_rows_typed() {
        let row = AllreduceRow {
            op: "all_to_all".into(),
            size_bytes: 16,
            time_s: 1e-5,
            algbw_gbs: 0.4,
            busbw_gbs: 0.5,
            busbw_min_gbs: 0.45,
            busbw_max_gbs: 0.55,
            memcpy_gbs: 2.0,
            busbw_over_memcpy: 0.25,
            gloo_busbw_gbs: Some(0.25),
            nproc: 2,
            transport: "shm".into(),
            runs: 3,
        };
        let out = format!("a header line\n{}\n", serde_json::to_string(&row).unwrap());
        assert_eq!(crate::json_lines::<AllreduceRow>(&out, "x").unwrap(), vec![row]);
        assert!(crate::json_lines::<AllreduceRow>("{\"size_bytes\":4}", "x").is_err());
        assert!(crate::json_lines::<AllreduceRow>("", "x").is_err());
    }

    #[test]
    fn size_labels() {
        assert_eq!(size_label(4), "4 B");
        assert_eq!(size_label(4096), "4 KiB");
        assert_eq!(size_label(64 << 20), "64 MiB");
    }
}
