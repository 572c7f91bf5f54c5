//! The training checkpoint's dict: `{epoch, global_step, model, optimizer, scheduler, sampler,
//! rng, world_size, config, tandem_version}` (+ `scaler`), one value PyTorch can open. Where it
//! is written and how (atomically, sharded, in the background) is tandem-train's `checkpoint`.
use crate::error::{CkptError, Result};
use crate::keys::canonicalize_keys;
use crate::value::Value;

/// The fields of a training checkpoint, as one dict PyTorch can open:
/// `{epoch, global_step, model, optimizer, scheduler, sampler, rng, world_size, config, tandem_version}`.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingCheckpoint {
    pub epoch: i64,
    pub global_step: i64,
    /// The model's state dict (saved with canonical keys).
    pub model: Value,
    /// `optimizer.state_dict()` layout.
    pub optimizer: Value,
    pub scheduler: Value,
    pub sampler: Value,
    pub rng: Value,
    pub world_size: i64,
    pub config: Value,
    /// `GradScaler.state_dict()` of a float16 mixed-precision run (torch's recipe saves it
    /// under `scaler`); `Value::None` otherwise, and then not written.
    pub scaler: Value,
}

impl TrainingCheckpoint {
    pub fn to_value(&self) -> Result<Value> {
        let mut v = Value::dict_from([
            ("epoch", Value::Int(self.epoch)),
            ("global_step", Value::Int(self.global_step)),
            ("model", canonicalize_keys(&self.model)?),
            ("optimizer", self.optimizer.clone()),
            ("scheduler", self.scheduler.clone()),
            ("sampler", self.sampler.clone()),
            ("rng", self.rng.clone()),
            ("world_size", Value::Int(self.world_size)),
            ("config", self.config.clone()),
            ("tandem_version", Value::Str(env!("CARGO_PKG_VERSION").to_string())),
        ]);
        if !matches!(self.scaler, Value::None) {
            if let Value::Dict(items) = &mut v {
                items.push((Value::Str("scaler".into()), self.scaler.clone()));
            }
        }
        Ok(v)
    }

    /// Reads the fields back; a missing or mistyped field is an error naming it.
    pub fn from_value(v: &Value) -> Result<Self> {
        let field = |k: &str| {
            v.get(k).ok_or_else(|| CkptError::TrainingField {
                field: k.to_string(),
                problem: "missing".into(),
            })
        };
        let int = |k: &str| {
            let value = field(k)?;
            value.as_int().ok_or_else(|| CkptError::TrainingField {
                field: k.to_string(),
                problem: format!("expected an int, found a {}", value.type_name()),
            })
        };
        Ok(TrainingCheckpoint {
            epoch: int("epoch")?,
            global_step: int("global_step")?,
            model: field("model")?.clone(),
            optimizer: field("optimizer")?.clone(),
            scheduler: v.get("scheduler").cloned().unwrap_or(Value::None),
            sampler: v.get("sampler").cloned().unwrap_or(Value::None),
            rng: v.get("rng").cloned().unwrap_or(Value::None),
            world_size: int("world_size")?,
            config: v.get("config").cloned().unwrap_or(Value::None),
            scaler: v.get("scaler").cloned().unwrap_or(Value::None),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::TensorData;

    #[test]
    fn training_checkpoint_round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let t = TrainingCheckpoint {
            epoch: 3,
            global_step: 300,
            model: Value::dict_from([("w", Value::Tensor(TensorData::from_f32(&[1], &[0.5])))]),
            optimizer: Value::dict_from([("state", Value::new_dict())]),
            scheduler: Value::None,
            sampler: Value::dict_from([("epoch", Value::Int(3))]),
            rng: Value::Bytes(vec![1, 2, 3]),
            world_size: 4,
            config: Value::dict_from([("lr", Value::Float(0.1))]),
            scaler: Value::None,
        };
        let path = dir.path().join("checkpoint-epoch-3.pt");
        crate::save(&path, &t.to_value().unwrap()).unwrap();
        let v = crate::load(&path).unwrap();
        assert_eq!(TrainingCheckpoint::from_value(&v).unwrap(), t);
        assert_eq!(
            v.get("tandem_version").and_then(Value::as_str),
            Some(env!("CARGO_PKG_VERSION"))
        );
        assert!(TrainingCheckpoint::from_value(&Value::new_dict())
            .unwrap_err()
            .to_string()
            .contains("epoch"));
    }

    #[test]
    fn a_missing_or_mistyped_training_field_is_named() {
        let ck = |epoch: Option<Value>, world_size: Value| {
            let mut items = vec![("global_step", Value::Int(10)), ("model", Value::new_dict())];
            items.push(("optimizer", Value::new_dict()));
            items.push(("world_size", world_size));
            items.extend(epoch.map(|e| ("epoch", e)));
            Value::dict_from(items)
        };
        match TrainingCheckpoint::from_value(&ck(None, Value::Int(2))) {
            Err(CkptError::TrainingField { field, problem }) => {
                assert_eq!((field.as_str(), problem.as_str()), ("epoch", "missing"))
            }
            other => panic!("expected TrainingField, got {other:?}"),
        }
        let err =
            TrainingCheckpoint::from_value(&ck(Some(Value::Int(1)), Value::Str("two".into())))
                .unwrap_err()
                .to_string();
        assert_eq!(err, "training checkpoint field `world_size`: expected an int, found a str");
    }
}
