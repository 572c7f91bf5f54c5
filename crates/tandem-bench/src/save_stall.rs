//! `tandem bench save-stall`: how long a checkpoint save stops training, written synchronously
//! (`Checkpointer::save`, as `tandem train`) or in the background (`Checkpointer::background`,
//! `tandem train --async-save`). The state is real: an MLP and its SGD momentum buffers,
//! `--size-mib` MiB in all, trained on random data. Each repetition runs the same steps three
//! ways — no saves, synchronous saves, background saves — and a save step's stall is its time
//! minus the median step without saves of that repetition. Background saves also slow the steps
//! around them (the writer shares the cores and the memory bus): that cost is shown as the
//! whole run's extra time over the run without saves, per save; the wait for the last write at
//! the end is shown on its own.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use candle_core::{Device, Tensor};
use tandem::ckpt::{TrainingCheckpoint, Value};
use tandem::comm::InitMethod;
use tandem::models::Mlp;
use tandem::nn::weights::state_dict_value;
use tandem::nn::ParamModule;
use tandem::optim::{SgdConfig, TorchOptimizer, TorchSgd};
use tandem::train::checkpoint::{Checkpointer, TrainingStateDict};

use super::local_ranks::median;

#[derive(clap::Args)]
pub struct Args {
    /// Size of the saved state (weights + momentum buffers), in MiB.
    #[arg(long, default_value_t = 256)]
    pub(crate) size_mib: usize,
    /// Training steps per run.
    #[arg(long, default_value_t = 12)]
    pub(crate) steps: usize,
    /// A save after every N steps.
    #[arg(long, default_value_t = 4)]
    pub(crate) save_every: usize,
    /// Repetitions (min/median/max reported).
    #[arg(long, default_value_t = 3)]
    pub(crate) repeat: usize,
    /// Directory for the checkpoints (default: a fresh one under the current directory, removed after).
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
    /// Measure the face recipe instead: `tandem train --model iresnet18` on 2 ranks with a
    /// PartialFC head of `--classes` x `--embedding` (each rank saves its rows in parallel),
    /// with synchronous saves and with `--async-save`; the stall is the time training stood
    /// still per save, as the trainer measures it (the run summary's `step_times`).
    #[arg(long)]
    pub(crate) face: bool,
    /// Face: rows of the head.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) classes: usize,
    /// Face: embedding size.
    #[arg(long, default_value_t = 128)]
    pub(crate) embedding: usize,
}

const INPUT: usize = 256;
const BATCH: usize = 64;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    NoSave,
    Sync,
    Background,
}

/// One run: every step's seconds, which steps saved, and the time to drain the last write.
struct RunTimes {
    steps: Vec<f64>,
    saved: Vec<bool>,
    copy: Vec<f64>,
    drain: f64,
}

impl RunTimes {
    /// The steps' time; the final wait for the last write is reported on its own (a run pays
    /// it once, at the end).
    fn total(&self) -> f64 {
        self.steps.iter().sum::<f64>()
    }
}

/// Bytes of weights and momentum (f32 each) of the MLP INPUT-h-h-10.
fn state_bytes(h: usize) -> usize {
    8 * (INPUT * h + h + h * h + h + 10 * h + 10)
}

/// Hidden width `h` whose [`state_bytes`] come closest to `bytes` from below.
fn hidden_for(bytes: usize) -> usize {
    // state_bytes(h) / 8 = h^2 + (INPUT + 12) h + 10: the positive root.
    let params = bytes as f64 / 8.0;
    let b = (INPUT + 12) as f64;
    ((-b + (b * b + 4.0 * params).sqrt()) / 2.0).max(1.0) as usize
}

