//! `tandem bench face`: the face-recognition recipe's throughput, `tandem train --model
//! iresnet18 --data rec:DIR` on N ranks, against PyTorch running the same recipe
//! (`scripts/peers/torch_face_recipe.py`: DDP + PartialFC over gloo) on the same synthetic
//! identity set from the same initial weights, in alternating rounds of one run. Prints each
//! side's samples/s (min / median / max), the ratio of the medians, and where tandem's step
//! time goes (rank 0's breakdown from the run's last round).
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use tandem::recipes::options::{DataSource, SchedulerKind};
use tandem::recipes::TrainConfig;

#[derive(clap::Args)]
pub struct Args {
    /// Ranks on this host (both sides).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// The backbone: iresnet18 .. iresnet200, or arcface_torch's MobileFaceNet mbf or mbf_large,
    /// or its ViT vit_t, vit_s, vit_b or vit_l.
    #[arg(long, default_value = "iresnet18", value_parser = ["iresnet18", "iresnet34", "iresnet50", "iresnet100", "iresnet200", "mbf", "mbf_large", "vit_t", "vit_s", "vit_b", "vit_l"])]
    model: String,
    /// IResNet stage width (arcface_torch's is 64; MobileFaceNet's widths are fixed).
    #[arg(long, default_value_t = 16)]
    width: usize,
    #[arg(long, default_value_t = 128)]
    embedding: usize,
    /// Images per rank per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 12)]
    steps: u64,
    /// Alternating rounds (tandem, PyTorch) to take min / median / max over.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Identities in the synthetic set (8 images each).
    #[arg(long, default_value_t = 64)]
    identities: usize,
    /// Rows of the PartialFC head (default: the identities); the data may hold fewer. A head
    /// over 256 MiB is not written out: each side draws its own N(0, 0.01) centres.
    #[arg(long)]
    classes: Option<usize>,
    /// PartialFC's sample rate (PartialFC v2's class sampling on both sides below 1).
    #[arg(long, default_value_t = 1.0)]
    sample_rate: f64,
    /// DataLoader worker processes of the PyTorch side (arcface_torch uses 2; on a machine with
    /// one core per rank 0 is PyTorch's fastest).
    #[arg(long, default_value_t = 0)]
    torch_workers: usize,
    /// Where both sides train: `cpu`, or `cuda` (one GPU, each rank on GPU LOCAL_RANK; PyTorch
    /// with cudnn.benchmark).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Mixed precision on a GPU: `f16` (tandem's autocast and GradScaler; PyTorch's
    /// torch.autocast + GradScaler, arcface_torch's fp16) or `bf16`; `f32` everywhere else.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    precision: String,
    /// Steps left out of both sides' samples/s (cuDNN's algorithm search and other one-off
    /// costs of the first steps).
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// Decoding threads of tandem's loader (`--num-workers`; default: the recipe's, 2).
    #[arg(long)]
    workers: Option<usize>,
    /// Device-true phase times: tandem with TANDEM_PROFILE=phases, PyTorch with --profile
    /// (both wait for the GPU at each phase, which slows them; compare samples/s without it).
    #[arg(long)]
    profile: bool,
    /// Also write the results as JSON to this file (for `tandem bench report --gpu`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Directory for the data and runs (default: a fresh one under the current directory,
    /// removed after).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Python with torch (default: $TANDEM_PYTHON, ./.venv-torch/bin/python, python3).
    #[arg(long)]
    python: Option<PathBuf>,
}

/// One side's figures per round (printed, and written by `--json`).
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default)]
pub struct SideResults {
    pub samples_per_s: Vec<f64>,
    /// The largest rank's peak resident memory, bytes.
    pub peak_rss: Vec<f64>,
    /// Peak GPU memory, bytes (GPU runs).
    pub device_peak: Vec<f64>,
    /// The last round's time per step by phase, as the side prints it.
    pub breakdown: String,
}

impl SideResults {
    /// One round's run.
    fn push(&mut self, run: &RunStats) {
        self.samples_per_s.push(run.samples_per_s);
        self.peak_rss.push(run.peak_rss);
        self.device_peak.extend(run.device_peak);
        self.breakdown.clone_from(&run.breakdown);
    }
}

