//! `tandem bench face`: the face-recognition recipe's throughput, `tandem train --model
//! iresnet18 --data rec:DIR` on N ranks, against PyTorch running the same recipe
//! (`scripts/peers/torch_face_recipe.py`: DDP + PartialFC over gloo) on the same synthetic
//! identity set from the same initial weights, in alternating rounds of one run. Prints each
//! side's samples/s (min / median / max), the ratio of the medians, and where tandem's step
//! time goes (rank 0's breakdown from the run's last round).
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

#[derive(clap::Args)]
pub struct Args {
    /// Ranks on this host (both sides).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// IResNet-18 stage width (arcface_torch's is 64).
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
    classes: usize,
    /// DataLoader worker processes of the PyTorch side (arcface_torch uses 2; on a machine with
    /// one core per rank 0 is PyTorch's fastest).
    #[arg(long, default_value_t = 0)]
    torch_workers: usize,
    /// Directory for the data and runs (default: a fresh one under the current directory,
    /// removed after).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Python with torch (default: $TANDEM_PYTHON, ./.venv-torch/bin/python, python3).
    #[arg(long)]
    python: Option<PathBuf>,
}

/// One side's samples/s per round.
struct Side {
    name: &'static str,
    samples_per_s: Vec<f64>,
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

fn value_after(text: &str, key: &str) -> Option<f64> {
    text.split_whitespace().rev().find_map(|w| w.strip_prefix(key).and_then(|v| v.parse().ok()))
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.nproc == 0 || args.batch == 0 || args.steps == 0 || args.rounds == 0 {
        bail!("--nproc, --batch, --steps and --rounds must be at least 1");
    }
    let python = crate::ckpt::find_python(args.python.clone()).context(
        "no Python with torch for the PyTorch side (--python, $TANDEM_PYTHON or ./.venv-torch)",
    )?;
    crate::in_scratch_dir(args.dir.as_deref(), "bench-face", |dir| measure(&args, &python, dir))
}

fn measure(args: &Args, python: &Path, dir: &Path) -> anyhow::Result<i32> {
    let exe = crate::tandem_exe()?;
    let peer = crate::report::repo_root().join(crate::PEERS_DIR).join("torch_face_recipe.py");
    let data = dir.join("faces");
    let (classes, width, emb) =
        (args.classes.to_string(), args.width.to_string(), args.embedding.to_string());
    if !data.join("train.rec").is_file() {
        run(
            Command::new(&exe).args(["data", "synth-faces"]).arg(&data).args([
                "--classes",
                &classes,
                "--per-class",
                "8",
                "--pairs",
                "20",
            ]),
            "tandem data synth-faces",
        )?;
    }
    let init = dir.join("init.pt");
    run(
        Command::new(python).arg(&peer).arg("init").arg(&init).args([
            "--classes",
            &classes,
            "--width",
            &width,
            "--embedding",
            &emb,
        ]),
        "torch_face_recipe.py init",
    )?;
    let (nproc, batch, steps) =
        (args.nproc.to_string(), args.batch.to_string(), args.steps.to_string());
    let recipe = |out: &Path| -> Command {
        let mut c = Command::new(&exe);
        c.args(["train", "--nproc-per-node", &nproc, "--model", "iresnet18", "--width", &width]);
        c.args([
            "--embedding-size",
            &emb,
            "--batch-size",
            &batch,
            "--epochs",
            "1000",
            "--steps",
            &steps,
        ]);
        c.args(["--lr", "0.1", "--lr-scheduler", "poly", "--clip-grad-norm", "5", "--seed", "0"]);
        c.arg("--data").arg(format!("rec:{}", data.display()));
        c.arg("--init-from").arg(&init).arg("--out").arg(out);
        for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
            c.env_remove(v);
        }
        c
    };
    let mut ours = Side { name: "tandem", samples_per_s: Vec::new() };
    let mut theirs = Side { name: "PyTorch (gloo DDP + PartialFC)", samples_per_s: Vec::new() };
    let mut breakdown = String::new();
    for round in 0..args.rounds {
        let out = dir.join(format!("run-{round}"));
        run(&mut recipe(&out), "tandem train (face recipe)")?;
        let metrics = out.join("metrics.jsonl");
        let summary = tandem_train::metrics::last_summary(&metrics)?
            .with_context(|| format!("no run summary in {}", metrics.display()))?;
        breakdown = summary.step_times.map(|t| t.line()).unwrap_or_default();
        ours.samples_per_s.push(summary.samples_per_s);
        let text = run(
            Command::new(python)
                .arg(&peer)
                .arg("train")
                .arg("--data")
                .arg(&data)
                .arg("--init")
                .arg(&init)
                .args([
                    "--world",
                    &nproc,
                    "--width",
                    &width,
                    "--embedding",
                    &emb,
                    "--batch",
                    &batch,
                    "--epochs",
                    "1000",
                    "--steps",
                    &steps,
                    "--lr",
                    "0.1",
                    "--clip",
                    "5",
                    "--seed",
                    "0",
                    "--workers",
                    &args.torch_workers.to_string(),
                ]),
            "torch_face_recipe.py train",
        )?;
        let sps = value_after(&text, "samples/s=")
            .context("no samples/s in the PyTorch peer's output")?;
        theirs.samples_per_s.push(sps);
        eprintln!(
            "round {}/{}: tandem {:.1}, PyTorch {:.1} samples/s",
            round + 1,
            args.rounds,
            ours.samples_per_s[round],
            sps
        );
    }
    println!(
        "face recipe: IResNet-18 width {} embedding {}, 112x112, {} ranks x batch {}, {} classes, {} steps per run, {} rounds",
        args.width, args.embedding, args.nproc, args.batch, args.classes, args.steps, args.rounds
    );
    let mut medians = Vec::new();
    for side in [&ours, &theirs] {
        let s = crate::report::summary(&side.samples_per_s).context("no measurements")?;
        println!(
            "  {:<34} samples/s min {:.1} median {:.1} max {:.1}",
            side.name, s.min, s.median, s.max
        );
        medians.push(s.median);
    }
    println!("  tandem / PyTorch (medians): {:.2}x", medians[0] / medians[1]);
    if !breakdown.is_empty() {
        println!("  {breakdown}");
    }
    Ok(0)
}
