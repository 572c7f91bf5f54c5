//! A user's own loop (no `Trainer`) under `tandem run --live-recovery` keeps the state each rank
//! holds alone exactly as the `Trainer` does: the same job — a small model, AdamW, and either
//! ZeRO-1's optimizer shards or a PartialFC head whose class rows and moments are split over the
//! ranks — runs once as a `Recipe` under the `Trainer` and once as a hand-written loop through
//! `tandem::live` (`LiveTraining::after_step` and `regroup` on its `TrainingState`). Member 1 of
//! 3 SIGKILLs itself after the forward pass of the same step in both; the survivors regroup,
//! take its part from the mirror and finish on 2 ranks. The two final checkpoints must hold the
//! same bits: model, optimizer shards, head rows and their `exp_avg`/`exp_avg_sq`.
//!
//! The test binary is its own worker: `tandem run` starts it again with `LIVE_USER_LOOP_ROLE`.
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use tandem::ckpt::Value;
use tandem::data::{
    datasets, Batch, DataLoader, Dataset, DistributedSampler, InMemoryDataset, LoaderOptions,
};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::live::{is_peer_failure, LiveTraining, Mirrored};
use tandem::nn::functional::cross_entropy;
use tandem::nn::NamedVars;
use tandem::optim::{AdamWConfig, TorchAdamW, TorchOptimizer, ZeroRedundancyOptimizer};
use tandem::partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};
use tandem::recipes::face::{HeadPart, HEAD_SHARD};
use tandem::train::checkpoint::{Checkpointer, Saved};
use tandem::train::events::{Event, Logger};
use tandem::train::fault;
use tandem::train::state::OPTIMIZER_SHARD;
use tandem::train::{Recipe, Reporter, Step, StepReport, Trainer, TrainerOptions, TrainingState};
use tandem_testutil::harness;
use tandem_testutil::{output_with_deadline, without_world};

const ROLE: &str = "LIVE_USER_LOOP_ROLE";
const SETUP: &str = "LIVE_USER_LOOP_SETUP";
const OUT: &str = "LIVE_USER_LOOP_OUT";
/// Member 1 dies after the forward pass of this step (its first start only: the project's
/// test-only fault injection, `tandem_train::fault`).
const KILL_STEP: u64 = 5;
const EMBEDDING: usize = 16;
const CLASSES: usize = 10;
const BATCH: usize = 16;

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        return match worker(&role) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("worker ({role}): {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    harness::main_serial(tandem_testutil::tests![
        a_user_loop_keeps_zero_shards_as_the_trainer_does,
        a_user_loop_keeps_partial_fc_rows_and_moments_as_the_trainer_does,
    ])
}

fn a_user_loop_keeps_zero_shards_as_the_trainer_does() {
    same_state("zero")
}

fn a_user_loop_keeps_partial_fc_rows_and_moments_as_the_trainer_does() {
    same_state("head")
}

// ---------------------------------------------------------------------------------------------
// The test: both ways, then the checkpoints compared.

fn same_state(setup: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut finals = Vec::new();
    for role in ["trainer", "loop"] {
        let out = dir.path().join(role);
        let text = run_job(role, setup, &out);
        let regrouped: Vec<&str> = text.lines().filter(|l| l.contains("regrouped:")).collect();
        assert_eq!(regrouped.len(), 1, "{role}: one regroup expected:\n{text}");
        // The dead member's part came back from its buddy's mirror, none started afresh.
        let resplit = text.lines().find(|l| l.contains("resplit:")).unwrap_or_default();
        let from_mirror = number_after(resplit, "from_mirror: ");
        assert!(from_mirror > 0, "{role}: nothing came from the mirror: {resplit}\n{text}");
        assert_eq!(number_after(resplit, "fresh: "), 0, "{role}: {resplit}");
        assert!(text.contains("done: 2 ranks"), "{role} did not finish on 2 ranks:\n{text}");
        finals.push(Checkpointer::new(out.join("checkpoints"), 3).latest().unwrap().unwrap());
    }
    let (trainer, user) = (&finals[0], &finals[1]);
    assert_eq!(trainer.global_step(), user.global_step());
    assert!(trainer.global_step() > KILL_STEP);
    let model = |s: &Saved| s.replicated().unwrap().get("model").cloned().unwrap();
    assert_same_tensors("model", &model(trainer), &model(user));
    match setup {
        "zero" => {
            let entries = |s: &Saved| s.read_entries(OPTIMIZER_SHARD, None).unwrap();
            let (a, b) = (entries(trainer), entries(user));
            assert_eq!(count_tensors(&a), 12, "4 parameters' step, exp_avg and exp_avg_sq: {a:?}");
            assert_same_tensors("optimizer shards", &a, &b);
        }
        _ => {
            let rows = |s: &Saved| s.read_rows(HEAD_SHARD, 0..CLASSES).unwrap();
            let (a, b) = (rows(trainer), rows(user));
            assert_eq!(count_tensors(&a), 4, "weight; step, exp_avg, exp_avg_sq: {a:?}");
            assert_same_tensors("head rows", &a, &b);
        }
    }
}

