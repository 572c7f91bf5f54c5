//! Uneven distributed evaluation on a real process group (ranks as threads over loopback TCP):
//! every eval sample counted exactly once, and the totals equal a single process's.
use std::sync::Arc;

use candle_core::Device;
use tandem_comm::InitMethod;
use tandem_data::{datasets, evaluate, Batch, DataError, EvalMetrics, LoaderOptions};

/// A fixed "model": predicts (rounded pixel sum) mod 10; per-sample loss is the pixel mean.
fn step(batch: &Batch) -> Result<(f64, i64), DataError> {
    let x = batch.x.to_vec2::<f32>()?;
    let y = batch.y.to_vec1::<u32>()?;
    let mut loss = 0f64;
    let mut correct = 0;
    for (row, &label) in x.iter().zip(&y) {
        let sum: f32 = row.iter().sum();
        loss += f64::from(sum) / row.len() as f64;
        correct += i64::from((sum.round() as u32) % 10 == label);
    }
    Ok((loss, correct))
}

fn single_process() -> EvalMetrics {
    let (_, eval) = datasets::digits().unwrap();
    let pg = tandem_comm::init_from(&InitMethod::Single).unwrap();
    evaluate(&pg, Arc::new(eval), &LoaderOptions::new(32), Device::Cpu, step).unwrap()
}

#[test]
fn distributed_eval_equals_single_process() {
    let single = single_process();
    assert_eq!(single.count, 297);
    assert!(single.correct > 0 && single.correct < 297, "{single:?}");
    // 297 samples over 4 ranks: 75/74/74/74; a padded DistributedSampler would count 300.
    for world in [2, 4, 7] {
        let results = tandem_testutil::run_tcp_world(world, |pg| {
            let (_, eval) = datasets::digits().unwrap();
            let opts = LoaderOptions { batch_size: 16, num_workers: 2, ..LoaderOptions::default() };
            evaluate(&pg, Arc::new(eval), &opts, Device::Cpu, step).unwrap()
        });
        for (rank, m) in results.iter().enumerate() {
            assert_eq!(
                (m.correct, m.count),
                (single.correct, single.count),
                "world {world} rank {rank}"
            );
            assert_eq!(m.accuracy(), single.accuracy());
            assert!(
                (m.loss_sum - single.loss_sum).abs() <= 1e-9 * single.loss_sum.abs(),
                "{m:?} vs {single:?}"
            );
            assert_eq!(m, &results[0], "every rank gets the same totals");
        }
    }
}

#[test]
fn ranks_with_nothing_to_evaluate_still_join() {
    // 3 samples, 5 ranks: ranks 3 and 4 have empty shares and must not hang the others.
    let results = tandem_testutil::run_tcp_world(5, |pg| {
        let ds = Arc::new(datasets::synthetic(3, 4, 2, 0).unwrap());
        evaluate(&pg, ds, &LoaderOptions::new(2), Device::Cpu, |b| {
            Ok((b.len() as f64 * 0.5, b.len() as i64))
        })
        .unwrap()
    });
    for m in results {
        assert_eq!(m, EvalMetrics { loss_sum: 1.5, correct: 3, count: 3 });
    }
}
