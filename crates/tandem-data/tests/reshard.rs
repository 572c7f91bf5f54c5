//! Resuming an epoch on another world size: every sample of the epoch is seen exactly once over
//! the two (or three) worlds, every rank of the new world gets the same number of batches, and
//! the next epoch is PyTorch's split again.
use proptest::prelude::*;
use tandem_data::{DistributedSampler, SamplerState};

/// The samplers of one world, all at `epoch`.
fn world(
    len: usize,
    ranks: usize,
    seed: u64,
    drop_last: bool,
    epoch: u64,
) -> Vec<DistributedSampler> {
    (0..ranks)
        .map(|r| {
            let mut s = DistributedSampler::new(len, ranks, r, true, seed, drop_last).unwrap();
            s.set_epoch(epoch);
            s
        })
        .collect()
}

/// Every rank takes `steps` batches of `batch` (as a training loop would, in lockstep) and
/// records the samples it counted as consumed; returns rank 0's state, as a checkpoint holds it.
fn train_steps(
    samplers: &mut [DistributedSampler],
    steps: usize,
    batch: usize,
    seen: &mut Vec<usize>,
) -> SamplerState {
    for s in samplers.iter_mut() {
        let rest = s.remaining_in_batches(batch, false);
        let take = (steps * batch).min(rest.len());
        let counted = take.min(s.epoch_len() - s.consumed());
        seen.extend_from_slice(&rest[..counted]);
        s.advance(counted).unwrap();
    }
    // Through JSON, as a checkpoint carries it.
    serde_json::from_str(&serde_json::to_string(&samplers[0].state()).unwrap()).unwrap()
}

fn resumed(
    len: usize,
    ranks: usize,
    seed: u64,
    drop_last: bool,
    state: &SamplerState,
) -> Vec<DistributedSampler> {
    (0..ranks)
        .map(|r| {
            let mut s = DistributedSampler::new(len, ranks, r, true, seed, drop_last).unwrap();
            s.load_state(state).unwrap();
            s
        })
        .collect()
}

/// Batches each rank would run for the rest of the epoch.
fn batch_counts(
    samplers: &[DistributedSampler],
    batch: usize,
    loader_drop_last: bool,
) -> Vec<usize> {
    samplers
        .iter()
        .map(|s| {
            let n = s.remaining_in_batches(batch, loader_drop_last).len();
            if loader_drop_last {
                n / batch
            } else {
                n.div_ceil(batch)
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn the_rest_of_the_epoch_is_split_over_the_new_world_exactly_once(
        len in 1usize..300, old in 1usize..6, new in 1usize..6, batch in 1usize..9,
        seed: u64, epoch in 0u64..5, frac in 0.0f64..1.0, drop_last: bool,
    ) {
        let mut before = world(len, old, seed, drop_last, epoch);
        let steps_in_epoch = before[0].len().div_ceil(batch);
        let steps = (frac * steps_in_epoch as f64) as usize;
        let mut seen = Vec::new();
        let state = train_steps(&mut before, steps, batch, &mut seen);
        let after = resumed(len, new, seed, drop_last, &state);

        if old == new {
            // The same world: restored as saved (PyTorch's split, padding and all), even an
            // epoch that is empty for every rank (drop_last with fewer samples than ranks).
            prop_assert!(after.iter().all(|s| s.state() == state));
            return Ok(());
        }
        // The epoch is over when nothing but padding (or, with drop_last, a tail shorter than
        // either world) was left of it; the new world then starts the next epoch.
        let left = len.saturating_sub(state.consumed * old);
        let over = if drop_last { left < old.max(new) } else { left == 0 };
        prop_assert_eq!(after[0].epoch() == epoch + 1, over, "left {}", left);
        if over {
            prop_assert!(after.iter().all(|s| s.epoch() == epoch + 1 && s.consumed() == 0));
            return Ok(());
        }
        if state.start + state.consumed * old == 0 {
            // Nothing consumed: the new world splits the epoch as PyTorch would, padding included.
            let fresh = world(len, new, seed, drop_last, epoch);
            for (s, f) in after.iter().zip(&fresh) {
                prop_assert_eq!(s.indices(), f.indices());
            }
            return Ok(());
        }
        prop_assert!(after.iter().all(|s| s.epoch() == epoch && s.consumed() == 0 && s.start() == state.consumed * old));

        // Every rank runs the same number of steps, none of them empty.
        let counts = batch_counts(&after, batch, false);
        prop_assert!(counts.iter().all(|&c| c == counts[0] && c > 0), "batches per rank {:?}", counts);
        let dl_counts = batch_counts(&after, batch, true);
        prop_assert!(dl_counts.iter().all(|&c| c == dl_counts[0]), "drop_last batches per rank {:?}", dl_counts);

        // Shares: the rest of the epoch, each sample once, none seen before the resume.
        let mut all = seen.clone();
        for s in &after {
            all.extend(s.remaining());
        }
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), all.len(), "a sample was seen twice");
        if drop_last {
            // Only the tail that does not divide evenly is dropped (by either world).
            prop_assert!(len - all.len() < old + new, "{} of {} seen", all.len(), len);
        } else {
            prop_assert_eq!(all.len(), len, "a sample was skipped");
        }

        // Repeats that even out the batch count: only when the last step has fewer samples
        // than ranks, and fewer than the ranks.
        let left = state.samples_left();
        let repeats: usize = after
            .iter()
            .map(|s| s.remaining_in_batches(batch, false).len() - s.remaining().len())
            .sum();
        let last_step = left % (new * batch);
        if last_step == 0 || last_step >= new {
            prop_assert_eq!(repeats, 0);
        } else {
            prop_assert!(repeats < new);
        }

        // The next epoch is PyTorch's split for the new world.
        for (r, mut s) in after.into_iter().enumerate() {
            s.set_epoch(epoch + 1);
            let fresh = world(len, new, seed, drop_last, epoch + 1).swap_remove(r);
            prop_assert_eq!(s.indices(), fresh.indices());
        }
    }

    #[test]
    fn a_resharded_epoch_can_be_resharded_again(
        len in 20usize..300, first in 1usize..6, steps_to_next in (1usize..5, 1usize..5),
        batch in 1usize..5, seed: u64, fracs in proptest::collection::vec(0.0f64..0.5, 2),
    ) {
        // Three world sizes in 1..=5, each different from the one before it.
        let next = |size: usize, by: usize| (size - 1 + by) % 5 + 1;
        let second = next(first, steps_to_next.0);
        let sizes = [first, second, next(second, steps_to_next.1)];
        let mut samplers = world(len, sizes[0], seed, false, 3);
        let mut seen = Vec::new();
        for (i, frac) in fracs.iter().enumerate() {
            let steps = (frac * samplers[0].epoch_len().div_ceil(batch) as f64) as usize;
            let state = train_steps(&mut samplers, steps, batch, &mut seen);
            samplers = resumed(len, sizes[i + 1], seed, false, &state);
            if samplers[0].epoch() != 3 {
                return Ok(());
            }
        }
        // Finish the epoch in the last world.
        let steps = samplers[0].remaining_in_batches(batch, false).len().div_ceil(batch);
        train_steps(&mut samplers, steps, batch, &mut seen);
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        if samplers[0].start() == 0 {
            // Nothing was consumed before the last world: PyTorch's split, with its padding.
            prop_assert!(sorted.len() - len < sizes[2]);
            sorted.dedup();
        }
        prop_assert_eq!(sorted, (0..len).collect::<Vec<_>>());
    }
}

#[test]
fn the_worlds_in_the_issue_2_to_3_3_to_2_4_to_1() {
    for (old, new) in [(2, 3), (3, 2), (4, 1)] {
        let (len, batch) = (1500, 32);
        let mut before = world(len, old, 0, false, 1);
        let mut seen = Vec::new();
        let state = train_steps(&mut before, 7, batch, &mut seen);
        assert_eq!(seen.len(), 7 * batch * old);
        let mut after = resumed(len, new, 0, false, &state);
        let counts = batch_counts(&after, batch, false);
        let steps = counts[0];
        assert!(counts.iter().all(|&c| c == steps), "{old}->{new}: {counts:?}");
        assert_eq!(steps, (len - seen.len()).div_ceil(batch * new), "{old}->{new}");
        train_steps(&mut after, steps, batch, &mut seen);
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..len).collect::<Vec<_>>(), "{old}->{new}");
        // The state after the last batch says the epoch is done.
        assert!(after[0].state().epoch_complete(), "{old}->{new}");
    }
}

