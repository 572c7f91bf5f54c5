//! `DistributedSampler` with `torch.utils.data.DistributedSampler`'s exact semantics, plus a
//! resumable position: the state (epoch, samples already consumed) can be checkpointed, and a
//! sampler restored mid-epoch yields exactly the rest of that epoch — on the same world size, or
//! on another one.
//!
//! Resuming on another world size: after `consumed` samples per rank, a world of `R` ranks has
//! used exactly the first `R * consumed` entries of the epoch's order (rank `r` takes positions
//! `r, r + R, ...`). A sampler of another world size loading that state starts its split of
//! the epoch there: the rest of the order, `order[R * consumed..]`, is dealt out round-robin
//! over the new ranks (`start` in [`SamplerState`]). No sample of that epoch is seen twice or
//! skipped; the shares may differ by one sample (no padding; with `drop_last` the tail that does
//! not divide evenly is dropped, as PyTorch drops it). The next epoch is PyTorch's split again.
//! [`remaining_in_batches`](DistributedSampler::remaining_in_batches) evens out the number of
//! batches per rank, which data-parallel steps need.
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
    /// Where in the epoch's order this world's split begins: 0 for PyTorch's split, else the
    /// samples another world size had consumed before this sampler resumed the epoch.
    start: usize,
}

/// The checkpointable part of a sampler. `consumed` counts this rank's samples already handed
/// out in `epoch`; it is the same on every rank mid-epoch (shares differ only in their last
/// batch), so a state saved by rank 0 restores every rank. `start` is where this world's split of
/// the epoch began (0 unless the epoch was resumed from another world size). `len`, `seed`,
/// `shuffle` and `drop_last` are checked on `load_state` so that a resume with a different dataset
/// or mode fails loudly instead of silently yielding a different sample order; `num_replicas`
/// may differ (the rest of the epoch is re-split, see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    pub epoch: u64,
    pub consumed: usize,
    pub seed: u64,
    pub len: usize,
    pub num_replicas: usize,
    pub shuffle: bool,
    pub drop_last: bool,
    /// Absent in checkpoints written before resharding existed: 0, PyTorch's split.
    #[serde(default)]
    pub start: usize,
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
        Ok(Self {
            len,
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
            consumed: 0,
            start: 0,
        })
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
    /// Where this world's split of the current epoch begins in the epoch's order: 0 unless the
    /// epoch was resumed from a state saved by another world size.
    pub fn start(&self) -> usize {
        self.start
    }
    /// This rank's samples in the current epoch: [`len`](Self::len), except in an epoch resumed
    /// from another world size, where it is this rank's share of the rest.
    pub fn epoch_len(&self) -> usize {
        self.layout().share(self.rank)
    }

    fn layout(&self) -> EpochLayout {
        EpochLayout {
            len: self.len,
            num_replicas: self.num_replicas,
            drop_last: self.drop_last,
            start: self.start,
        }
    }

    /// Selects the epoch whose order `indices` returns. Moving to a different epoch restarts the
    /// position at 0; setting the epoch the sampler already has keeps the position, so the usual
    /// `for epoch in start.. { sampler.set_epoch(epoch); ... }` loop resumes mid-epoch after
    /// `load_state`.
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.consumed = 0;
            self.start = 0;
        }
    }

    /// This rank's full list for the current epoch: `list(iter(sampler))` in PyTorch (in an
    /// epoch resumed from another world size: this rank's share of the rest of the epoch).
    pub fn indices(&self) -> Vec<usize> {
        let generator_seed = self.seed.wrapping_add(self.epoch);
        if self.start == 0 {
            return shard_indices(
                self.len,
                self.num_replicas,
                self.rank,
                self.shuffle,
                generator_seed,
                self.drop_last,
            );
        }
        let end = self.layout().end();
        if end <= self.start + self.rank {
            return Vec::new();
        }
        let order = self.order(generator_seed);
        (self.start + self.rank..end).step_by(self.num_replicas).map(|p| order[p]).collect()
    }

    fn order(&self, generator_seed: u64) -> Vec<usize> {
        if self.shuffle {
            torch_randperm(self.len, generator_seed)
        } else {
            (0..self.len).collect()
        }
    }

    /// What is left of this epoch: `indices()[consumed..]`.
    pub fn remaining(&self) -> Vec<usize> {
        let mut all = self.indices();
        all.drain(..self.consumed.min(all.len()));
        all
    }

    /// [`remaining`](Self::remaining) adjusted so that every rank has the same number of batches
    /// of `batch_size` (with the loader's `drop_last`), which data-parallel training needs. Only
    /// an epoch resumed from another world size can need it, its shares differing by one sample:
    /// a rank whose share would end a batch early gets one sample of the epoch repeated (at
    /// most `num_replicas - 1` repeats, and only when the rest of the epoch leaves fewer samples
    /// than ranks for the last step); with `drop_last` every rank stops after the batches the
    /// smallest share fills. The repeated sample does not count as consumed.
    pub fn remaining_in_batches(&self, batch_size: usize, drop_last: bool) -> Vec<usize> {
        let mut rest = self.remaining();
        if self.start == 0 || batch_size == 0 {
            return rest;
        }
        let layout = self.layout();
        let left = |rank: usize| layout.share(rank).saturating_sub(self.consumed);
        // Shares are largest at rank 0 and smallest at the last rank.
        let (most, least) = (left(0), left(self.num_replicas - 1));
        if drop_last {
            rest.truncate((least / batch_size) * batch_size);
        } else if rest.len().div_ceil(batch_size) < most.div_ceil(batch_size) {
            let span = layout.end() - self.start;
            let order = self.order(self.seed.wrapping_add(self.epoch));
            rest.push(order[self.start + self.rank % span]);
        }
        rest
    }

    /// Records that `n` more samples of this epoch were handed out.
    pub fn advance(&mut self, n: usize) -> Result<(), DataError> {
        let remaining = self.epoch_len() - self.consumed;
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
            start: self.start,
        }
    }

    /// Moves this sampler to another world (`rank` of `num_replicas`) from `state`, a position
    /// of the old world (every rank's is the same mid-epoch): the rest of that epoch is split
    /// over the new world as [`DistributedSampler::load_state`] does for a resume on another
    /// world size. What a live regroup does when ranks leave or join.
    pub fn reshard(
        &mut self,
        rank: usize,
        num_replicas: usize,
        state: &SamplerState,
    ) -> Result<(), DataError> {
        let mut moved = DistributedSampler::new(
            self.len,
            num_replicas,
            rank,
            self.shuffle,
            self.seed,
            self.drop_last,
        )?;
        moved.load_state(state)?;
        *self = moved;
        Ok(())
    }

    /// Restores epoch and position after checking that the state was made by a sampler with the
    /// same dataset length, seed, shuffle and drop_last. The rank may differ, and so may the
    /// world size: then the rest of the saved epoch is split over this world (module docs).
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
        check("seed", state.seed, self.seed)?;
        check("shuffle", state.shuffle, self.shuffle)?;
        check("drop_last", state.drop_last, self.drop_last)?;
        if state.num_replicas == 0 {
            return Err(DataError::StateMismatch {
                field: "num_replicas",
                saved: "0".into(),
                current: "at least 1".into(),
            });
        }
        let saved = state.layout();
        if state.start > self.len || state.consumed > saved.share(0) {
            return Err(DataError::StateMismatch {
                field: if state.start > self.len { "start" } else { "consumed" },
                saved: format!("start {} consumed {}", state.start, state.consumed),
                current: format!(
                    "at most {} samples per rank from start {} (dataset of {})",
                    saved.share(0),
                    state.start,
                    self.len
                ),
            });
        }
        if state.num_replicas == self.num_replicas {
            self.epoch = state.epoch;
            self.consumed = state.consumed;
            self.start = state.start;
            return Ok(());
        }
        // Another world size: the saved world used the first `used` entries of the order.
        let used = state.start + state.consumed * state.num_replicas;
        let here = EpochLayout { start: used, ..self.layout() };
        if used >= saved.end() || here.end() <= used {
            // Only padding (or a tail too short to split) was left of that epoch: it is complete.
            self.epoch = state.epoch + 1;
            self.start = 0;
        } else {
            self.epoch = state.epoch;
            self.start = used;
        }
        self.consumed = 0;
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
        self.consumed >= self.layout().share(0)
    }

    /// Samples of `epoch` left for the whole world after this position (no padding counted).
    pub fn samples_left(&self) -> usize {
        let layout = self.layout();
        layout.end().saturating_sub(self.start + self.consumed * self.num_replicas)
    }

    fn layout(&self) -> EpochLayout {
        EpochLayout {
            len: self.len,
            num_replicas: self.num_replicas.max(1),
            drop_last: self.drop_last,
            start: self.start,
        }
    }
}

