//! Renders docs/BENCHMARKS.md from the measured tables. Every figure row carries the median of
//! its in-run reference and the ratio of the two medians, so a reader (and the integration test)
//! can re-derive each ratio from the printed numbers.
use std::fmt::Write;

use super::machine::Machine;
use super::measure::{ConvPlan, Workload};
use super::stats::{ratio, sig, Figure};
use super::table::{Row, Table};

pub struct Report<'a> {
    pub machine: &'a Machine,
    pub load_before: String,
    pub load_after: String,
    pub torch: Result<(String, String), String>,
    pub release_build: bool,
    pub repeats: usize,
    pub quick: bool,
    pub wall_s: f64,
    pub allreduce_nproc: usize,
    pub allreduce: &'a Table,
    /// reduce_scatter and all_to_all busbw.
    pub collectives: &'a Table,
    pub ddp: &'a [(Workload, Table)],
    pub conv_ops: &'a [(ConvPlan, Result<crate::ops::ConvResults, String>)],
    pub ckpt: &'a Table,
    pub ckpt_mib: usize,
    /// `tandem bench save-stall`'s results, or why it failed.
    pub save_stall: &'a Result<crate::save_stall::Results, String>,
    pub zero: &'a Result<crate::zero::Results, String>,
    /// `tandem bench face` at each planned size: (what was run, its results or why it failed).
    pub face: &'a [(String, Result<crate::face::FaceResults, String>)],
    /// `docs/face_scale.json` as `tandem bench face-scale` wrote it (an hour of runs, so the
    /// report includes its last output rather than rerunning it).
    pub face_scale: Option<&'a crate::face_scale::Results>,
    pub failures: &'a [String],
    pub retries: &'a [String],
    /// `docs/bench_two_hosts.md` as `scripts/bench_two_hosts.sh` wrote it (it needs root and
    /// network namespaces, so the report includes its last output rather than rerunning it).
    pub several_hosts: Option<String>,
    /// `docs/bench_conv_before_after.md` as `scripts/conv_before_after.sh` wrote it (it builds
    /// an older revision, so the report includes its last output rather than rerunning it).
    pub conv_before_after: Option<String>,
    /// The GPU section (`tandem bench report --gpu`'s docs/gpu_validate.md), in its markers.
    pub gpu: Option<String>,
}

/// A section `## title` holding a script's saved markdown `body` after `intro`, the body's
/// headings moved down so that its shallowest one is a `###` under the section's.
fn embed(out: &mut String, title: &str, intro: &str, body: &str) {
    let level = |line: &str| line.bytes().take_while(|&b| b == b'#').count();
    let shallowest = body.lines().map(level).filter(|&l| l > 0).min().unwrap_or(3);
    let deeper = "#".repeat(3usize.saturating_sub(shallowest));
    let _ = writeln!(out, "## {title}\n\n{intro}\n");
    for line in body.trim_end().lines() {
        let _ = writeln!(out, "{}{line}", if level(line) > 0 { deeper.as_str() } else { "" });
    }
    out.push('\n');
}

/// The plot of one model's DDP table (the MLP's and ResNet-18 w16's keep their first names).
pub fn ddp_plot_name(w: &Workload) -> String {
    match (w.model, w.width) {
        ("mlp", _) => "ddp_samples_per_s.png".into(),
        ("resnet18", width) if width != 16 => format!("ddp_resnet18_w{width}_samples_per_s.png"),
        (model, _) => format!("ddp_{model}_samples_per_s.png"),
    }
}

/// The section heading of one model's DDP table.
fn ddp_heading(w: &Workload) -> String {
    if w.model == "mlp" {
        "DDP training throughput".into()
    } else {
        format!("DDP training throughput, {}", w.title)
    }
}

pub const REGENERATE: &str = "cargo build --release && target/release/tandem bench report";

