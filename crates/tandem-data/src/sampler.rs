//! `DistributedSampler` with `torch.utils.data.DistributedSampler`'s exact semantics, plus a
//! resumable position: the state (epoch, samples already consumed) can be checkpointed, and a
//! sampler restored mid-epoch yields exactly the rest of that epoch.
use serde::{Deserialize, Serialize};

use crate::randperm::torch_randperm;
use crate::DataError;

/// Splits `len` samples among `num_replicas` ranks the way PyTorch does:
/// * order: `torch.randperm(len)` from a generator seeded with `seed + epoch` (with `shuffle`),
///   else `0..len`;
/// * `drop_last = false`: pad to `num_replicas * ceil(len / num_replicas)` by repeating the
///   ordered list from its start (several times over if `len < num_replicas`);
/// * `drop_last = true`: trim the tail to `num_replicas * floor(len / num_replicas)`;
/// * this rank's shard is `indices[rank::num_replicas]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    consumed: usize,
}

/// The checkpointable part of a sampler. `consumed` counts this rank's samples already handed
/// out in `epoch`; it is the same on every rank (all shards have equal length), so a state saved
/// by rank 0 restores every rank. The remaining fields are checked on `load_state` so that a
/// resume with a different dataset, world size, seed or mode fails loudly instead of silently
/// yielding a different sample order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    pub epoch: u64,
    pub consumed: usize,
    pub seed: u64,
    pub len: usize,
    pub num_replicas: usize,
    pub shuffle: bool,
    pub drop_last: bool,
}

impl DistributedSampler {
    /// Same arguments as PyTorch's constructor (`dataset` replaced by its length).
    /// `rank >= num_replicas` and `num_replicas == 0` are errors. A negative PyTorch seed `s`
    /// is `s as u64` here (torch's `manual_seed` wraps it modulo 2^64 the same way).
    pub fn new(
        len: usize,
        num_replicas: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self, DataError> {
        if num_replicas == 0 {
            return Err(DataError::NoReplicas);
        }
        if rank >= num_replicas {
            return Err(DataError::InvalidRank { rank, num_replicas });
        }
        Ok(Self { len, num_replicas, rank, shuffle, seed, drop_last, epoch: 0, consumed: 0 })
    }

    /// Named settings with PyTorch's defaults (shuffle on, seed 0, no drop_last, a world of
    /// one), for code that reads better than six positional values:
    /// ```
    /// # use tandem_data::DistributedSampler;
    /// let s = DistributedSampler::builder(10).num_replicas(4).rank(1).seed(7).build()?;
    /// assert_eq!(s, DistributedSampler::new(10, 4, 1, true, 7, false)?);
    /// # Ok::<(), tandem_data::DataError>(())
    /// ```
    pub fn builder(len: usize) -> SamplerBuilder {
        SamplerBuilder { len, num_replicas: 1, rank: 0, shuffle: true, seed: 0, drop_last: false }
    }

    /// Samples per rank per epoch (PyTorch's `num_samples`, `len(sampler)`).
    pub fn len(&self) -> usize {
        num_samples(self.len, self.num_replicas, self.drop_last)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples over all ranks per epoch after padding or trimming (PyTorch's `total_size`).
    pub fn total_size(&self) -> usize {
        self.len() * self.num_replicas
    }

    pub fn dataset_len(&self) -> usize {
        self.len
    }
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }
    pub fn seed(&self) -> u64 {
        self.seed
    }
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Samples of the current epoch already handed out (see [`advance`](Self::advance)).
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Selects the epoch whose order `indices` returns. Moving to a different epoch restarts the
    /// position at 0; setting the epoch the sampler already has keeps the position, so the usual
    /// `for epoch in start.. { sampler.set_epoch(epoch); ... }` loop resumes mid-epoch after
    /// `load_state`.
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.consumed = 0;
        }
    }

    /// This rank's full list for the current epoch: `list(iter(sampler))` in PyTorch.
    pub fn indices(&self) -> Vec<usize> {
        shard_indices(
            self.len,
            self.num_replicas,
            self.rank,
            self.shuffle,
            self.seed.wrapping_add(self.epoch),
            self.drop_last,
        )
    }

    /// What is left of this epoch: `indices()[consumed..]`.
    pub fn remaining(&self) -> Vec<usize> {
        let mut all = self.indices();
        all.drain(..self.consumed.min(all.len()));
        all
    }

    /// Records that `n` more samples of this epoch were handed out.
    pub fn advance(&mut self, n: usize) -> Result<(), DataError> {
        let remaining = self.len() - self.consumed;
        if n > remaining {
            return Err(DataError::AdvancePastEnd { requested: n, remaining, epoch: self.epoch });
        }
        self.consumed += n;
        Ok(())
    }

    pub fn state(&self) -> SamplerState {
        SamplerState {
            epoch: self.epoch,
            consumed: self.consumed,
            seed: self.seed,
            len: self.len,
            num_replicas: self.num_replicas,
            shuffle: self.shuffle,
            drop_last: self.drop_last,
        }
    }

    /// Restores epoch and position after checking that the state was made by a sampler with the
    /// same dataset length, world size, seed, shuffle and drop_last (the rank may differ).
    pub fn load_state(&mut self, state: &SamplerState) -> Result<(), DataError> {
        fn check<T: PartialEq + ToString>(
            field: &'static str,
            saved: T,
            current: T,
        ) -> Result<(), DataError> {
            if saved == current {
                Ok(())
            } else {
                Err(DataError::StateMismatch {
                    field,
                    saved: saved.to_string(),
                    current: current.to_string(),
                })
            }
        }
        check("len", state.len, self.len)?;
        check("num_replicas", state.num_replicas, self.num_replicas)?;
        check("seed", state.seed, self.seed)?;
        check("shuffle", state.shuffle, self.shuffle)?;
        check("drop_last", state.drop_last, self.drop_last)?;
        if state.consumed > self.len() {
            return Err(DataError::StateMismatch {
                field: "consumed",
                saved: state.consumed.to_string(),
                current: format!("at most {} samples per epoch", self.len()),
            });
        }
        self.epoch = state.epoch;
        self.consumed = state.consumed;
        Ok(())
    }
}