/// What `--json` writes.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default)]
pub struct FaceResults {
    pub device: String,
    pub precision: String,
    pub model: String,
    pub width: usize,
    pub embedding: usize,
    pub classes: usize,
    pub sample_rate: f64,
    pub nproc: usize,
    pub batch: usize,
    pub steps: u64,
    pub warmup_steps: u64,
    pub tandem: SideResults,
    pub torch: SideResults,
    /// Identities in the synthetic set.
    #[serde(default)]
    pub identities: usize,
    /// tandem's largest rank's peak including its last checkpoint save, per round (bytes).
    #[serde(default)]
    pub peak_with_save: Vec<f64>,
    /// This machine's sgemm rate on all cores, FLOP/s (IResNet runs, which are gemm-bound).
    #[serde(default)]
    pub sgemm_peak: Option<f64>,
}

/// Floating-point operations of one IResNet forward pass on one 112x112 image, counted from the
/// layer shapes (a multiply-add is 2): the stem, every block's two 3x3 convolutions and its 1x1
/// downsample, the final linear layer. BatchNorm, PReLU and the additions are left out (a few
/// percent, and not gemm work).
pub fn iresnet_forward_flops(depth: usize, width: usize, embedding: usize) -> f64 {
    let blocks: [usize; 4] = match depth {
        18 => [2, 2, 2, 2],
        34 => [3, 4, 6, 3],
        50 => [3, 4, 14, 3],
        _ => [3, 13, 30, 3],
    };
    let conv =
        |cin: usize, cout: usize, k: usize, hw: usize| 2.0 * (cin * cout * k * k * hw * hw) as f64;
    let mut flops = conv(3, width, 3, 112);
    let (mut cin, mut hw) = (width, 112);
    for (stage, n) in blocks.iter().enumerate() {
        let cout = width << stage;
        for b in 0..*n {
            let out_hw = if b == 0 { hw / 2 } else { hw };
            flops += conv(cin, cout, 3, hw) + conv(cout, cout, 3, out_hw);
            if b == 0 {
                flops += conv(cin, cout, 1, out_hw);
            }
            cin = cout;
            hw = out_hw;
        }
    }
    flops + 2.0 * (cin * hw * hw * embedding) as f64
}

/// This machine's single-precision matrix-product rate in FLOP/s on all its cores (candle's
/// CPU matmul, over the `gemm` crate tandem's kernels use too): the best of 8 products of two
/// 1024x1024 matrices after 2 warm-up ones.
fn sgemm_peak() -> anyhow::Result<f64> {
    use candle_core::{Device, Tensor};
    let n = 1024;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let mut best = f64::INFINITY;
    for i in 0..10 {
        let t = std::time::Instant::now();
        let c = a.matmul(&b)?;
        let _ = c.sum_all()?.to_scalar::<f32>()?;
        if i >= 2 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (n * n * n) as f64 / best)
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{what} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.nproc == 0 || args.batch == 0 || args.steps == 0 || args.rounds == 0 {
        bail!("--nproc, --batch, --steps and --rounds must be at least 1");
    }
    if !(0.0..=1.0).contains(&args.sample_rate) {
        bail!("--sample-rate must be in [0, 1], got {}", args.sample_rate);
    }
    let python = crate::ckpt::find_python(args.python.clone()).context(
        "no Python with torch for the PyTorch side (--python, $TANDEM_PYTHON or ./.venv-torch)",
    )?;
    let results = crate::in_scratch_dir(args.dir.as_deref(), "bench-face", |dir| {
        measure(&args, &python, dir)
    })?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", render(&results)?);
    Ok(0)
}

/// One configuration of the recipe on both sides: the data, the initial weights and the
/// command lines. Shared by `bench face` (rounds at one size) and `bench face-scale` (sizes,
/// rank counts and the largest head).
pub(crate) struct FaceRun {
    pub exe: PathBuf,
    pub python: PathBuf,
    pub peer: PathBuf,
    pub data: PathBuf,
    pub init: PathBuf,
    pub nproc: usize,
    pub model: String,
    pub width: usize,
    pub embedding: usize,
    pub classes: usize,
    pub sample_rate: f64,
    pub batch: usize,
    pub steps: u64,
    pub torch_workers: usize,
    /// Whether tandem writes its checkpoints (the PyTorch peer saves none).
    pub checkpoints: bool,
    /// `cpu` or `cuda`.
    pub device: String,
    /// `f32`, `f16` or `bf16`.
    pub precision: String,
    pub warmup_steps: u64,
    pub workers: Option<usize>,
    pub profile: bool,
}

