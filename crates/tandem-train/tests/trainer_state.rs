//! A recipe that gives its state (`Recipe::state`) and leaves saving, resuming and moving it to
//! the Trainer: a run stopped and resumed ends with the same bits as one run straight through
//! (weights, momentum, schedule, loss scale and loader position all restored), background saves
//! keep the last N, the files are what `tandem_train::load_state` reads, and a recipe that
//! neither gives its state nor saves it is told so.
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder, VarMap};
use tandem_data::datasets::digits;
use tandem_data::{Batch, DataLoader, DistributedSampler, InMemoryDataset, LoaderOptions};
use tandem_nn::NamedVars;
use tandem_optim::{GradScaler, GradScalerConfig, SgdConfig, TorchOptimizer, TorchSgd};
use tandem_train::events::{Event, Recorder};
use tandem_train::{LrSchedule, Recipe, Reporter, RunLength, Step, Trainer, TrainerOptions};
use tandem_train::{Periodic, StepReport, TrainingState};

const EPOCHS: u64 = 3;

/// Softmax regression on the digits whose state the Trainer handles.
struct Softmax {
    vars: NamedVars,
    w: Tensor,
    opt: TorchSgd,
    gives_state: bool,
}

impl Recipe for Softmax {
    type Data = InMemoryDataset;

    fn train_step(
        &mut self,
        b: &Batch,
        step: &mut Step,
        n: u64,
    ) -> tandem_train::Result<StepReport> {
        let loss = candle_nn::loss::cross_entropy(&b.x.flatten_from(1)?.matmul(&self.w)?, &b.y)?;
        step.run(&loss, |l| l.backward(), &mut self.opt, &[], n)?;
        let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(StepReport { loss, samples: b.len(), ..StepReport::default() })
    }

    fn optimizer(&mut self) -> &mut dyn TorchOptimizer {
        &mut self.opt
    }

    fn state(&mut self) -> Option<TrainingState<'_>> {
        self.gives_state.then(|| TrainingState::new(&self.vars, &mut self.opt))
    }
}

/// A trainer over `dir` on a world of one: momentum SGD, a cosine schedule over `EPOCHS`
/// epochs and a GradScaler, so every part of the state matters to the next step.
fn trainer(dir: &Path, opts: impl FnOnce(&mut TrainerOptions)) -> Trainer<Softmax> {
    let group = tandem_comm::init_from(&tandem_comm::InitMethod::Single).unwrap();
    let (train, _) = digits().unwrap();
    let train = Arc::new(train);
    let sampler = DistributedSampler::builder(tandem_data::Dataset::len(&*train))
        .group(&group)
        .seed(5)
        .build()
        .unwrap();
    let options = LoaderOptions { batch_size: 128, ..LoaderOptions::default() };
    let loader = DataLoader::new(train, sampler, options, Device::Cpu).unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    // (Zeros: the same start in every run; softmax regression learns from them.)
    let w = vb.get_with_hints((64, 10), "w", Init::Const(0.0)).unwrap();
    let sgd = SgdConfig { lr: 0.02, momentum: 0.9, ..SgdConfig::default() };
    let mut opt = TorchSgd::new(varmap.all_vars(), sgd).unwrap();
    let run = RunLength::epochs(loader.len(), EPOCHS);
    let sched = LrSchedule::Cosine.build(&mut opt, 0.02, run).unwrap();
    let scaler = GradScaler::new(GradScalerConfig { growth_interval: 4, ..Default::default() });
    let step = Step::new().scaler(Some(scaler.unwrap())).scheduler(sched);
    let vars = NamedVars::from_varmap(&varmap);
    let recipe = Softmax { vars, w, opt, gives_state: true };
    let mut o = TrainerOptions::new(dir, EPOCHS);
    opts(&mut o);
    Trainer::new(recipe, loader, step, group, o).unwrap()
}

/// The weights at the end of a fit, as bits.
fn final_weights(trainer: Trainer<Softmax>) -> Vec<u32> {
    let w = trainer.recipe().w.clone();
    trainer.fit().unwrap();
    w.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_stopped_and_resumed_run_ends_with_the_bits_of_one_straight_through() {
    let straight = tempfile::tempdir().unwrap();
    let expected = final_weights(trainer(straight.path(), |_| {}));

    let split = tempfile::tempdir().unwrap();
    // Stops mid-epoch (step 17 of 12 per epoch), writing its last checkpoint there.
    let first = trainer(split.path(), |o| o.max_steps = Some(17));
    let recorder = Recorder::new();
    let summary = first.reporter(Reporter::new().with(recorder.clone())).fit().unwrap();
    assert_eq!(summary.steps, 17);
    let saved = summary.checkpoint.expect("rank 0 names its last checkpoint");
    assert!(saved.starts_with(split.path().join("checkpoints")), "{}", saved.display());

    let recorder = Recorder::new();
    let resumed = trainer(split.path(), |o| o.resume = true);
    let mut resumed = resumed.reporter(Reporter::new().with(recorder.clone()));
    resumed.resume().unwrap();
    let got = final_weights(resumed);
    let events = recorder.events();
    let from = events.iter().find_map(|e| match e {
        Event::Resumed { path, epoch, step, .. } => Some((path.clone(), *epoch, *step)),
        _ => None,
    });
    assert_eq!(from, Some((saved, 1, 17)), "{events:?}");
    assert_eq!(got, expected, "resumed at step 17, the run did not end where one run does");
}

#[test]
fn background_saves_keep_the_last_n_and_load_state_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let policy = Periodic::every(5).keeping(2).in_background(true);
    let t = trainer(dir.path(), |o| o.checkpoints = Arc::new(policy));
    let expected = final_weights(t);
    let ckpts = dir.path().join("checkpoints");
    let mut names: Vec<String> = std::fs::read_dir(&ckpts)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    names.sort();
    // 36 steps: saves at 5, 10, ..., 35 and the last at 36; two are kept.
    assert_eq!(names, ["checkpoint-step-00000035.pt", "checkpoint-step-00000036.pt"]);

    // The user's own API reads what the Trainer wrote: the final weights and the step.
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let w = vb.get_with_hints((64, 10), "w", Init::Const(0.0)).unwrap();
    let vars = NamedVars::from_varmap(&varmap);
    let mut opt = TorchSgd::new(varmap.all_vars(), SgdConfig::default()).unwrap();
    let mut state = TrainingState::new(&vars, &mut opt);
    let r = tandem_train::load_state(&ckpts, &mut state).unwrap().expect("a checkpoint");
    assert_eq!((r.step, r.epoch, r.world_size), (36, EPOCHS, 1));
    let bits: Vec<u32> =
        w.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits, expected);
}

#[test]
fn a_recipe_that_neither_gives_nor_saves_its_state_is_told_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(dir.path(), |_| {});
    t.recipe_mut().gives_state = false;
    let err = t.fit().unwrap_err().chain_text();
    assert!(err.contains("gives no state") && err.contains("Recipe::state"), "{err}");
}
