//! A model sharded by tandem-fsdp's `Fsdp` as a [`RankState`] part: every parameter's rows
//! this rank holds, and the optimizer's entries for them (all of them: the optimizer steps the
//! shards), saved as row shards `model/NAME` and `optimizer/state/I`. A resume on any world
//! size reads each parameter's rows of the new layout from whichever ranks wrote them, and
//! `tandem ckpt convert` stacks the rows back into the full state dict PyTorch loads (the model
//! under `model`, the entries under `optimizer`'s `state`).
use std::sync::LazyLock;

use tandem_checkpoint::{Saved, ShardDict};
use tandem_ckpt::Value;
use tandem_fsdp::{Fsdp, Shard};
use tandem_nn::NamedVars;

use crate::error::{Context, Result, TrainError};
use crate::rank_state::{PartLoaded, RankState};

/// The replicated model of a sharded run: nothing (every parameter is in the part).
pub(crate) static NO_MODEL: LazyLock<NamedVars> = LazyLock::new(|| NamedVars::new(Vec::new()));

/// An `Fsdp` model's shards as a training state part (see the module docs). The optimizer
/// must step [`Fsdp::params`] in that order.
pub struct FsdpShards {
    fsdp: Fsdp,
}

impl FsdpShards {
    pub fn new(fsdp: &Fsdp) -> FsdpShards {
        FsdpShards { fsdp: fsdp.clone() }
    }
}

fn model_shard(name: &str) -> String {
    format!("model/{name}")
}

fn entry_shard(index: usize) -> String {
    format!("optimizer/state/{index}")
}

fn rows(shard: &Shard, name: &str, value: Value) -> ShardDict {
    ShardDict::rows(name, shard.rows.start, shard.rows.len(), shard.total_rows(), value)
}

impl RankState for FsdpShards {
    fn optimizer_entries(&self) -> Vec<usize> {
        (0..self.fsdp.params().len()).collect()
    }

    fn shards(&self, entries: Vec<Value>, _step: u64) -> Result<Vec<ShardDict>> {
        let shards = self.fsdp.shards();
        let mut out = Vec::with_capacity(shards.len() + entries.len());
        for s in &shards {
            let t = tandem_nn::convert::to_ckpt(s.var.as_tensor())?;
            out.push(rows(s, &model_shard(&s.name), Value::Tensor(t)));
        }
        let mut entries = entries.into_iter();
        for (i, s) in shards.iter().filter(|s| s.trainable).enumerate() {
            out.push(rows(s, &entry_shard(i), entries.next().unwrap_or(Value::None)));
        }
        Ok(out)
    }

    fn load(&mut self, saved: &Saved) -> Result<PartLoaded> {
        let path = saved.path().display().to_string();
        let shards = self.fsdp.shards();
        let ours: Vec<String> = shards.iter().map(|s| model_shard(&s.name)).collect();
        if let Some(extra) = saved
            .shard_names()
            .into_iter()
            .find(|n| n.starts_with("model/") && !ours.iter().any(|o| o == n))
        {
            return Err(TrainError::Invalid(format!(
                "{path}: parameter `{}` is not in this model (a checkpoint of another model?)",
                &extra["model/".len()..]
            )));
        }
        let mut entries = Vec::new();
        let mut trainable = 0;
        for s in &shards {
            let name = model_shard(&s.name);
            let Some(total) = saved.rows_total(&name) else {
                return Err(TrainError::Invalid(format!(
                    "{path}: no parameter `{}` (a checkpoint of another model, or not of an \
                     Fsdp model?)",
                    s.name
                )));
            };
            let what = || format!("{path}: parameter `{}`", s.name);
            if total != s.total_rows() {
                return Err(TrainError::Invalid(format!(
                    "{}: {total} rows saved, the model has {:?}",
                    what(),
                    s.dims
                )));
            }
            if !s.rows.is_empty() {
                let value = saved.read_rows(&name, s.rows.clone())?;
                let t = value.as_tensor().with_context(|| format!("{}: not a tensor", what()))?;
                let t = tandem_nn::convert::from_ckpt(t, s.var.device()).with_context(what)?;
                if t.dims() != s.var.dims() {
                    return Err(TrainError::Invalid(format!(
                        "{}: rows of shape {:?}, the shard is {:?}",
                        what(),
                        t.dims(),
                        s.var.dims()
                    )));
                }
                s.var.set(&t.to_dtype(s.var.dtype()).with_context(what)?).with_context(what)?;
            }
            if s.trainable {
                let name = entry_shard(trainable);
                trainable += 1;
                let entry = match saved.rows_total(&name) {
                    Some(_) if !s.rows.is_empty() => saved.read_rows(&name, s.rows.clone())?,
                    _ => Value::None,
                };
                entries.push(entry);
            }
        }
        let note = (saved.world_size() != self.fsdp.world_size()).then(|| {
            format!(
                "Fsdp shards of {} parameters re-split from {} ranks to {}",
                shards.len(),
                saved.world_size(),
                self.fsdp.world_size()
            )
        });
        Ok(PartLoaded { entries, note, resplit: None })
    }
}