fn run_job(role: &str, setup: &str, out: &Path) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    without_world(&mut cmd);
    cmd.args(["run", "--nproc-per-node", "3", "--max-restarts", "0", "--live-recovery", "--"])
        .arg(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .env(SETUP, setup)
        .env(OUT, out)
        .env("TANDEM_TEST_FAULT", format!("forward@{KILL_STEP}"))
        .env("TANDEM_TEST_FAULT_MEMBER", "1")
        .env("TANDEM_TIMEOUT", "10")
        .env("TANDEM_LIVE_ARRIVAL_TIMEOUT", "5");
    let run = output_with_deadline(&mut cmd, Duration::from_secs(180));
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{role}/{setup} failed ({:?}):\n{text}", run.status);
    text
}

fn number_after(line: &str, key: &str) -> u64 {
    let at = line.find(key).map(|i| i + key.len()).unwrap_or_else(|| panic!("{key} in {line}"));
    line[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
}

fn count_tensors(v: &Value) -> usize {
    match v {
        Value::Tensor(_) => 1,
        Value::Dict(items) => items.iter().map(|(_, v)| count_tensors(v)).sum(),
        Value::List(items) | Value::Tuple(items) => items.iter().map(count_tensors).sum(),
        _ => 0,
    }
}

/// Every tensor of `a` and `b` at the same place, bit for bit.
fn assert_same_tensors(what: &str, a: &Value, b: &Value) {
    match (a, b) {
        (Value::Tensor(x), Value::Tensor(y)) => {
            assert_eq!(x.shape, y.shape, "{what}");
            let (x, y) = (x.to_f32_vec(), y.to_f32_vec());
            let differ = x.iter().zip(&y).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
            assert_eq!(differ, 0, "{what}: {differ} of {} elements differ", x.len());
        }
        (Value::Dict(x), Value::Dict(y)) => {
            assert_eq!(x.len(), y.len(), "{what}: {x:?} against {y:?}");
            for ((kx, vx), (ky, vy)) in x.iter().zip(y) {
                assert_eq!(kx, ky, "{what}");
                assert_same_tensors(&format!("{what}/{kx:?}"), vx, vy);
            }
        }
        (Value::List(x), Value::List(y)) | (Value::Tuple(x), Value::Tuple(y)) => {
            assert_eq!(x.len(), y.len(), "{what}");
            for (i, (vx, vy)) in x.iter().zip(y).enumerate() {
                assert_same_tensors(&format!("{what}[{i}]"), vx, vy);
            }
        }
        _ => assert_eq!(a, b, "{what}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The worker: the same job as a Recipe and as a user's loop.

type Result<T> = anyhow::Result<T>;

/// The job's pieces, built the same way for both.
struct Job {
    ddp: Ddp<NamedVars>,
    opt: Box<dyn TorchOptimizer>,
    head: Option<HeadPart>,
}

impl Job {
    fn build(live: &LiveTraining, setup: &str) -> Result<Job> {
        let comm = live.collectives();
        let dev = Device::Cpu;
        // Same values on every rank (Ddp checks it): a fixed pattern, not a draw.
        let var = |rows: usize, cols: usize, seed: f32| -> Result<Var> {
            let n = rows * cols;
            let data: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.37 + seed).sin()) * 0.2).collect();
            let t = Tensor::from_vec(data, (rows, cols), &dev)?;
            Ok(Var::from_tensor(&if cols == 1 { t.flatten_all()? } else { t })?)
        };
        let mut named = vec![
            ("fc1.weight".to_string(), var(EMBEDDING, 64, 0.1)?),
            ("fc1.bias".to_string(), var(EMBEDDING, 1, 0.2)?),
        ];
        let zero = setup == "zero";
        if zero {
            named.push(("fc2.weight".to_string(), var(CLASSES, EMBEDDING, 0.3)?));
            named.push(("fc2.bias".to_string(), var(CLASSES, 1, 0.4)?));
        }
        let ddp = Ddp::with_comm(NamedVars::new(named), comm.clone(), DdpOptions::default())?;
        let adamw = AdamWConfig { lr: 0.01, ..Default::default() };
        if zero {
            let make = move |params: Vec<Var>| -> std::result::Result<_, _> {
                let opt: Box<dyn TorchOptimizer + Send> =
                    Box::new(TorchAdamW::new(params, adamw.clone())?);
                Ok(opt)
            };
            let opt = ZeroRedundancyOptimizer::new(ddp.params(), comm, make)?;
            return Ok(Job { ddp, opt: Box::new(opt), head: None });
        }
        let cfg = PartialFcConfig::new(CLASSES, EMBEDDING, CombinedMarginLoss::arcface(16.0, 0.3));
        let pfc = PartialFc::new(cfg, comm.clone(), &dev)?;
        let groups = vec![(ddp.params(), adamw.clone()), (vec![pfc.weight().clone()], adamw)];
        let opt = TorchAdamW::with_groups(groups)?;
        let mirror = Mirrored::new(1, !live.is_replacement());
        let head = HeadPart::new(pfc, ddp.params().len(), comm.size(), Some(mirror));
        Ok(Job { ddp, opt: Box::new(opt), head: Some(head) })
    }

    fn embed(&self, x: &Tensor) -> Result<Tensor> {
        let p = self.ddp.params();
        Ok(x.matmul(&p[0].as_tensor().t()?)?.broadcast_add(p[1].as_tensor())?.relu()?)
    }

    /// One optimizer step on `batch`: the same arithmetic in both roles.
    fn step(&mut self, batch: &Batch, step: &mut Step, n: u64) -> Result<f64> {
        let embedding = self.embed(&batch.x)?;
        let params = self.ddp.params();
        let loss = match self.head.as_mut() {
            Some(head) => {
                let labels: Vec<i64> = batch.labels.iter().map(|&l| i64::from(l)).collect();
                head.head.forward(&embedding, &labels)?
            }
            None => {
                let logits = embedding
                    .matmul(&params[2].as_tensor().t()?)?
                    .broadcast_add(params[3].as_tensor())?;
                cross_entropy(&logits, &batch.y)?
            }
        };
        // Member 1 dies here at KILL_STEP (TANDEM_TEST_FAULT, set by the test).
        fault::set_step(n);
        fault::hit(fault::Phase::Forward);
        let local: Vec<Var> = self.head.iter().map(|h| h.head.weight().clone()).collect();
        let ddp = &self.ddp;
        let backward = |l: &Tensor| ddp.backward_with_local(l, &local);
        step.run(&loss, backward, self.opt.as_mut(), &params, n)?;
        if let Some(head) = self.head.as_mut() {
            head.stepped(n);
        }
        Ok(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?)
    }

    fn state(&mut self) -> TrainingState<'_> {
        let state = TrainingState::new(&self.ddp, &mut self.opt);
        match self.head.as_mut() {
            Some(head) => state.part(head),
            None => state,
        }
    }
}