fn run_once(
    mode: Mode,
    args: &Args,
    hidden: usize,
    dir: &std::path::Path,
) -> anyhow::Result<RunTimes> {
    let device = Device::Cpu;
    let model = Mlp::new(&[INPUT, hidden, hidden, 10], 0, &device)?;
    let params = model.named_parameters().into_iter().map(|(_, v)| v).collect();
    let mut opt =
        TorchSgd::new(params, SgdConfig { lr: 1e-3, momentum: 0.9, ..Default::default() })?;
    let x = Tensor::randn(0f32, 1.0, (BATCH, INPUT), &device)?;
    let y = Tensor::from_vec((0..BATCH as u32).map(|i| i % 10).collect(), BATCH, &device)?;
    let group = tandem::comm::init_from(&InitMethod::Single)?;
    let mut ckpt =
        Checkpointer::new(dir.join(format!("{mode:?}")), 2).background(mode == Mode::Background);
    let mut times = RunTimes { steps: vec![], saved: vec![], copy: vec![], drain: 0.0 };
    for step in 1..=args.steps {
        let started = Instant::now();
        let grads = tandem::nn::backward(&model.loss(&x, &y)?)?;
        opt.step(&grads)?;
        let save = mode != Mode::NoSave && step % args.save_every == 0;
        if save {
            let copying = Instant::now();
            let value = TrainingCheckpoint {
                epoch: 0,
                global_step: step as i64,
                model: state_dict_value(&model)?,
                optimizer: opt.state_dict()?,
                scheduler: Value::None,
                sampler: Value::None,
                rng: Value::None,
                world_size: 1,
                config: Value::None,
                scaler: Value::None,
            }
            .to_value()?;
            times.copy.push(copying.elapsed().as_secs_f64());
            let name = format!("step-{step:04}");
            ckpt.save(&group, &name, TrainingStateDict::new(step as u64, 0, value))?;
        }
        times.steps.push(started.elapsed().as_secs_f64());
        times.saved.push(save);
    }
    let draining = Instant::now();
    ckpt.settle(&group)?;
    times.drain = draining.elapsed().as_secs_f64();
    Ok(times)
}

/// What a run of `tandem bench save-stall` measured: a table of seconds (each row's value in
/// every repetition) under its title, and the stall of a synchronous save over a background
/// one (medians).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Results {
    pub title: String,
    pub rows: Vec<(String, Vec<f64>)>,
    pub sync_over_background: f64,
}

/// The results as the table `tandem bench save-stall` prints (and the report shows).
pub fn render(r: &Results) -> String {
    let mut out = format!("{}\n{:<44} {:>8} {:>8} {:>8}\n", r.title, "", "min", "median", "max");
    for (name, v) in &r.rows {
        out += &format!("{name:<44} {}\n", min_med_max(v));
    }
    out + &format!("stall synchronous / background (medians): {:.1}x\n", r.sync_over_background)
}

fn min_med_max(v: &[f64]) -> String {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    format!("{:>8.3} {:>8.3} {:>8.3}", s[0], s[s.len() / 2], s[s.len() - 1])
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    print!("{}", render(&measure(&args)?));
    Ok(0)
}

/// Runs the measurement `args` describes.
pub fn measure(args: &Args) -> anyhow::Result<Results> {
    if args.size_mib == 0 || args.steps == 0 || args.repeat == 0 || args.save_every == 0 {
        bail!("--size-mib, --steps, --save-every and --repeat must be positive");
    }
    if args.save_every > args.steps {
        bail!(
            "--save-every {} is more than --steps {}: no save would happen",
            args.save_every,
            args.steps
        );
    }
    crate::in_scratch_dir(args.dir.as_deref(), "tandem-bench-save-stall", |dir| {
        if args.face {
            run_face(args, dir)
        } else {
            run(args, dir)
        }
    })
}

/// One face run's stall per save and its step time (seconds), from its run summary.
fn face_once(mode: Mode, args: &Args, dir: &std::path::Path) -> anyhow::Result<(f64, f64)> {
    use anyhow::Context;
    let out = std::path::absolute(dir)?.join(format!("face-{mode:?}"));
    let _ = std::fs::remove_dir_all(&out);
    let cfg = tandem::recipes::TrainConfig {
        steps: Some(args.steps as u64),
        nproc_per_node: 2,
        keep_last: 2,
        save_every: args.save_every as u64,
        async_save: mode == Mode::Background,
        out: Some(out.clone()),
        ..crate::train_job::small_face(args.classes, args.embedding)
    };
    let file = dir.join(format!("face-{mode:?}.toml"));
    let mut cmd = crate::train_job::train_command(&crate::tandem_exe()?, &cfg, &file)?;
    let result = cmd.current_dir(dir).output();
    let result = result.context("running tandem train")?;
    if !result.status.success() {
        bail!("tandem train ({mode:?}) failed:\n{}", String::from_utf8_lossy(&result.stderr));
    }
    let metrics = out.join("metrics.jsonl");
    let summary = tandem::train::metrics::last_summary(&metrics)?
        .with_context(|| format!("no run summary in {}", metrics.display()))?;
    let t =
        summary.step_times.with_context(|| format!("no step times in {}", metrics.display()))?;
    let step = t.total() / t.steps.max(1) as f64;
    Ok((t.save / t.saves.max(1) as f64, step))
}