/// How one epoch is split over a world: PyTorch's split (`start == 0`), or the rest of the
/// epoch from `start` on, dealt round-robin without padding.
struct EpochLayout {
    len: usize,
    num_replicas: usize,
    drop_last: bool,
    start: usize,
}

impl EpochLayout {
    /// One past the last position of the order this split uses (PyTorch's padding beyond `len`
    /// is not counted: it repeats positions already used).
    fn end(&self) -> usize {
        if self.drop_last {
            let span = self.len.saturating_sub(self.start);
            self.start + self.num_replicas * (span / self.num_replicas)
        } else {
            self.len
        }
    }

    /// Samples `rank` gets in this epoch.
    fn share(&self, rank: usize) -> usize {
        if self.start == 0 {
            return num_samples(self.len, self.num_replicas, self.drop_last);
        }
        let end = self.end();
        if end <= self.start + rank {
            0
        } else {
            (end - self.start - rank).div_ceil(self.num_replicas)
        }
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
    fn load_state_from_another_world_size_splits_the_rest() {
        // 10 samples, 2 ranks, 2 consumed each: positions 0..4 used; 4..10 go round-robin to 3.
        let mut a = DistributedSampler::new(10, 2, 0, false, 0, false).unwrap();
        a.advance(2).unwrap();
        let shares: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                let mut b = DistributedSampler::new(10, 3, r, false, 0, false).unwrap();
                b.load_state(&a.state()).unwrap();
                assert_eq!((b.epoch(), b.start(), b.consumed()), (0, 4, 0));
                b.remaining()
            })
            .collect();
        assert_eq!(shares, vec![vec![4, 7], vec![5, 8], vec![6, 9]]);
        // 4 ranks after 3 each: 12 >= 10, only padding was left, so epoch 0 is complete.
        let mut c = DistributedSampler::new(10, 4, 0, false, 0, false).unwrap();
        c.advance(3).unwrap();
        let mut d = DistributedSampler::new(10, 1, 0, false, 0, false).unwrap();
        d.load_state(&c.state()).unwrap();
        assert_eq!((d.epoch(), d.start(), d.consumed()), (1, 0, 0));
        // A state without `start` (older checkpoints) reads as PyTorch's split.
        let old = r#"{"epoch":2,"consumed":1,"seed":0,"len":10,"num_replicas":2,"shuffle":false,"drop_last":false}"#;
        let state: SamplerState = serde_json::from_str(old).unwrap();
        assert_eq!(state.start, 0);
    }
}