/// The PyTorch peer's figures (its `RESULT` line); `step_ms` by phase in its order.
#[derive(serde::Deserialize)]
struct PeerRun {
    samples_per_s: f64,
    peak_rss_bytes: Vec<u64>,
    step_ms: Vec<(String, f64)>,
    gpu_peak_bytes: Option<u64>,
}

/// What one run of one side gave.
pub(crate) enum Outcome {
    Ran(RunStats),
    /// It did not finish: how it ended and its last words.
    Failed(String),
}

pub(crate) struct RunStats {
    pub samples_per_s: f64,
    /// Training's peak resident memory of the largest rank (bytes), before any final save.
    pub peak_rss: f64,
    /// tandem only: the largest rank's peak including its last checkpoint save.
    pub peak_with_save: Option<f64>,
    /// Rank 0's time per step by phase, as the side prints it.
    pub breakdown: String,
    /// The largest rank's peak GPU memory (bytes), on a GPU.
    pub device_peak: Option<f64>,
}

impl FaceRun {
    /// Synthesises `identities` x 8 images under `dir/faces` (kept if there) and writes the
    /// initial weights (the head too when it is at most 256 MiB).
    pub fn prepare(mut self, dir: &Path, identities: usize) -> anyhow::Result<Self> {
        self.data = crate::train_job::face_set(dir, identities, 20)?;
        self.init = dir.join(format!(
            "init-{}-w{}-e{}-c{}.pt",
            self.model, self.width, self.embedding, self.classes
        ));
        if !self.init.is_file() {
            let mut init_cmd = Command::new(&self.python);
            init_cmd.arg(&self.peer).arg("init").arg(&self.init).args([
                "--classes",
                &self.classes.to_string(),
                "--network",
                &self.model,
                "--width",
                &self.width.to_string(),
                "--embedding",
                &self.embedding.to_string(),
            ]);
            if !self.head_in_init() {
                init_cmd.arg("--no-head");
            }
            run(&mut init_cmd, "torch_face_recipe.py init")?;
        }
        Ok(self)
    }

    pub fn new(python: &Path) -> anyhow::Result<Self> {
        Ok(FaceRun {
            exe: crate::tandem_exe()?,
            python: python.to_path_buf(),
            peer: crate::report::repo_root().join(crate::PEERS_DIR).join("torch_face_recipe.py"),
            data: PathBuf::new(),
            init: PathBuf::new(),
            nproc: 2,
            model: "iresnet18".into(),
            width: 16,
            embedding: 128,
            classes: 64,
            sample_rate: 1.0,
            batch: 8,
            steps: 12,
            torch_workers: 0,
            checkpoints: true,
            device: "cpu".into(),
            precision: "f32".into(),
            warmup_steps: 0,
            workers: None,
            profile: false,
        })
    }

    /// The IResNet's depth; `None` for MobileFaceNet.
    fn depth(&self) -> Option<usize> {
        self.model.strip_prefix("iresnet").and_then(|d| d.parse().ok())
    }

    /// A large head is drawn by each side from its seed rather than written out and read back.
    pub fn head_in_init(&self) -> bool {
        self.classes * self.embedding * 4 <= 256 << 20
    }