fn loader(live: &LiveTraining) -> Result<DataLoader<InMemoryDataset>> {
    let (train, _) = datasets::digits()?;
    let (rank, world) = live.rank_and_size();
    let sampler =
        DistributedSampler::builder(train.len()).num_replicas(world).rank(rank).seed(3).build()?;
    let options = LoaderOptions { drop_last: true, ..LoaderOptions::new(BATCH) };
    Ok(DataLoader::new(Arc::new(train), sampler, options, Device::Cpu)?)
}

fn worker(role: &str) -> Result<()> {
    let setup = std::env::var(SETUP)?;
    let out = PathBuf::from(std::env::var(OUT)?);
    let live = LiveTraining::connect()?;
    let job = Job::build(&live, &setup)?;
    let loader = loader(&live)?;
    match role {
        "trainer" => with_trainer(live, job, loader, &out),
        _ => own_loop(live, job, loader, &out),
    }
}

/// The job as a `Recipe` under the `Trainer`.
struct JobRecipe(Job);

impl Recipe for JobRecipe {
    type Data = InMemoryDataset;
    fn train_step(
        &mut self,
        batch: &Batch,
        step: &mut Step,
        n: u64,
    ) -> tandem::train::Result<StepReport> {
        let stepped = self.0.step(batch, step, n);
        let loss = stepped.map_err(|e| tandem::train::TrainError::invalid(format!("{e:#}")))?;
        Ok(StepReport { loss, samples: batch.len(), ..StepReport::default() })
    }
    fn optimizer(&mut self) -> &mut dyn TorchOptimizer {
        self.0.opt.as_mut()
    }
    fn state(&mut self) -> Option<TrainingState<'_>> {
        Some(self.0.state())
    }
}

