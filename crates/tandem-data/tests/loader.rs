//! DataLoader: batches follow the sampler order exactly whatever the worker count, collate the
//! right rows, resume mid-epoch from a saved state, and surface dataset errors.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::Device;
use tandem_data::{
    datasets, DataError, DataLoader, Dataset, DistributedSampler, Example, InMemoryDataset,
    LoaderOptions,
};

fn small_dataset(n: usize) -> Arc<InMemoryDataset> {
    // Row i is [i, i + 0.5, -i], label i % 7: every value says where it came from.
    let features: Vec<f32> = (0..n).flat_map(|i| [i as f32, i as f32 + 0.5, -(i as f32)]).collect();
    let labels: Vec<i64> = (0..n).map(|i| (i % 7) as i64).collect();
    Arc::new(InMemoryDataset::new("rows", features, labels, 3, 7).unwrap())
}

fn opts(batch_size: usize, drop_last: bool, num_workers: usize) -> LoaderOptions {
    LoaderOptions { batch_size, drop_last, num_workers, prefetch_factor: 2 }
}

/// A batch read back: (indices, x rows, labels).
type Rows = (Vec<usize>, Vec<Vec<f32>>, Vec<u32>);

/// Every batch of one epoch.
fn run_epoch<D: Dataset + ?Sized + 'static>(loader: &DataLoader<D>) -> Vec<Rows> {
    loader
        .iter()
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            let y = b.y.to_vec1::<u32>().unwrap();
            assert_eq!(b.labels, y, "the host labels are y's values");
            (b.indices.clone(), b.x.to_vec2::<f32>().unwrap(), y)
        })
        .collect()
}

#[test]
fn batches_follow_sampler_order_and_rows_for_any_worker_count() {
    let ds = small_dataset(103);
    let mut sampler = DistributedSampler::new(103, 3, 2, true, 11, false).unwrap();
    sampler.set_epoch(4);
    let want = sampler.indices();
    let mut reference = None;
    for workers in [0, 1, 3, 8] {
        let loader =
            DataLoader::new(ds.clone(), sampler.clone(), opts(5, false, workers), Device::Cpu)
                .unwrap();
        let batches = run_epoch(&loader);
        assert_eq!(batches.len(), loader.len());
        assert_eq!(batches.len(), 7); // 35 samples in batches of 5
        let flat: Vec<usize> = batches.iter().flat_map(|b| b.0.clone()).collect();
        assert_eq!(flat, want, "{workers} workers");
        for (indices, x, y) in &batches {
            for ((&i, row), &label) in indices.iter().zip(x).zip(y) {
                assert_eq!(row, &vec![i as f32, i as f32 + 0.5, -(i as f32)]);
                assert_eq!(label as usize, i % 7);
            }
        }
        match &reference {
            None => reference = Some(batches),
            Some(r) => assert_eq!(r, &batches, "{workers} workers differ from 0 workers"),
        }
    }
}

#[test]
fn drop_last_drops_the_short_batch() {
    let ds = small_dataset(23);
    let sampler = DistributedSampler::new(23, 1, 0, false, 0, false).unwrap();
    let loader =
        DataLoader::new(ds.clone(), sampler.clone(), opts(5, true, 2), Device::Cpu).unwrap();
    let sizes: Vec<usize> = run_epoch(&loader).iter().map(|b| b.0.len()).collect();
    assert_eq!(sizes, vec![5, 5, 5, 5]);
    let loader = DataLoader::new(ds, sampler, opts(5, false, 2), Device::Cpu).unwrap();
    let sizes: Vec<usize> = run_epoch(&loader).iter().map(|b| b.0.len()).collect();
    assert_eq!(sizes, vec![5, 5, 5, 5, 3]);
}

#[test]
fn resume_mid_epoch_gives_the_rest_of_the_epoch() {
    let ds = small_dataset(200);
    let sampler = DistributedSampler::new(200, 4, 1, true, 5, false).unwrap();
    let mut a =
        DataLoader::new(ds.clone(), sampler.clone(), opts(8, false, 2), Device::Cpu).unwrap();
    a.set_epoch(3);
    let full: Vec<Vec<usize>> = run_epoch(&a).into_iter().map(|b| b.0).collect();
    // The finished epoch moved the state on to epoch 4, position 0.
    assert_eq!((a.state().epoch, a.state().consumed), (4, 0));

    a.set_epoch(3);
    let mut saved = None;
    for (k, batch) in a.iter().unwrap().enumerate() {
        batch.unwrap();
        if k == 2 {
            saved = Some(a.state()); // taken inside the loop, as a training job would
            break;
        }
    }
    let saved = saved.unwrap();
    assert_eq!((saved.epoch, saved.consumed), (3, 24));

    // Another process (here rank 1 again) restores it and runs the usual epoch loop.
    let mut b = DataLoader::new(ds, sampler, opts(8, false, 3), Device::Cpu).unwrap();
    b.load_state(&serde_json::from_str(&serde_json::to_string(&saved).unwrap()).unwrap()).unwrap();
    b.set_epoch(3);
    let rest: Vec<Vec<usize>> = run_epoch(&b).into_iter().map(|b| b.0).collect();
    assert_eq!(rest, full[3..].to_vec());
    assert_eq!(b.epoch(), 4);
}

