//! The Trainer as a library user drives it: a recipe of a few lines, a world of one, and the
//! run's events through a `Reporter` — in order, typed, and the same figures the run directory's
//! metrics file and the returned summary hold.
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use tandem_data::datasets::digits;
use tandem_data::{Batch, DataLoader, DistributedSampler, InMemoryDataset, LoaderOptions};
use tandem_nn::NamedVars;
use tandem_optim::{SgdConfig, TorchOptimizer, TorchSgd};
use tandem_train::events::{Event, Recorder, StepEvent};
use tandem_train::metrics::{read_metrics, MetricsRecord};
use tandem_train::{
    Periodic, Recipe, Reporter, Step, StepReport, Trainer, TrainerOptions, TrainingState,
};

/// Softmax regression on the digits: the whole recipe a user writes for this loop.
struct Softmax {
    vars: NamedVars,
    w: Var,
    opt: TorchSgd,
}

impl Recipe for Softmax {
    type Data = InMemoryDataset;

    fn train_step(
        &mut self,
        b: &Batch,
        step: &mut Step,
        n: u64,
    ) -> tandem_train::Result<StepReport> {
        let x = b.x.flatten_from(1)?;
        let loss = candle_nn::loss::cross_entropy(&x.matmul(self.w.as_tensor())?, &b.y)?;
        step.run(&loss, |l| l.backward(), &mut self.opt, &[], n)?;
        let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(StepReport { loss, samples: b.len(), ..StepReport::default() })
    }

    fn optimizer(&mut self) -> &mut dyn TorchOptimizer {
        &mut self.opt
    }

    fn state(&mut self) -> Option<TrainingState<'_>> {
        Some(TrainingState::new(&self.vars, &mut self.opt))
    }
}

#[test]
fn a_run_reports_its_events_in_order_and_the_files_agree() {
    let dir = tempfile::tempdir().unwrap();
    let group = tandem_comm::init_from(&tandem_comm::InitMethod::Single).unwrap();
    let (train, _) = digits().unwrap();
    let train = Arc::new(train);
    let sampler = DistributedSampler::builder(tandem_data::Dataset::len(&*train))
        .group(&group)
        .seed(3)
        .build()
        .unwrap();
    let options = LoaderOptions { batch_size: 256, ..LoaderOptions::default() };
    let loader = DataLoader::new(Arc::clone(&train), sampler, options, Device::Cpu).unwrap();
    let batches = loader.len() as u64;
    let w = Var::from_tensor(&Tensor::zeros((64, 10), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let vars = NamedVars::new(vec![("w".into(), w.clone())]);
    let opt =
        TorchSgd::new(vec![w.clone()], SgdConfig { lr: 0.05, ..SgdConfig::default() }).unwrap();
    let recorder = Recorder::new();
    let mut opts = TrainerOptions::new(dir.path(), 2);
    opts.checkpoints = Arc::new(Periodic::every(3));
    let trainer = Trainer::new(Softmax { vars, w, opt }, loader, Step::new(), group, opts).unwrap();
    let summary = trainer.reporter(Reporter::new().with(recorder.clone())).fit().unwrap();

    let events = recorder.events();
    let total = 2 * batches;
    assert_eq!(events.first(), Some(&Event::Started { total, done: 0 }), "{events:?}");
    let steps: Vec<&StepEvent> = events
        .iter()
        .filter_map(|e| match e {
            Event::Step(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(
        steps.iter().map(|s| s.global_step).collect::<Vec<_>>(),
        (1..=total).collect::<Vec<_>>()
    );
    assert!(steps
        .iter()
        .all(|s| s.loss.is_some_and(f64::is_finite) && s.lr == 0.05 && s.batch > 0));
    assert_eq!(steps[(batches - 1) as usize].epoch, 0);
    assert_eq!(steps[batches as usize].epoch, 1, "the second epoch's first step");
    // Saves every 3 steps, at the first epoch's end unless that step was one, and at the end.
    let saved: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::CheckpointSaved { step, path } => {
                let file = dir.path().join(format!("checkpoints/checkpoint-step-{step:08}.pt"));
                assert_eq!(path.as_deref(), Some(file.as_path()));
                Some(*step)
            }
            _ => None,
        })
        .collect();
    let mut want: Vec<u64> = (1..total).filter(|s| s.is_multiple_of(3)).collect();
    if !batches.is_multiple_of(3) {
        want.push(batches);
        want.sort_unstable();
    }
    want.push(total);
    assert_eq!(saved, want);
    let epochs: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::EpochEnded { metrics, epochs } => {
                assert_eq!(*epochs, 2);
                Some(metrics.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(epochs, summary.epochs_seen);
    assert_eq!(epochs.iter().map(|e| e.step).collect::<Vec<_>>(), [batches, total]);
    assert!(epochs[1].train_loss < epochs[0].train_loss, "{epochs:?}");
    assert_eq!(events.last(), Some(&Event::Finished(Box::new(summary.clone()))));
    // Only the Trainer's own loggers wrote files: the metrics file holds the same records.
    let records = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    let mut want: Vec<MetricsRecord> = epochs.into_iter().map(MetricsRecord::Epoch).collect();
    want.push(MetricsRecord::Summary(summary));
    assert_eq!(records, want);
}