    /// `tandem train` with the recipe, its run directory `out`.
    pub fn tandem(&self, out: &Path) -> anyhow::Result<Outcome> {
        let cfg = TrainConfig {
            nproc_per_node: self.nproc,
            model: self.model.parse()?,
            width: self.width,
            num_classes: Some(self.classes),
            sample_rate: self.sample_rate,
            embedding_size: self.embedding,
            batch_size: self.batch,
            epochs: 1000,
            steps: Some(self.steps),
            lr: 0.1,
            lr_scheduler: SchedulerKind::Poly,
            clip_grad_norm: Some(5.0),
            seed: 0,
            data: DataSource::Rec(self.data.clone()),
            init_from: Some(self.init.clone()),
            out: Some(out.to_path_buf()),
            no_checkpoints: !self.checkpoints,
            device: self.device.parse()?,
            precision: self.precision.parse()?,
            timing_warmup_steps: self.warmup_steps,
            num_workers: self.workers,
            ..TrainConfig::default()
        };
        // Beside the run directory, which `tandem train` makes itself.
        let file = out.with_extension("settings.toml");
        if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        let mut c = crate::train_job::train_command(&self.exe, &cfg, &file)?;
        if self.profile {
            c.env("TANDEM_PROFILE", "phases");
        }
        for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
            c.env_remove(v);
        }
        if let Err(why) = run_outcome(&mut c, "tandem train (face recipe)")? {
            return Ok(Outcome::Failed(why));
        }
        let metrics = out.join("metrics.jsonl");
        let summary = tandem::train::metrics::last_summary(&metrics)?
            .with_context(|| format!("no run summary in {}", metrics.display()))?;
        let max = |v: &[u64]| v.iter().map(|&b| b as f64).fold(0.0, f64::max);
        // Training's peak, as the PyTorch side's (which saves no checkpoint); the last save's
        // staging is reported on its own.
        let training = match summary.training_peak_rss_bytes.as_slice() {
            [] => &summary.peak_rss_bytes,
            t => t,
        };
        Ok(Outcome::Ran(RunStats {
            samples_per_s: summary.samples_per_s,
            peak_rss: max(training),
            peak_with_save: Some(max(&summary.peak_rss_bytes)),
            breakdown: summary.step_times.map(|t| t.line()).unwrap_or_default(),
            device_peak: (self.device != "cpu").then(|| max(&summary.device_peak_bytes)),
        }))
    }

    /// The PyTorch peer with the same recipe.
    pub fn pytorch(&self) -> anyhow::Result<Outcome> {
        let mut c = Command::new(&self.python);
        c.arg(&self.peer).arg("train").arg("--data").arg(&self.data).arg("--init").arg(&self.init);
        c.args(["--world", &self.nproc.to_string(), "--width", &self.width.to_string()]);
        c.args(["--embedding", &self.embedding.to_string(), "--batch", &self.batch.to_string()]);
        c.args(["--epochs", "1000", "--steps", &self.steps.to_string()]);
        c.args(["--lr", "0.1", "--clip", "5", "--seed", "0"]);
        c.args(["--workers", &self.torch_workers.to_string(), "--network", &self.model]);
        c.args(["--classes", &self.classes.to_string()]);
        c.args(["--sample-rate", &self.sample_rate.to_string()]);
        c.args(["--device", &self.device, "--warmup-steps", &self.warmup_steps.to_string()]);
        let amp = match self.precision.as_str() {
            "f32" => "none",
            other => other,
        };
        c.args(["--amp", amp]);
        if self.profile {
            c.arg("--profile");
        }
        let text = match run_outcome(&mut c, "torch_face_recipe.py train")? {
            Ok(text) => text,
            Err(why) => return Ok(Outcome::Failed(why)),
        };
        let [peer]: [PeerRun; 1] = crate::local_ranks::results(&text, "torch_face_recipe.py")?
            .try_into()
            .map_err(|rows: Vec<PeerRun>| {
                anyhow::anyhow!("torch_face_recipe.py reported {} runs, not one", rows.len())
            })?;
        let phases: Vec<String> = peer.step_ms.iter().map(|(k, v)| format!("{k}={v:.1}")).collect();
        Ok(Outcome::Ran(RunStats {
            samples_per_s: peer.samples_per_s,
            peak_rss: peer.peak_rss_bytes.iter().map(|&b| b as f64).fold(0.0, f64::max),
            peak_with_save: None,
            breakdown: format!("time per step on rank 0 (ms): {}", phases.join(" ")),
            device_peak: peer.gpu_peak_bytes.map(|b| b as f64),
        }))
    }
}

/// The kernel log's out-of-memory kills ("Out of memory: Killed process ..."), where readable.
fn oom_kills() -> Vec<String> {
    Command::new("dmesg")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.contains("Out of memory: Killed process"))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `cmd`: `Ok(Ok(output))` when it succeeded, `Ok(Err(how))` when it ran and failed:
/// its exit status or the signal that ended it, the kernel's OOM kill if the log shows a new
/// one, and its last error lines.
fn run_outcome(cmd: &mut Command, what: &str) -> anyhow::Result<Result<String, String>> {
    use std::os::unix::process::ExitStatusExt;
    let kills_before = oom_kills().len();
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    if out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        return Ok(Ok(text));
    }
    let mut how = match (out.status.signal(), out.status.code()) {
        (Some(sig), _) => format!("killed by signal {sig}"),
        // A launcher reports a worker killed by signal N as 128 + N (tandem run and torchrun).
        (None, Some(code)) if code > 128 => {
            format!("exit status {code} (a worker killed by signal {})", code - 128)
        }
        (None, code) => format!("exit status {}", code.unwrap_or(-1)),
    };
    let kills = oom_kills();
    if let Some(kill) = kills.get(kills_before..).and_then(|new| new.last()) {
        let rss = kill.split(", ").find(|f| f.starts_with("anon-rss:")).unwrap_or("");
        how += &format!(
            ": the kernel's OOM killer ({}{rss})",
            if rss.is_empty() { "" } else { "the process had " }
        );
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| {
            let l = l.to_lowercase();
            l.contains("error") || l.contains("killed") || l.contains("memory")
        })
        .collect();
    let tail = errors.iter().rev().take(2).rev().copied().collect::<Vec<_>>().join(" | ");
    if !tail.is_empty() {
        how += &format!("; {tail}");
    }
    Ok(Err(format!("{what}: {how}")))
}

/// Runs `args`' rounds (tandem, then PyTorch, each round) in `dir`.
pub fn measure(args: &Args, python: &Path, dir: &Path) -> anyhow::Result<FaceResults> {
    let head_rows = args.classes.unwrap_or(args.identities);
    let recipe = FaceRun {
        nproc: args.nproc,
        model: args.model.clone(),
        width: args.width,
        embedding: args.embedding,
        classes: head_rows,
        sample_rate: args.sample_rate,
        batch: args.batch,
        steps: args.steps,
        torch_workers: args.torch_workers,
        device: args.device.clone(),
        precision: args.precision.clone(),
        warmup_steps: args.warmup_steps,
        workers: args.workers,
        profile: args.profile,
        ..FaceRun::new(python)?
    }
    .prepare(dir, args.identities)?;
    if args.warmup_steps >= args.steps {
        bail!(
            "--warmup-steps {} leaves none of the {} --steps to time",
            args.warmup_steps,
            args.steps
        );
    }
    let mut results = FaceResults {
        device: args.device.clone(),
        precision: args.precision.clone(),
        model: args.model.clone(),
        width: args.width,
        embedding: args.embedding,
        classes: head_rows,
        sample_rate: args.sample_rate,
        nproc: args.nproc,
        batch: args.batch,
        steps: args.steps,
        warmup_steps: args.warmup_steps,
        identities: args.identities,
        ..FaceResults::default()
    };
    let ran = |o: Outcome| match o {
        Outcome::Ran(s) => Ok(s),
        Outcome::Failed(why) => Err(anyhow::anyhow!(why)),
    };
    for round in 0..args.rounds {
        let t = ran(recipe.tandem(&dir.join(format!("run-{round}")))?)?;
        results.tandem.push(&t);
        results.peak_with_save.extend(t.peak_with_save);
        let p = ran(recipe.pytorch()?)?;
        results.torch.push(&p);
        eprintln!(
            "round {}/{}: tandem {:.1}, PyTorch {:.1} samples/s",
            round + 1,
            args.rounds,
            t.samples_per_s,
            p.samples_per_s
        );
    }
    if recipe.depth().is_some() {
        results.sgemm_peak = Some(sgemm_peak()?);
    }
    Ok(results)
}