#[test]
fn an_epoch_resumed_on_another_world_size_has_equal_batch_counts_and_no_repeats() {
    // 203 samples, 2 ranks of batch 8 take 5 steps (80 samples); 3 ranks take the other 123.
    let (len, batch) = (203, 8);
    let ds = small_dataset(len);
    let mut seen = Vec::new();
    let mut saved = None;
    for rank in 0..2 {
        let sampler = DistributedSampler::new(len, 2, rank, true, 3, false).unwrap();
        let mut a =
            DataLoader::new(ds.clone(), sampler, opts(batch, false, 1), Device::Cpu).unwrap();
        a.set_epoch(2);
        for b in a.iter().unwrap().take(5) {
            seen.extend(b.unwrap().indices);
        }
        saved.get_or_insert(a.state());
    }
    let saved = saved.unwrap();
    let mut steps = Vec::new();
    for rank in 0..3 {
        let sampler = DistributedSampler::new(len, 3, rank, true, 3, false).unwrap();
        let mut b =
            DataLoader::new(ds.clone(), sampler, opts(batch, false, 2), Device::Cpu).unwrap();
        b.load_state(&saved).unwrap();
        assert_eq!(b.batches_left(), 123usize.div_ceil(3 * batch));
        let batches = run_epoch(&b);
        steps.push(batches.len());
        seen.extend(batches.into_iter().flat_map(|r| r.0));
        // The epoch closed: the next one is PyTorch's split for 3 ranks.
        assert_eq!((b.epoch(), b.state().start, b.state().consumed), (3, 0, 0));
    }
    assert_eq!(steps, vec![6, 6, 6]);
    seen.sort_unstable();
    assert_eq!(seen, (0..len).collect::<Vec<_>>());
}

#[test]
fn epochs_differ_and_repeat_with_the_same_seed() {
    let ds = small_dataset(64);
    let sampler = DistributedSampler::new(64, 2, 0, true, 1, false).unwrap();
    let mut a =
        DataLoader::new(ds.clone(), sampler.clone(), opts(4, false, 1), Device::Cpu).unwrap();
    a.set_epoch(0);
    let e0 = run_epoch(&a);
    // No set_epoch: the loader moved to epoch 1 by itself.
    let e1 = run_epoch(&a);
    assert_ne!(e0, e1);
    let mut b = DataLoader::new(ds, sampler, opts(4, false, 0), Device::Cpu).unwrap();
    b.set_epoch(1);
    assert_eq!(run_epoch(&b), e1);
}

#[test]
fn dropping_the_iterator_early_stops_the_workers() {
    let ds = small_dataset(1000);
    let sampler = DistributedSampler::new(1000, 1, 0, true, 0, false).unwrap();
    let loader = DataLoader::new(ds, sampler, opts(2, false, 4), Device::Cpu).unwrap();
    let mut it = loader.iter().unwrap();
    it.next().unwrap().unwrap();
    drop(it); // joins the workers; would hang here if a worker stayed blocked on its channel
    assert_eq!(loader.state().consumed, 2);
}

/// Fails on one index, counts calls.
struct Flaky {
    bad: usize,
    calls: AtomicUsize,
}

impl Dataset for Flaky {
    fn len(&self) -> usize {
        50
    }
    fn input_dim(&self) -> usize {
        2
    }
    fn num_classes(&self) -> usize {
        2
    }
    fn get(&self, index: usize) -> Result<Example, DataError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if index == self.bad {
            return Err(DataError::IndexOutOfRange { index, len: 0 });
        }
        Ok(Example { features: vec![0.0; 2], label: (index % 2) as i64 })
    }
}

