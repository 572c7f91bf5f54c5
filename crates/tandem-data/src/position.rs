//! A loader's place in its data as a training state holds it: [`LoaderPosition`] (what the
//! training loop saves, restores and re-splits, over any [`DataLoader`]), the sampler position
//! as a checkpoint value torch can read ([`sampler_value`], [`sampler_state_from_value`]), and
//! what a resume on another world size did with its epoch ([`reshard_message`]).
use tandem_ckpt::Value;

use crate::{DataError, DataLoader, Dataset, SamplerState};

/// A data loader whose position goes into the training state.
pub trait LoaderPosition {
    fn position(&self) -> SamplerState;
    fn set_position(&mut self, state: &SamplerState) -> Result<(), DataError>;
    /// Moves to the start of `epoch`.
    fn set_epoch(&mut self, epoch: u64);
    /// Batches left in the current epoch, and in a whole epoch.
    fn batches_left(&self) -> usize;
    fn batches_per_epoch(&self) -> usize;
    /// Optimizer steps from here to the end of `epochs` epochs (one per batch; a resumed epoch
    /// may have been split over another world size, so its batches are counted).
    fn steps_to_end(&self, epochs: u64) -> u64 {
        match epochs.saturating_sub(self.position().epoch) {
            0 => 0,
            n => self.batches_left() as u64 + (n - 1) * self.batches_per_epoch() as u64,
        }
    }
    /// Moves the loader to `rank` of a world of `num_replicas` from `state` (a position of
    /// the old world): what a live regroup does (see `DistributedSampler::reshard`).
    fn reshard(
        &mut self,
        rank: usize,
        num_replicas: usize,
        state: &SamplerState,
    ) -> Result<(), DataError>;
}

impl<D: Dataset + ?Sized + 'static> LoaderPosition for DataLoader<D> {
    fn position(&self) -> SamplerState {
        self.state()
    }
    fn set_position(&mut self, state: &SamplerState) -> Result<(), DataError> {
        self.load_state(state)
    }
    fn set_epoch(&mut self, epoch: u64) {
        DataLoader::set_epoch(self, epoch)
    }
    fn batches_left(&self) -> usize {
        DataLoader::batches_left(self)
    }
    fn batches_per_epoch(&self) -> usize {
        self.len()
    }
    fn reshard(
        &mut self,
        rank: usize,
        num_replicas: usize,
        state: &SamplerState,
    ) -> Result<(), DataError> {
        DataLoader::reshard(self, rank, num_replicas, state)
    }
}

/// A sampler position as a checkpoint value (plain ints and bools: torch can read it).
pub fn sampler_value(s: &SamplerState) -> Value {
    Value::dict_from([
        ("epoch", Value::Int(s.epoch as i64)),
        ("consumed", Value::Int(s.consumed as i64)),
        ("seed", Value::Int(s.seed as i64)),
        ("len", Value::Int(s.len as i64)),
        ("num_replicas", Value::Int(s.num_replicas as i64)),
        ("shuffle", Value::Bool(s.shuffle)),
        ("drop_last", Value::Bool(s.drop_last)),
        ("start", Value::Int(s.start as i64)),
    ])
}

/// The inverse of [`sampler_value`]; the error names the missing or mistyped key. `start` is
/// optional (checkpoints from before resharding lack it: 0).
pub fn sampler_state_from_value(v: &Value) -> Result<SamplerState, DataError> {
    let missing = |key: &'static str, kind: &'static str| DataError::StateField { key, kind };
    let int =
        |key: &'static str| v.get(key).and_then(Value::as_int).ok_or_else(|| missing(key, "int"));
    let flag =
        |key: &'static str| v.get(key).and_then(Value::as_bool).ok_or_else(|| missing(key, "bool"));
    Ok(SamplerState {
        epoch: int("epoch")? as u64,
        consumed: int("consumed")? as usize,
        seed: int("seed")? as u64,
        len: int("len")? as usize,
        num_replicas: int("num_replicas")? as usize,
        shuffle: flag("shuffle")?,
        drop_last: flag("drop_last")?,
        start: match v.get("start") {
            None => 0,
            Some(s) => s.as_int().ok_or_else(|| missing("start", "int"))? as usize,
        },
    })
}

/// What a resume on another world size did with the epoch it resumed (rank 0 reports it).
pub fn reshard_message(saved: &SamplerState, world: usize, loader: &dyn LoaderPosition) -> String {
    let was =
        format!("the checkpoint was written by {} ranks, this run has {world}", saved.num_replicas);
    let now = loader.position();
    if now.epoch != saved.epoch {
        format!(
            "{was}: epoch {} was complete (only padding was left); epoch {} starts with the usual \
             split over {world} ranks",
            saved.epoch, now.epoch
        )
    } else if now.start == 0 {
        format!("{was}: epoch {} had not started; it is split over {world} ranks", now.epoch)
    } else {
        format!(
            "{was}: the rest of epoch {} ({} samples not yet seen, after the first {} of its \
             order) is split over {world} ranks, {} steps; later epochs use the usual split",
            now.epoch,
            now.samples_left(),
            now.start,
            loader.batches_left()
        )
    }
}