fn table(out: &mut String, t: &Table) {
    let _ = writeln!(
        out,
        "| case | contender | median ({u}) | min | max | {r} median | × {r} | × PyTorch |\n|---|---|--:|--:|--:|--:|--:|--:|",
        u = t.unit,
        r = t.reference_name
    );
    for row in &t.rows {
        let reference = row.reference.map(sig).unwrap_or_else(|| "n/a".into());
        let _ = match &row.figure {
            Figure::Measured(s) => writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                row.case,
                row.contender,
                sig(s.median),
                sig(s.min),
                sig(s.max),
                reference,
                row.over_reference().map(ratio).unwrap_or_else(|| "n/a".into()),
                row.over_torch().map(ratio).unwrap_or_else(|| "–".into()),
            ),
            Figure::Missing(why) => writeln!(
                out,
                "| {} | {} | {} | – | – | {reference} | – | – |",
                row.case,
                row.contender,
                why.replace('|', "/")
            ),
        };
    }
    out.push('\n');
}

/// "12.3 GB/s = 0.95× memcpy, 2.10× gloo" for the headline, or why it is missing.
fn headline(
    row: Option<&Row>,
    unit: &str,
    reference: &str,
    torch: &str,
    torch_missing: bool,
) -> String {
    let mut h = against_reference(row, unit, reference);
    if let Some(Figure::Measured(_)) = row.map(|r| &r.figure) {
        match row.and_then(Row::over_torch) {
            Some(t) => {
                let _ = write!(h, ", {}× {torch}", ratio(t));
            }
            None if torch_missing => {
                h.push_str(&format!(" ({torch}: {})", super::torch::UNAVAILABLE))
            }
            None => h.push_str(&format!(" ({torch}: not measured)")),
        }
    }
    h
}

/// "median unit = ratio× reference", or why the row has no figure.
fn against_reference(row: Option<&Row>, unit: &str, reference: &str) -> String {
    let Some(row) = row else { return "not measured".into() };
    match &row.figure {
        Figure::Missing(why) => why.clone(),
        Figure::Measured(s) => {
            let mut h = format!("{} {unit}", sig(s.median));
            if let Some(r) = row.over_reference() {
                let _ = write!(h, " = {}× {reference}", ratio(r));
            }
            h
        }
    }
}

fn noise(out: &mut String, name: &str, t: &Table) {
    let mut spreads: Vec<(f64, String)> = t
        .rows
        .iter()
        .filter_map(|r| match &r.figure {
            Figure::Measured(s) if s.runs > 1 => {
                Some((s.spread(), format!("{} {}", r.contender, r.case)))
            }
            _ => None,
        })
        .filter(|(s, _)| s.is_finite())
        .collect();
    if spreads.is_empty() {
        let _ = writeln!(out, "| {name} | – | – | – |");
        return;
    }
    spreads.sort_by(|a, b| a.0.total_cmp(&b.0));
    let median = spreads[spreads.len() / 2].0;
    let (worst, which) = spreads.last().cloned().unwrap_or_default();
    let _ = writeln!(
        out,
        "| {name} | {} | {:.0}% | {:.0}% ({which}) |",
        spreads.len(),
        median * 100.0,
        worst * 100.0
    );
}