/// [`DistributedSampler::builder`]'s settings; `build` checks them as `new` does.
#[derive(Debug, Clone)]
pub struct SamplerBuilder {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
}

impl SamplerBuilder {
    /// Number of ranks sharing the data (PyTorch: `num_replicas`, default the world size).
    pub fn num_replicas(mut self, n: usize) -> Self {
        self.num_replicas = n;
        self
    }
    /// This rank's index among them.
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = rank;
        self
    }
    /// This process group's rank and size: the usual choice under a launcher.
    pub fn group(self, group: &tandem_comm::ProcessGroup) -> Self {
        self.num_replicas(group.size()).rank(group.rank())
    }
    /// Reshuffle every epoch (default true).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }
    /// Seed of the per-epoch permutation (default 0); the same on every rank.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Drop the tail that does not divide evenly instead of padding (default false).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }
    pub fn build(self) -> Result<DistributedSampler, DataError> {
        DistributedSampler::new(
            self.len,
            self.num_replicas,
            self.rank,
            self.shuffle,
            self.seed,
            self.drop_last,
        )
    }
}

impl SamplerState {
    /// True when every sample of `epoch` was handed out (the next epoch starts from 0).
    pub fn epoch_complete(&self) -> bool {
        self.consumed == num_samples(self.len, self.num_replicas, self.drop_last)
    }
}

/// PyTorch's `num_samples`: `ceil(len / R)`, or with `drop_last` and an uneven split
/// `ceil((len - R) / R)`, which is `floor(len / R)` (0 when `len < R`).
pub fn num_samples(len: usize, num_replicas: usize, drop_last: bool) -> usize {
    if drop_last {
        len / num_replicas
    } else {
        len.div_ceil(num_replicas)
    }
}

/// One rank's shard; `generator_seed` is what PyTorch passes to `manual_seed` (`seed + epoch`).
fn shard_indices(
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    generator_seed: u64,
    drop_last: bool,
) -> Vec<usize> {
    let per_rank = num_samples(len, num_replicas, drop_last);
    if per_rank == 0 {
        return Vec::new();
    }
    let order = if shuffle { torch_randperm(len, generator_seed) } else { (0..len).collect() };
    // Position p of the padded (or trimmed) list is order[p % len]: padding repeats the list
    // from its start, as many times as needed.
    (0..per_rank).map(|k| order[(rank + k * num_replicas) % len]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_out_of_range_is_an_error() {
        let e = DistributedSampler::new(10, 4, 4, false, 0, false).unwrap_err();
        assert!(e.to_string().contains("rank 4"), "{e}");
        assert!(matches!(
            DistributedSampler::new(10, 0, 0, false, 0, false),
            Err(DataError::NoReplicas)
        ));
    }

    #[test]
    fn padding_repeats_from_start_unshuffled() {
        // 10 samples over 4 ranks: padded to 12 with [0, 1].
        let shards: Vec<Vec<usize>> = (0..4)
            .map(|r| DistributedSampler::new(10, 4, r, false, 0, false).unwrap().indices())
            .collect();
        assert_eq!(shards, vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]);
        // 2 samples over 5 ranks: padded to 5 by repeating the list several times.
        let shards: Vec<Vec<usize>> = (0..5)
            .map(|r| DistributedSampler::new(2, 5, r, false, 0, false).unwrap().indices())
            .collect();
        assert_eq!(shards, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
    }

    #[test]
    fn drop_last_trims() {
        let shards: Vec<Vec<usize>> = (0..4)
            .map(|r| DistributedSampler::new(10, 4, r, false, 0, true).unwrap().indices())
            .collect();
        assert_eq!(shards, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert!(DistributedSampler::new(3, 4, 1, true, 0, true).unwrap().indices().is_empty());
    }

    #[test]
    fn resume_mid_epoch_yields_the_rest() {
        let mut a = DistributedSampler::new(103, 3, 1, true, 42, false).unwrap();
        a.set_epoch(5);
        let full = a.indices();
        a.advance(10).unwrap();
        let saved = a.state();
        let json = serde_json::to_string(&saved).unwrap();
        let mut b = DistributedSampler::new(103, 3, 1, true, 42, false).unwrap();
        b.load_state(&serde_json::from_str(&json).unwrap()).unwrap();
        b.set_epoch(5); // the usual loop calls this again: the position must survive it
        assert_eq!(b.remaining(), full[10..].to_vec());
        b.set_epoch(6);
        assert_eq!(b.consumed(), 0);
        assert!(b.advance(b.len() + 1).is_err());
    }

    #[test]
    fn load_state_rejects_other_world_size() {
        let a = DistributedSampler::new(100, 4, 0, true, 1, false).unwrap();
        let mut b = DistributedSampler::new(100, 2, 0, true, 1, false).unwrap();
        let e = b.load_state(&a.state()).unwrap_err();
        assert!(e.to_string().contains("num_replicas"), "{e}");
        // Another rank of the same job accepts it.
        let mut c = DistributedSampler::new(100, 4, 3, true, 1, false).unwrap();
        c.load_state(&a.state()).unwrap();
    }
}