/// `--face`: the face recipe's checkpoint stall, synchronous against background.
fn run_face(args: &Args, dir: &std::path::Path) -> anyhow::Result<Results> {
    crate::train_job::face_set(dir, 64, 200)?;
    let head_mib = (args.classes * args.embedding * 4 * 2) as f64 / (1 << 20) as f64;
    eprintln!(
        "face recipe, 2 ranks: IResNet-18 width 8 + PartialFC {} x {} ({head_mib:.0} MiB of centres + momentum, half per rank); {} steps, a save every {} and at the end",
        args.classes, args.embedding, args.steps, args.save_every
    );
    let (mut step, mut sync, mut bg) = (vec![], vec![], vec![]);
    for r in 0..args.repeat {
        eprintln!("run {}/{}", r + 1, args.repeat);
        let (s, t) = face_once(Mode::Sync, args, dir)?;
        let (b, u) = face_once(Mode::Background, args, dir)?;
        sync.push(s);
        bg.push(b);
        step.extend([t, u]);
    }
    Ok(Results {
        title: format!(
            "face checkpoint save stall, PartialFC {} x {} on 2 ranks ({head_mib:.0} MiB of head state), {} runs; seconds per save on rank 0",
            args.classes, args.embedding, args.repeat
        ),
        sync_over_background: median(sync.clone()) / median(bg.clone()).max(1e-9),
        rows: vec![
            ("training step (no save)".into(), step),
            ("stall of a save: synchronous".into(), sync),
            ("stall of a save: background".into(), bg),
        ],
    })
}

fn run(args: &Args, dir: &std::path::Path) -> anyhow::Result<Results> {
    let hidden = hidden_for(args.size_mib << 20);
    let state_mib = state_bytes(hidden) as f64 / (1 << 20) as f64;
    eprintln!(
        "MLP {INPUT}-{hidden}-{hidden}-10 + SGD momentum: {state_mib:.0} MiB of state; {} steps, a save every {}; {}",
        args.steps,
        args.save_every,
        dir.display()
    );
    let (mut step, mut sync_stall, mut bg_stall, mut copy) = (vec![], vec![], vec![], vec![]);
    let (mut sync_extra, mut bg_extra, mut drain) = (vec![], vec![], vec![]);
    for r in 0..args.repeat {
        eprintln!("run {}/{}", r + 1, args.repeat);
        let none = run_once(Mode::NoSave, args, hidden, dir)?;
        let sync = run_once(Mode::Sync, args, hidden, dir)?;
        let bg = run_once(Mode::Background, args, hidden, dir)?;
        // The first step warms allocations up: leave it out of the typical step.
        let typical = median(none.steps[1..].to_vec());
        let stall = |t: &RunTimes| {
            let v: Vec<f64> = t
                .steps
                .iter()
                .zip(&t.saved)
                .filter(|(_, s)| **s)
                .map(|(x, _)| x - typical)
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        step.push(typical);
        sync_stall.push(stall(&sync));
        bg_stall.push(stall(&bg));
        copy.push(bg.copy.iter().sum::<f64>() / bg.copy.len() as f64);
        let saves = bg.copy.len() as f64;
        sync_extra.push((sync.total() - none.total()) / saves);
        bg_extra.push((bg.total() - none.total()) / saves);
        drain.push(bg.drain);
    }
    Ok(Results {
        title: format!(
            "checkpoint save stall, {state_mib:.0} MiB of state (MLP {INPUT}-{hidden}-{hidden}-10 + momentum), {} runs; seconds",
            args.repeat
        ),
        sync_over_background: median(sync_stall.clone()) / median(bg_stall.clone()).max(1e-9),
        rows: vec![
            ("training step without a save".into(), step),
            ("stall of a save step: synchronous".into(), sync_stall),
            ("stall of a save step: background".into(), bg_stall),
            ("  of which copying the state to host memory".into(), copy),
            ("run time added per save: synchronous".into(), sync_extra),
            ("run time added per save: background".into(), bg_extra),
            ("waiting for the last background write".into(), drain),
        ],
    })
}
