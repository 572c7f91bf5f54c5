//! A `PartialFc` shard as a state dict, and loading this rank's rows from shards saved on any
//! world size. A shard says which slice of the global `[num_classes, embedding_size]` matrix
//! it holds (`class_start`, and the rows of `weight`), so a loader copies exactly the rows it
//! owns now, from whichever shards hold them, and never assembles the whole head. The
//! optimizer's momentum for these rows belongs to the optimizer's own state dict.
use candle_core::{DType, Tensor};
use tandem_ckpt::{TensorData, Value};

use super::PartialFc;
use crate::error::PartialFcError;

/// The `format` entry of a shard's state dict.
pub const SHARD_FORMAT: &str = "tandem-partial-fc-shard-1";

fn bad(what: String) -> PartialFcError {
    PartialFcError::State(what)
}

fn int(v: &Value, key: &str, shard: usize) -> Result<i64, PartialFcError> {
    v.get(key)
        .and_then(Value::as_int)
        .ok_or_else(|| bad(format!("shard {shard}: no integer `{key}`")))
}

impl PartialFc {
    /// This rank's shard: `weight` (its `[len, E]` rows, f32), `class_start`, `num_classes`,
    /// `embedding_size`, `steps_taken` (which seeds the negative sampling) and `format`.
    pub fn state_dict(&self) -> Result<Value, PartialFcError> {
        let w = self.weight.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let weight = TensorData::from_f32(&[self.split.len, self.cfg.embedding_size], &w);
        Ok(Value::dict_from([
            ("format", Value::Str(SHARD_FORMAT.into())),
            ("weight", Value::Tensor(weight)),
            ("class_start", Value::Int(self.split.start as i64)),
            ("num_classes", Value::Int(self.cfg.num_classes as i64)),
            ("embedding_size", Value::Int(self.cfg.embedding_size as i64)),
            ("steps_taken", Value::Int(self.step as i64)),
        ]))
    }

    /// Loads this rank's rows from `shards` (state dicts of [`PartialFc::state_dict`], saved on
    /// any world size; shards that hold none of this rank's rows are skipped, so a caller may
    /// pass only the ones it read). The weight keeps its identity (the optimizer's parameter
    /// stays the same `Var`). Every row this rank owns must be in some shard; the class count,
    /// embedding size and step count must agree: each mismatch is an error naming the shard.
    pub fn load_state_dict(&mut self, shards: &[&Value]) -> Result<(), PartialFcError> {
        let e = self.cfg.embedding_size;
        let (start, len) = (self.split.start, self.split.len);
        let mut rows = vec![0f32; len * e];
        let mut covered = vec![false; len];
        let mut steps = None;
        for (i, shard) in shards.iter().enumerate() {
            match shard.get("format").and_then(Value::as_str) {
                Some(SHARD_FORMAT) => {}
                other => {
                    return Err(bad(format!("shard {i}: format {other:?}, not {SHARD_FORMAT}")))
                }
            }
            let classes = int(shard, "num_classes", i)?;
            let width = int(shard, "embedding_size", i)?;
            if classes != self.cfg.num_classes as i64 || width != e as i64 {
                return Err(bad(format!(
                    "shard {i} is of a [{classes}, {width}] head; this one is [{}, {e}]",
                    self.cfg.num_classes
                )));
            }
            let step = int(shard, "steps_taken", i)?;
            if *steps.get_or_insert(step) != step {
                return Err(bad(format!(
                    "shard {i} was saved at step {step}, others at {steps:?}"
                )));
            }
            let weight = shard
                .get("weight")
                .and_then(Value::as_tensor)
                .ok_or_else(|| bad(format!("shard {i}: no `weight` tensor")))?;
            let from = usize::try_from(int(shard, "class_start", i)?)
                .map_err(|_| bad(format!("shard {i}: a negative class_start")))?;
            let held = match weight.shape.as_slice() {
                [n, w]
                    if *w == e
                        && from.checked_add(*n).is_some_and(|end| end <= self.cfg.num_classes) =>
                {
                    *n
                }
                shape => {
                    return Err(bad(format!(
                        "shard {i}: weight of shape {shape:?} from class {from} does not fit a \
                         [{}, {e}] head",
                        self.cfg.num_classes
                    )))
                }
            };
            let (lo, hi) = (from.max(start), (from + held).min(start + len));
            if lo >= hi {
                continue;
            }
            let values = weight.to_f32_vec();
            for class in lo..hi {
                let (src, dst) = ((class - from) * e, (class - start) * e);
                rows[dst..dst + e].copy_from_slice(&values[src..src + e]);
                covered[class - start] = true;
            }
        }
        if let Some(first) = covered.iter().position(|c| !c) {
            let last = covered.iter().rposition(|c| !c).unwrap_or(first);
            return Err(bad(format!(
                "rank {}: classes {}..{} are in none of the {} shard(s) given",
                self.comm.rank(),
                start + first,
                start + last + 1,
                shards.len()
            )));
        }
        let device = self.weight.device().clone();
        let loaded = Tensor::from_vec(rows, (len, e), &device)?.to_dtype(self.weight.dtype())?;
        self.weight.set(&loaded)?;
        self.step = steps.unwrap_or(0) as u64;
        Ok(())
    }
}