#[test]
fn dataset_errors_surface_and_end_the_epoch() {
    for workers in [0, 3] {
        let ds = Arc::new(Flaky { bad: 17, calls: AtomicUsize::new(0) });
        let sampler = DistributedSampler::new(50, 1, 0, false, 0, false).unwrap();
        let loader = DataLoader::new(ds, sampler, opts(4, false, workers), Device::Cpu).unwrap();
        let results: Vec<_> = loader.iter().unwrap().collect();
        // Batches 0..=3 are fine, batch 4 holds index 17, then the iterator stops.
        assert_eq!(results.len(), 5, "{workers} workers");
        assert!(results[..4].iter().all(Result::is_ok));
        let err = results[4].as_ref().unwrap_err().to_string();
        assert!(err.contains("index 17"), "{err}");
        assert_eq!(loader.state().consumed, 16);
    }
}

#[test]
fn bad_labels_and_shapes_are_errors() {
    struct Bad;
    impl Dataset for Bad {
        fn len(&self) -> usize {
            2
        }
        fn input_dim(&self) -> usize {
            3
        }
        fn num_classes(&self) -> usize {
            4
        }
        fn get(&self, index: usize) -> Result<Example, DataError> {
            Ok(if index == 0 {
                Example { features: vec![0.0; 2], label: 0 }
            } else {
                Example { features: vec![0.0; 3], label: 9 }
            })
        }
    }
    let e = tandem_data::collate(&Bad, &[0]).unwrap_err().to_string();
    assert!(e.contains("example 0") && e.contains("expected 3"), "{e}");
    let e = tandem_data::collate(&Bad, &[1]).unwrap_err().to_string();
    assert!(e.contains("label 9"), "{e}");
    assert!(InMemoryDataset::new("x", vec![0.0; 4], vec![0, 5], 2, 3).is_err());
    assert!(InMemoryDataset::new("x", vec![0.0; 5], vec![0, 1], 2, 3).is_err());
}

#[test]
fn constructor_checks() {
    let ds = small_dataset(10);
    let e = DataLoader::new(
        ds.clone(),
        DistributedSampler::new(11, 1, 0, false, 0, false).unwrap(),
        opts(2, false, 0),
        Device::Cpu,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("11") && e.contains("10"), "{e}");
    let e = DataLoader::new(
        ds,
        DistributedSampler::new(10, 1, 0, false, 0, false).unwrap(),
        opts(0, false, 0),
        Device::Cpu,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("batch_size"), "{e}");
}

#[test]
fn digits_through_the_loader() {
    let (train, _) = datasets::digits().unwrap();
    let train = Arc::new(train);
    let sampler = DistributedSampler::new(train.len(), 2, 1, true, 0, false).unwrap();
    let loader = DataLoader::new(train.clone(), sampler, opts(64, false, 2), Device::Cpu).unwrap();
    let mut seen = 0;
    for batch in loader.iter().unwrap() {
        let batch = batch.unwrap();
        assert_eq!(batch.x.dims()[1], 64);
        assert_eq!(batch.x.dtype(), candle_core::DType::F32);
        assert_eq!(batch.y.dtype(), candle_core::DType::U32);
        seen += batch.len();
    }
    assert_eq!(seen, 750);
}

#[test]
fn works_with_a_trait_object_dataset() {
    let (train, _) = datasets::from_spec("synthetic:40:5:3").unwrap();
    let ds: Arc<dyn Dataset> = Arc::new(train);
    let sampler = DistributedSampler::new(40, 2, 0, true, 0, true).unwrap();
    let loader = DataLoader::new(ds, sampler.clone(), opts(6, false, 2), Device::Cpu).unwrap();
    let flat: Vec<usize> = run_epoch(&loader).into_iter().flat_map(|b| b.0).collect();
    assert_eq!(flat, sampler.indices());
}

#[test]
fn a_panicking_worker_becomes_an_error_not_a_hang() {
    struct Panics;
    impl Dataset for Panics {
        fn len(&self) -> usize {
            20
        }
        fn input_dim(&self) -> usize {
            1
        }
        fn num_classes(&self) -> usize {
            2
        }
        fn get(&self, index: usize) -> Result<Example, DataError> {
            if index == 9 {
                panic!("decoder exploded on 9");
            }
            Ok(Example { features: vec![index as f32], label: 0 })
        }
    }
    let sampler = DistributedSampler::new(20, 1, 0, false, 0, false).unwrap();
    let loader =
        DataLoader::new(Arc::new(Panics), sampler, opts(4, false, 2), Device::Cpu).unwrap();
    let results: Vec<_> = loader.iter().unwrap().collect();
    // Batches 0 and 1 are fine; batch 2 (indices 8..12) was on worker 0, which panicked.
    assert_eq!(results.len(), 3);
    let err = results[2].as_ref().unwrap_err().to_string();
    assert!(err.contains("worker 0") && err.contains("decoder exploded on 9"), "{err}");
}
