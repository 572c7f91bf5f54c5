//! Property tests of DistributedSampler's coverage, shard lengths and resumable position, and
//! of the uneven evaluation split. Case counts are small to keep the suite fast.
use proptest::prelude::*;
use tandem_data::{eval_indices, DistributedSampler, SamplerState};

fn shards(
    len: usize,
    r: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    (0..r)
        .map(|rank| {
            let mut s = DistributedSampler::new(len, r, rank, shuffle, seed, drop_last).unwrap();
            s.set_epoch(epoch);
            assert_eq!(s.indices().len(), s.len());
            s.indices()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn padded_shards_cover_everything(len in 0usize..300, r in 1usize..10, shuffle: bool, seed: u64, epoch in 0u64..50) {
        let all = shards(len, r, shuffle, seed, epoch, false);
        let per_rank = len.div_ceil(r);
        for s in &all {
            prop_assert_eq!(s.len(), per_rank);
        }
        let mut counts = vec![0usize; len];
        for &i in all.iter().flatten() {
            prop_assert!(i < len);
            counts[i] += 1;
        }
        // Every sample is seen; padding adds per_rank * r - len extra copies in total, spread
        // as evenly as repeating the list from its start allows.
        let total = per_rank * r;
        if len > 0 {
            prop_assert!(counts.iter().all(|&c| c >= 1));
            let max = total.div_ceil(len);
            prop_assert!(counts.iter().all(|&c| c <= max && c + 1 >= max));
        }
        prop_assert_eq!(counts.iter().sum::<usize>(), total);
    }

    #[test]
    fn drop_last_shards_are_disjoint_and_equal(len in 0usize..300, r in 1usize..10, shuffle: bool, seed: u64, epoch in 0u64..50) {
        let all = shards(len, r, shuffle, seed, epoch, true);
        let mut seen = vec![false; len];
        for s in &all {
            prop_assert_eq!(s.len(), len / r);
            for &i in s {
                prop_assert!(!seen[i], "index {} on two ranks", i);
                seen[i] = true;
            }
        }
        prop_assert_eq!(seen.iter().filter(|&&b| b).count(), (len / r) * r);
    }

    #[test]
    fn same_seed_and_epoch_same_order_other_epoch_other_order(len in 20usize..200, seed: u64, epoch in 0u64..1000) {
        let a = shards(len, 3, true, seed, epoch, false);
        prop_assert_eq!(&a, &shards(len, 3, true, seed, epoch, false));
        // seed + epoch is what seeds the generator: (seed, epoch + 1) == (seed + 1, epoch).
        prop_assert_eq!(shards(len, 3, true, seed, epoch + 1, false), shards(len, 3, true, seed.wrapping_add(1), epoch, false));
        prop_assert_ne!(&a, &shards(len, 3, true, seed, epoch + 1, false));
    }

    #[test]
    fn resume_yields_exactly_the_rest(len in 1usize..300, r in 1usize..6, seed: u64, epoch in 0u64..20, drop_last: bool, frac in 0.0f64..=1.0) {
        for rank in 0..r {
            let mut a = DistributedSampler::new(len, r, rank, true, seed, drop_last).unwrap();
            a.set_epoch(epoch);
            let full = a.indices();
            let k = (frac * full.len() as f64) as usize;
            a.advance(k).unwrap();
            // Through JSON, as a checkpoint would carry it; restored on another rank's sampler.
            let saved: SamplerState = serde_json::from_str(&serde_json::to_string(&a.state()).unwrap()).unwrap();
            let mut b = DistributedSampler::new(len, r, (rank + 1) % r, true, seed, drop_last).unwrap();
            b.load_state(&saved).unwrap();
            b.set_epoch(epoch);
            let mut b_same_rank = DistributedSampler::new(len, r, rank, true, seed, drop_last).unwrap();
            b_same_rank.load_state(&saved).unwrap();
            prop_assert_eq!(b_same_rank.remaining(), full[k..].to_vec());
            prop_assert_eq!(b.remaining().len(), full.len() - k);
            prop_assert_eq!(saved.epoch_complete(), k == full.len());
        }
    }

    #[test]
    fn the_builder_is_the_positional_constructor_with_named_values(len in 0usize..300, r in 1usize..8, k in 0usize..8, shuffle: bool, seed: u64, drop_last: bool) {
        let built = DistributedSampler::builder(len)
            .num_replicas(r)
            .rank(k)
            .shuffle(shuffle)
            .seed(seed)
            .drop_last(drop_last)
            .build();
        let positional = DistributedSampler::new(len, r, k, shuffle, seed, drop_last);
        prop_assert_eq!(format!("{built:?}"), format!("{positional:?}"));
        prop_assert_eq!(built.is_ok(), k < r);
    }

    #[test]
    fn eval_shards_partition_the_dataset(len in 0usize..500, r in 1usize..12) {
        let mut seen = vec![0u8; len];
        let mut lens = Vec::new();
        for rank in 0..r {
            let idx = eval_indices(len, r, rank).unwrap();
            lens.push(idx.len());
            for i in idx {
                seen[i] += 1;
            }
        }
        prop_assert!(seen.iter().all(|&c| c == 1));
        let (min, max) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
        prop_assert!(max - min <= 1);
    }
}

#[test]
fn load_state_rejects_changed_fields_by_name() {
    let a = DistributedSampler::new(100, 4, 0, true, 1, false).unwrap();
    for (b, field) in [
        (DistributedSampler::new(101, 4, 0, true, 1, false).unwrap(), "len"),
        (DistributedSampler::new(100, 4, 0, true, 2, false).unwrap(), "seed"),
        (DistributedSampler::new(100, 4, 0, false, 1, false).unwrap(), "shuffle"),
        (DistributedSampler::new(100, 4, 0, true, 1, true).unwrap(), "drop_last"),
    ] {
        let mut b = b;
        let e = b.load_state(&a.state()).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
    let mut bad = a.state();
    bad.consumed = 26;
    let mut c = a.clone();
    assert!(c.load_state(&bad).unwrap_err().to_string().contains("consumed"));
}

#[test]
fn eval_indices_rejects_bad_rank() {
    assert!(eval_indices(10, 3, 3).unwrap_err().to_string().contains("rank 3"));
    assert!(eval_indices(10, 0, 0).is_err());
}

#[test]
fn builder_defaults_are_pytorchs() {
    let default = DistributedSampler::builder(17).build().unwrap();
    assert_eq!(default, DistributedSampler::new(17, 1, 0, true, 0, false).unwrap());
    let err = DistributedSampler::builder(17).rank(2).build().unwrap_err().to_string();
    assert!(err.contains("rank 2"), "{err}");
}