pub fn render(r: &Report) -> String {
    let m = r.machine;
    let mut out = String::new();
    let _ = writeln!(out, "# tandem benchmarks\n");
    let _ = writeln!(
        out,
        "Measured on {} by `tandem bench report`{}. Regenerate on your machine with one command:\n\n```sh\n{REGENERATE}\n```\n\n(With `--features mpi` after `-p tandem-cli` and OpenMPI installed, the all_reduce table also measures the MPI backend.)\n",
        m.date_utc,
        if r.quick { " --quick (a small smoke-test version: few sizes, few steps, small checkpoint)" } else { "" }
    );
    let _ = writeln!(
        out,
        "Every figure is divided by a reference measured in the same run on the same machine \
         (memcpy for all_reduce, plain single-process training for DDP, dd for checkpoints) and, \
         where PyTorch runs the same work, by PyTorch's figure. Each measurement was repeated {} \
         time(s); tables give min / median / max over the runs and ratios of medians. Compare \
         numbers only within one report: absolute figures depend on the machine and its load.\n",
        r.repeats
    );
    if !r.release_build {
        let _ = writeln!(out, "**Warning: this report was produced by a debug build; its tandem figures are not representative.**\n");
    }

    let _ = writeln!(out, "## Headline\n");
    let nt = r.torch.is_err();
    let big = r
        .allreduce
        .rows
        .iter()
        .filter(|x| x.contender == "tandem shm")
        .map(|x| x.case.clone())
        .next_back();
    if let Some(case) = big {
        let shm = r.allreduce.find(&case, "tandem shm");
        let tcp = r.allreduce.find(&case, "tandem tcp");
        let _ = writeln!(
            out,
            "- all_reduce {case}, {} ranks, tandem shm busbw: {}",
            r.allreduce_nproc,
            headline(shm, "GB/s", "memcpy", "gloo", nt)
        );
        let _ = writeln!(
            out,
            "- all_reduce {case}, {} ranks, tandem tcp busbw: {}",
            r.allreduce_nproc,
            headline(tcp, "GB/s", "memcpy", "gloo", nt)
        );
    }
    for (w, t) in r.ddp {
        for row in t.rows.iter().filter(|x| x.contender == "tandem Ddp") {
            let _ = writeln!(
                out,
                "- DDP training, {}, {}: {}",
                w.title,
                row.case,
                headline(Some(row), "samples/s", "plain", "PyTorch DDP", nt)
            );
        }
    }
    let _ = writeln!(
        out,
        "- checkpoint save, tandem .pt: {}",
        headline(r.ckpt.find("save", "tandem .pt"), "GB/s", "dd", "torch.save", nt)
    );
    let _ = writeln!(
        out,
        "- checkpoint load, tandem .pt (read, every byte, into new memory): {}; writing new memory alone: {}",
        headline(
            r.ckpt.find("load", "tandem .pt (read)"),
            "GB/s",
            "dd",
            "torch.load (read)",
            nt
        ),
        against_reference(r.ckpt.find("load", "fresh memory (first touch)"), "GB/s", "dd")
    );
    let _ = writeln!(
        out,
        "- checkpoint load, tandem .pt (read, every byte, into memory the process used before): {}",
        headline(
            r.ckpt.find("load", "tandem .pt (read, memory reused)"),
            "GB/s",
            "dd",
            "torch.load (read)",
            nt
        )
    );
    let _ = writeln!(
        out,
        "- checkpoint load, tandem .pt (mmap; tensor bytes are read on first use): {}",
        headline(
            r.ckpt.find("load", "tandem .pt (mmap)"),
            "GB/s",
            "dd",
            "torch.load(mmap=True)",
            nt
        )
    );
    out.push('\n');
    let _ = writeln!(out, "![all_reduce busbw vs message size](allreduce_busbw.png)\n");

    let _ = writeln!(out, "## Machine\n\n| | |\n|---|---|");
    let _ = writeln!(out, "| CPU | {} |", m.cpu_model);
    let _ = writeln!(out, "| cores | {} |", m.cores);
    let _ = writeln!(out, "| memory | {} |", m.memory);
    let _ = writeln!(out, "| OS | {} |", m.kernel);
    let _ = writeln!(out, "| load average (1/5/15 min) before | {} |", r.load_before);
    let _ = writeln!(out, "| load average (1/5/15 min) after | {} |", r.load_after);
    let _ = writeln!(out, "| date | {} |", m.date_utc);
    let _ = writeln!(out, "| git commit | {} |", m.git_commit);
    let _ = writeln!(
        out,
        "| tandem build | {} |",
        if r.release_build { "release" } else { "debug (not representative)" }
    );
    let _ = match &r.torch {
        Ok((version, python)) => writeln!(out, "| PyTorch | {version} (`{python}`) |"),
        Err(why) => {
            writeln!(out, "| PyTorch | {} ({}) |", super::torch::UNAVAILABLE, why.replace('|', "/"))
        }
    };
    let _ = writeln!(out, "| repeats per measurement | {} |", r.repeats);
    let _ = writeln!(out, "| wall time of the report | {:.0} s |\n", r.wall_s);

    let _ = writeln!(out, "## Noise\n");
    let _ = writeln!(
        out,
        "How far repeated runs of the same measurement landed apart: spread = (max − min) / median per figure. \
         A load average above the core count means other work competed for the CPU.\n"
    );
    let _ =
        writeln!(out, "| section | figures | median spread | widest spread |\n|---|--:|--:|---|");
    noise(&mut out, "all_reduce", r.allreduce);
    noise(&mut out, "reduce_scatter, all_to_all", r.collectives);
    for (w, t) in r.ddp {
        noise(&mut out, &format!("DDP {}", w.title), t);
    }
    noise(&mut out, "checkpoint", r.ckpt);
    out.push('\n');

    let _ = writeln!(out, "## all_reduce bus bandwidth\n");
    let _ = writeln!(
        out,
        "f32 sum over {n} local ranks; busbw = algbw × 2(n−1)/n (nccl-tests convention), GB/s = 1e9 B/s. \
         tandem: `tandem bench allreduce --nproc {n} --backend tcp|shm|mpi --json` (median per-iteration time of the \
         slowest rank; mpi: the ranks under mpirun, MPI's own all_reduce). Reference: memcpy of a buffer of the same size, measured by that same command before its \
         ranks start. gloo: `scripts/peers/torch_allreduce.py` (mean time; it takes whole MiB only and prints \
         GiB/s with two decimals, converted here). × PyTorch = tandem / gloo at the same size.\n",
        n = r.allreduce_nproc
    );
    let _ = writeln!(out, "![all_reduce busbw vs message size](allreduce_busbw.png)\n");
    table(&mut out, r.allreduce);

    let _ = writeln!(out, "## reduce_scatter and all_to_all bus bandwidth\n");
    let _ = writeln!(
        out,
        "f32 over {n} local ranks, the size being each rank's input (rounded down to a whole number of \
         elements per rank); busbw = algbw × (n−1)/n for both (nccl-tests convention), GB/s = 1e9 B/s. \
         tandem: `tandem bench allreduce --nproc {n} --ops reduce_scatter,all_to_all --backend tcp|shm --json`; \
         gloo: the tcp run's `--torch` measurement (`scripts/peers/torch_collectives_bench.py`: \
         `reduce_scatter_tensor`, `all_to_all_single`, the same sizes, warm-up and median-of-iterations timing, in \
         the same run). Reference: memcpy of a buffer of the same size. × PyTorch = tandem / gloo.\n",
        n = r.allreduce_nproc
    );
    table(&mut out, r.collectives);

    for (w, t) in r.ddp {
        let _ = writeln!(out, "## {}\n", ddp_heading(w));
        let _ = writeln!(
            out,
            "{title} on synthetic data, SGD, global batch {b} split over the ranks, {s} timed steps \
             (`tandem bench ddp --model {m} --width {wd}`). Reference: plain single-process training \
             (no Ddp, all cores) on the same global batch, measured by every `tandem bench ddp --json` run. \
             tandem Ddp: that command's N-rank run (N processes on loopback, cores/N threads each). \
             PyTorch DDP: `scripts/peers/torch_ddp_step.py` on the same model (gloo, cores/N threads per \
             rank). × PyTorch = tandem Ddp / PyTorch DDP with the same ranks.\n",
            title = w.title,
            b = w.batch,
            s = w.steps,
            m = w.model,
            wd = w.width,
        );
        let _ = writeln!(out, "![DDP samples/s, {}]({})\n", w.title, ddp_plot_name(w));
        table(&mut out, t);
    }

    for (plan, result) in r.conv_ops {
        let (heading, ops) = match plan.net {
            "vit_t" | "mbf" => (
                format!("## Kernels per op, {}", plan.title),
                "each distinct op of its training step (convolutions, linears, attention, \
                 LayerNorm, BatchNorm, PReLU, ReLU6, the optimizer's step)",
            ),
            "iresnet18" => (
                format!("## Conv-net kernels per op, {} width {}", plan.title, plan.width),
                "each distinct convolution, BatchNorm and PReLU of the network",
            ),
            _ => (
                format!("## Conv-net kernels per op, {} width {}", plan.title, plan.width),
                "each distinct convolution and BatchNorm of the network",
            ),
        };
        let _ = writeln!(out, "{heading}\n");
        let _ = writeln!(
            out,
            "`RAYON_NUM_THREADS=1 tandem bench ops --net {net} --width {w} --batch {b} --torch PYTHON`: \
             {ops}, forward and forward + backward of sum(y·r) less that harness's own cost (for \
             ungrouped convolutions also forward + each backward alone: bwd-data, the input's \
             gradient; bwd-filter, the weight's), median ms, against PyTorch \
             (`scripts/peers/torch_ops.py`: the same op list, inputs, batch and one thread — what each \
             rank of the 2-rank runs above has; each op's output sum is checked equal on both sides). \
             The table's caption names the CPU and its vector extensions. × torch = torch ms / tandem \
             ms (above 1: tandem is faster). The 3x3 stride-1 convolutions, which tandem computes by \
             Winograd's F(2x2, 3x3) or F(4x4, 3x3), are also timed through im2col + gemm; Winograd gain = im2col \
             time / tandem time.\n",
            net = plan.net,
            w = plan.width,
            b = plan.batch,
        );
        match result {
            Ok(r) => {
                let _ = writeln!(out, "{}", crate::ops::render(r));
            }
            Err(why) => {
                let _ = writeln!(out, "Not measured: {why}\n");
            }
        }
    }

    if let Some(before_after) = &r.conv_before_after {
        embed(
            &mut out,
            "Conv-net kernels before and after",
            "The convolution-speed work against the revision before it, both binaries measured in \
             alternation in one run by `scripts/conv_before_after.sh` (it builds the older revision, \
             so `tandem bench report` includes its last output, docs/bench_conv_before_after.md, \
             instead of rerunning it).",
            before_after,
        );
    }

    let _ = writeln!(out, "## Checkpoint save / load\n");
    let _ = writeln!(
        out,
        "A state dict of {mib} MiB of f32 tensors, saved and loaded in the same directory, all rows \
         from `tandem bench ckpt --repeat 1` per run (the three writers take turns going first; saves \
         include fsync). References: for saves `dd if=/dev/zero bs=1M conv=fsync` of the same size, \
         for loads `dd of=/dev/null bs=1M` of the .pt file just written (page cache warm, as for every \
         load here; dd reuses one 1 MiB buffer). × PyTorch compares like with like: saves with \
         torch.save, full reads with a plain torch.load, mapped loads with torch.load(mmap=True).\n\n\
         A full read copies the file into memory the process has not used yet, and pays for the \
         kernel zeroing — and in a virtual machine that returns idle memory to its host, the host \
         backing — each new page before a byte is copied. `fresh memory (first touch)` is that cost \
         alone: writing every byte of a new buffer of the file's size (huge-page advised, as the read's \
         buffer), measured just before the full read and held during it so the read cannot reuse its \
         pages. `tandem .pt (read, memory reused)` is a second full read right after the first, into \
         the pages the first one freed. Caution: the mmap loads (tandem .pt (mmap), safetensors, \
         torch.load(mmap=True)) map the file and touch tensor bytes only on first use, so figures far \
         above dd's read speed measure how little they read, not a read bandwidth. The plot's axis is \
         logarithmic.\n",
        mib = r.ckpt_mib
    );
    let _ = writeln!(out, "![checkpoint throughput](ckpt_throughput.png)\n");
    table(&mut out, r.ckpt);

    let _ = writeln!(out, "## Checkpoint save stall: synchronous vs background writes\n");
    let _ = writeln!(
        out,
        "How long a save stops training: an MLP and its SGD momentum buffers trained on one \
         process, the same steps run without saves, with synchronous saves (`tandem train`) and \
         with background saves (`tandem train --async-save`: training waits only while the state is \
         copied to host memory). A save step's stall is its time minus the median step without \
         saves of the same run; `run time added per save` also counts the slowdown of the steps \
         that overlap a background write. Measured by `tandem bench save-stall`, all runs here.\n"
    );
    match r.save_stall {
        Ok(t) => {
            let _ = writeln!(out, "```\n{}```\n", crate::save_stall::render(t));
        }
        Err(why) => {
            let _ = writeln!(out, "Not measured: {why}\n");
        }
    }

    let _ = writeln!(out, "## ZeRO-1: optimizer state per rank\n");
    let _ = writeln!(
        out,
        "`ZeroRedundancyOptimizer` (PyTorch's ZeRO stage 1) over TorchAdamW: each rank keeps the state \
         of its share of the parameters (whole parameters, split largest first) and broadcasts \
         its updated share after the step. State bytes are exact (the tensors each rank holds); \
         the reference is the unsharded TorchAdamW on one process in the same run. `x ideal` = bytes \
         × N / unsharded (1.0 is a perfect split). Step ms includes the broadcasts (local ranks \
         share this machine's cores). Measured by `tandem bench zero`.\n"
    );
    match r.zero {
        Ok(t) => {
            let _ = writeln!(out, "```\n{}```\n", crate::zero::render(t));
        }
        Err(why) => {
            let _ = writeln!(out, "Not measured: {why}\n");
        }
    }

    let _ = writeln!(out, "## The face-recognition recipe\n");
    let _ = writeln!(
        out,
        "insightface arcface_torch's recipe (IResNet, 112x112, PartialFC with ArcFace, SGD with \
         poly schedule and clipping) as `tandem train --model iresnetN --data rec:DIR`, against \
         the same recipe in PyTorch (`scripts/peers/torch_face_recipe.py`: DDP + PartialFC v2 \
         over gloo, its class sampling included below sample rate 1) on the same synthetic \
         identity set from the same initial weights, alternating rounds; samples/s count every \
         step, data loading included; memory is the largest rank's peak resident set while \
         training. The breakdown lines are where each side's step time goes. Measured by \
         `tandem bench face`.\n"
    );
    for (title, result) in r.face {
        let _ = writeln!(out, "### {title}\n");
        match result.as_ref().map(crate::face::render) {
            Ok(Ok(t)) => {
                let _ = writeln!(out, "```\n{t}```\n");
            }
            Ok(Err(why)) => {
                let _ = writeln!(out, "Not rendered: {why:#}\n");
            }
            Err(why) => {
                let _ = writeln!(out, "Not measured: {why}\n");
            }
        }
    }
    if let Some(scale) = r.face_scale {
        let _ = writeln!(out, "## The face recipe as its head and world grow\n");
        let _ = writeln!(
            out,
            "The largest head each side trains on this machine (bisection over the class count, \
             each probe a short run; a probe fails when the run does not finish, and how the \
             first failing one ended is given), then samples/s and the largest rank's peak \
             memory for 1, 2 and 4 ranks at 100k, 1M and tandem's largest head. With 2 cores, 4 \
             ranks oversubscribe the machine (two processes per core): their samples/s shows \
             that cost, not scaling. Measured by `tandem bench face-scale` (about an hour, so \
             `tandem bench report` includes its last output, docs/face_scale.json, instead of \
             rerunning it).\n"
        );
        let _ = writeln!(out, "{}", crate::face_scale::render(scale));
        let _ = writeln!(
            out,
            "![face recipe samples/s by ranks and classes](face_scale_samples_per_s.png)\n\n\
             ![face recipe peak memory per rank by ranks and classes](face_scale_memory.png)\n"
        );
    }

    if let Some(hosts) = &r.several_hosts {
        embed(
            &mut out,
            "Several hosts (simulated)",
            "Hosts are network namespaces on one bridge, each host's link rate-limited; every rank \
             still runs on this machine's cores. Measured by `sudo scripts/bench_two_hosts.sh \
             HOSTS` (root needed, so `tandem bench report` includes its last output, \
             docs/bench_two_hosts.md, instead of rerunning it).",
            hosts,
        );
    }

    if let Some(gpu) = &r.gpu {
        out.push_str(gpu);
        out.push('\n');
    }

    if !r.failures.is_empty() || !r.retries.is_empty() {
        let _ = writeln!(out, "## Failures\n");
        for f in r.failures {
            let _ = writeln!(out, "- failed: {}", f.replace('\n', " "));
        }
        for f in r.retries {
            let _ = writeln!(out, "- failed once, then run again: {}", f.replace('\n', " "));
        }
        out.push('\n');
    }
    out
}