fn with_trainer(
    live: LiveTraining,
    job: Job,
    loader: DataLoader<InMemoryDataset>,
    out: &Path,
) -> Result<()> {
    let group = live.group();
    let opts = TrainerOptions::new(out, 1);
    let reporter = Reporter::new();
    reporter.add(Box::new(Regroups));
    let trainer = Trainer::new(JobRecipe(job), loader, Step::new(), group, opts)?;
    let mut trainer = trainer.reporter(reporter).live(live);
    trainer.join_live()?;
    let summary = trainer.fit()?;
    if summary.rank == 0 {
        println!("done: {} ranks", summary.peak_rss_bytes.len());
    }
    Ok(())
}

/// Prints the Trainer's regroups as the user's loop prints its own.
struct Regroups;

impl Logger for Regroups {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        if let Event::Regrouped(r) = event {
            println!("regrouped: {}", r.change);
            if let Some(resplit) = &r.resplit {
                println!("resplit: {resplit:?}");
            }
        }
        Ok(())
    }
}

/// The same job in the user's own loop, as examples/live_recovery.rs writes it, with the parts.
fn own_loop(
    live: LiveTraining,
    mut job: Job,
    mut loader: DataLoader<InMemoryDataset>,
    out: &Path,
) -> Result<()> {
    let mut step = Step::new();
    let mut n = 0u64;
    live.start(&mut job.state().loader(&mut loader))?;
    while loader.epoch() < 1 {
        let mut failed_at = None;
        let mut regroup;
        let mut batches = loader.iter()?;
        loop {
            match live.regroup_wanted() {
                Ok(wanted) => regroup = wanted,
                Err(e) if is_peer_failure(&e) => regroup = true,
                Err(e) => return Err(e.into()),
            }
            if regroup {
                break;
            }
            let before = loader.state(); // where this step takes its batch from
            let Some(batch) = batches.next() else { break };
            let batch = batch?;
            let stepped = job
                .step(&batch, &mut step, n + 1)
                .and_then(|_| Ok(live.after_step(&mut job.state().step(n + 1))?));
            match stepped {
                Ok(()) => n += 1,
                // (A collective that failed inside a layer may reach here as text only; the
                // group knows it broke.)
                Err(e) if e.chain().any(is_peer_failure) || live.group().failure().is_some() => {
                    failed_at = Some(before);
                    regroup = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        drop(batches);
        if !regroup {
            continue;
        }
        if let Some(position) = failed_at {
            loader.load_state(&position)?;
        }
        let mut state = job.state().loader(&mut loader).step(n);
        let change = live.regroup(&mut state)?;
        n = state.step;
        if live.group().rank() == 0 {
            println!("regrouped: {change}");
            if let Some(resplit) = &change.resplit {
                println!("resplit: {resplit:?}");
            }
        }
    }
    let group = live.group();
    let state = job.state().loader(&mut loader).step(n).epoch(1);
    tandem::save_state(&group, out.join("checkpoints"), &state)?;
    if group.rank() == 0 {
        println!("done: {} ranks", group.size());
    }
    live.finish()?;
    Ok(())
}