#[test]
fn same_world_resume_of_a_resharded_epoch_is_exact() {
    let mut before = world(103, 2, 9, false, 0);
    let state = train_steps(&mut before, 3, 4, &mut Vec::new());
    let mut three = resumed(103, 3, 9, false, &state);
    let expected: Vec<Vec<usize>> = three.iter().map(|s| s.remaining()[8..].to_vec()).collect();
    let mid = train_steps(&mut three, 2, 4, &mut Vec::new());
    assert_eq!(mid.start, 24);
    let again = resumed(103, 3, 9, false, &mid);
    let got: Vec<Vec<usize>> = again.iter().map(|s| s.remaining()).collect();
    assert_eq!(got, expected);
}

#[test]
fn a_bad_start_is_named() {
    let s = DistributedSampler::new(10, 2, 0, true, 0, false).unwrap();
    let mut state = s.state();
    state.start = 11;
    let e = s.clone().load_state(&state).unwrap_err().to_string();
    assert!(e.contains("start"), "{e}");
    state.num_replicas = 0;
    let e = s.clone().load_state(&state).unwrap_err().to_string();
    assert!(e.contains("num_replicas"), "{e}");
}

/// A live regroup moves a running sampler to another world (`reshard`): the same split as a
/// fresh sampler of that world resuming the state, over shrinking and growing worlds.
#[test]
fn a_live_reshard_is_a_resume_on_another_world() {
    let (len, batch, seed) = (997, 8, 5);
    for (old, new) in [(4, 3), (3, 4), (4, 1), (2, 5)] {
        let mut before = world(len, old, seed, false, 2);
        let mut seen = Vec::new();
        let state = train_steps(&mut before, 9, batch, &mut seen);
        let expected = resumed(len, new, seed, false, &state);
        for (r, want) in expected.iter().enumerate() {
            // Any of the old world's samplers (here rank 0's) moves to rank r of the new one.
            let mut moved = before[0].clone();
            moved.reshard(r, new, &state).unwrap();
            assert_eq!(moved, *want, "{old} -> {new}, rank {r}");
        }
    }
    let mut s = world(len, 2, seed, false, 0).remove(0);
    let state = s.state();
    assert!(s.reshard(3, 3, &state).is_err(), "rank 3 of 3 is refused");
}