/// The results as `tandem bench face` prints them (and the report shows them).
pub fn render(r: &FaceResults) -> anyhow::Result<String> {
    use std::fmt::Write;
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut out = String::new();
    let head_in_init = r.classes * r.embedding * 4 <= 256 << 20;
    writeln!(
        out,
        "face recipe on {} ({}): {} width {} embedding {}, 112x112, {} ranks x batch {}, a head of {} classes (data: {} identities) at sample rate {}, {} steps per run ({} warm-up steps untimed), {} rounds{}",
        r.device,
        r.precision,
        r.model,
        r.width,
        r.embedding,
        r.nproc,
        r.batch,
        r.classes,
        r.identities,
        r.sample_rate,
        r.steps,
        r.warmup_steps,
        r.tandem.samples_per_s.len(),
        if head_in_init { "" } else { "; each side draws its own centres" }
    )?;
    let (mut medians, mut memory) = (Vec::new(), Vec::new());
    let (ours, theirs) = (&r.tandem, &r.torch);
    for (name, side) in [("tandem", ours), ("PyTorch (gloo DDP + PartialFC v2)", theirs)] {
        let s = crate::report::summary(&side.samples_per_s).context("no measurements")?;
        let m = crate::report::summary(&side.peak_rss).context("no measurements")?;
        writeln!(
            out,
            "  {:<36} samples/s min {:.3} median {:.3} max {:.3} | peak memory of the largest rank (GiB) min {:.2} median {:.2} max {:.2}",
            name, s.min, s.median, s.max, gib(m.min), gib(m.median), gib(m.max)
        )?;
        medians.push(s.median);
        memory.push(m.median);
    }
    writeln!(
        out,
        "  tandem / PyTorch (medians): samples/s {:.2}x, peak memory per rank {:.2}x",
        medians[0] / medians[1],
        memory[0] / memory[1].max(1.0)
    )?;
    if let (Some(a), Some(b)) =
        (crate::report::summary(&ours.device_peak), crate::report::summary(&theirs.device_peak))
    {
        writeln!(
            out,
            "  peak GPU memory (GiB, medians): tandem {:.2}, PyTorch {:.2} (torch.cuda.max_memory_allocated): {:.2}x",
            gib(a.median),
            gib(b.median),
            a.median / b.median.max(1.0)
        )?;
    }
    if let Some(m) = crate::report::summary(&r.peak_with_save) {
        writeln!(
            out,
            "  tandem with its last checkpoint save (a synchronous save writes each tensor from its own memory; PyTorch's run saves none): peak memory (GiB) min {:.2} median {:.2} max {:.2}",
            gib(m.min),
            gib(m.median),
            gib(m.max)
        )?;
    }
    if !ours.breakdown.is_empty() {
        writeln!(out, "  tandem:  {}", ours.breakdown)?;
    }
    if !theirs.breakdown.is_empty() {
        writeln!(out, "  PyTorch: {}", theirs.breakdown)?;
    }
    // The work of a step over the world, counted from the layer shapes: the backbone's forward
    // and backward (about twice the forward: input and weight gradients) for every image, and
    // the head's logits and their two gradients over the rows each rank samples. (IResNet
    // only: MobileFaceNet's depthwise layers are not GEMM-bound, so a GEMM peak says little.)
    let depth = r.model.strip_prefix("iresnet").and_then(|d| d.parse().ok());
    if let (Some(depth), Some(peak)) = (depth, r.sgemm_peak) {
        let images = (r.batch * r.nproc) as f64;
        let backbone = 3.0 * iresnet_forward_flops(depth, r.width, r.embedding) * images;
        let sampled = (r.sample_rate * r.classes as f64 / r.nproc as f64).floor();
        let head = 3.0 * 2.0 * images * sampled * r.embedding as f64 * r.nproc as f64;
        let step_flops = backbone + head;
        writeln!(
            out,
            "  work per step: {:.1} GFLOP (backbone {:.1}, head {:.1}); this machine's sgemm peak (all cores): {:.1} GFLOP/s",
            step_flops / 1e9,
            backbone / 1e9,
            head / 1e9,
            peak / 1e9
        )?;
        for (side, sps) in [("tandem", medians[0]), ("PyTorch", medians[1])] {
            let achieved = step_flops * sps / images;
            writeln!(
                out,
                "  {side:<8} achieved {:.1} GFLOP/s = {:.2} of the sgemm peak",
                achieved / 1e9,
                achieved / peak
            )?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::iresnet_forward_flops;

    /// arcface_torch's model table gives the backbones' multiply-adds at 112x112 with a 512-d
    /// embedding: r18 2.6G, r34 4.5G, r50 6.3G, r100 12.1G.
    #[test]
    fn the_flop_count_matches_arcface_torchs_table() {
        for (depth, gmac) in [(18, 2.6), (34, 4.5), (50, 6.3), (100, 12.1)] {
            let got = iresnet_forward_flops(depth, 64, 512) / 2e9;
            assert!((got - gmac).abs() / gmac < 0.02, "r{depth}: {got:.3} GMAC, table {gmac}");
        }
    }
}
