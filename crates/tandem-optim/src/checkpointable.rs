//! [`OptimizerState`]: an optimizer whose state a training checkpoint can hold — every
//! [`TorchOptimizer`] (tandem's optimizers, ZeRO included) and candle-nn's `SGD`, whose only
//! state is its learning rate. candle-nn's `AdamW` keeps its moments private, so it cannot be
//! checkpointed and is refused at compile time with a note naming tandem's drop-in.
use tandem_ckpt::Value;

use crate::{OptimError, OptimizerShard, TorchOptimizer};

/// An optimizer whose state goes into a training checkpoint, in `torch.optim`'s layout.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no state tandem can checkpoint",
    label = "not an optimizer tandem can save",
    note = "tandem saves its own optimizers (tandem::optim::{{TorchSgd, TorchAdam, TorchAdamW, ZeroRedundancyOptimizer}}) and candle-nn's SGD",
    note = "candle-nn's AdamW keeps its moments private: use tandem::optim::TorchAdamW, which implements candle_nn::Optimizer too"
)]
pub trait OptimizerState {
    /// The state in `torch.optim.Optimizer.state_dict()` layout. `num_params` is the model's
    /// parameter count, for optimizers that do not expose their parameter list (candle-nn's).
    fn save_optimizer_state(&self, num_params: usize) -> Result<Value, OptimError>;
    /// Restores a state made by `save_optimizer_state` (or by torch for the same optimizer).
    fn load_optimizer_state(&mut self, state: &Value) -> Result<(), OptimError>;
    /// A state sharded over the ranks (ZeRO-1): this rank's part, saved as a shard instead of
    /// `save_optimizer_state`'s whole state. `None` (the default): not sharded.
    fn optimizer_shard(&self) -> Result<Option<OptimizerShard>, OptimError> {
        Ok(None)
    }
    /// The global parameter indices whose state this rank loads (`None`: all).
    fn owned_params(&self) -> Option<Vec<usize>> {
        None
    }
    /// For a sharded optimizer: the rank holding each parameter's state in a world of `world`
    /// ranks (see [`TorchOptimizer::owners_for`]).
    fn owners_for(&self, _world: usize) -> Option<Vec<usize>> {
        None
    }
    /// For a sharded optimizer after a regroup: takes this rank's share and loads `state` (see
    /// [`TorchOptimizer::repartition`]).
    fn repartition(&mut self, _state: &Value) -> Result<(), OptimError> {
        Err(OptimError::state("(repartition)", "this optimizer is not sharded over the ranks"))
    }
    /// Parameter `index`'s entry of the state alone (`Value::None` before its first step).
    fn param_entry(&self, _index: usize) -> Result<Value, OptimError> {
        Ok(Value::None)
    }
    /// Parameter `index` becomes `var`, of any shape (see [`TorchOptimizer::set_param`]).
    fn replace_param(&mut self, index: usize, _var: candle_core::Var) -> Result<(), OptimError> {
        Err(OptimError::InvalidParam {
            index,
            why: "this optimizer cannot replace a parameter".into(),
        })
    }
}

impl<T: TorchOptimizer + ?Sized> OptimizerState for T {
    fn save_optimizer_state(&self, _num_params: usize) -> Result<Value, OptimError> {
        self.state_dict()
    }
    fn load_optimizer_state(&mut self, state: &Value) -> Result<(), OptimError> {
        self.load_state_dict(state)
    }
    fn optimizer_shard(&self) -> Result<Option<OptimizerShard>, OptimError> {
        self.shard()
    }
    fn owned_params(&self) -> Option<Vec<usize>> {
        TorchOptimizer::owned_params(self)
    }
    fn owners_for(&self, world: usize) -> Option<Vec<usize>> {
        TorchOptimizer::owners_for(self, world)
    }
    fn repartition(&mut self, state: &Value) -> Result<(), OptimError> {
        TorchOptimizer::repartition(self, state)
    }
    fn param_entry(&self, index: usize) -> Result<Value, OptimError> {
        self.param_state(index)
    }
    fn replace_param(&mut self, index: usize, var: candle_core::Var) -> Result<(), OptimError> {
        self.set_param(index, var)
    }
}

/// candle-nn's plain SGD is torch's `SGD` without momentum, dampening or weight decay: its
/// state is one param group holding the learning rate.
impl OptimizerState for candle_nn::SGD {
    fn save_optimizer_state(&self, num_params: usize) -> Result<Value, OptimError> {
        use candle_nn::Optimizer;
        let group = Value::dict_from([
            ("lr", Value::Float(self.learning_rate())),
            ("momentum", Value::Float(0.0)),
            ("dampening", Value::Float(0.0)),
            ("weight_decay", Value::Float(0.0)),
            ("nesterov", Value::Bool(false)),
            ("maximize", Value::Bool(false)),
            ("foreach", Value::None),
            ("differentiable", Value::Bool(false)),
            ("fused", Value::None),
            ("params", Value::List((0..num_params as i64).map(Value::Int).collect())),
        ]);
        Ok(Value::dict_from([
            ("state", Value::new_dict()),
            ("param_groups", Value::List(vec![group])),
        ]))
    }

    fn load_optimizer_state(&mut self, state: &Value) -> Result<(), OptimError> {
        use candle_nn::Optimizer;
        let groups = state
            .get("param_groups")
            .and_then(Value::as_list)
            .ok_or_else(|| OptimError::state("param_groups", "missing or not a list"))?;
        let [group] = groups else {
            return Err(OptimError::state(
                "param_groups",
                format!("{} groups; candle-nn's SGD has one", groups.len()),
            ));
        };
        for key in ["momentum", "weight_decay", "dampening"] {
            let v = group.get(key).and_then(Value::as_float).unwrap_or(0.0);
            if v != 0.0 {
                return Err(OptimError::state(
                    format!("param_groups.0.{key}"),
                    format!(
                        "{v}: candle-nn's SGD has no {key}; load it into tandem::optim::TorchSgd"
                    ),
                ));
            }
        }
        let non_empty = state.get("state").and_then(|s| match s {
            Value::Dict(items) => Some(!items.is_empty()),
            _ => None,
        });
        if non_empty == Some(true) {
            return Err(OptimError::state(
                "state",
                "per-parameter state (momentum buffers) that candle-nn's SGD cannot hold; load it into tandem::optim::TorchSgd",
            ));
        }
        let lr = group
            .get("lr")
            .and_then(Value::as_float)
            .ok_or_else(|| OptimError::state("param_groups.0.lr", "missing or not a number"))?;
        self.set_learning_rate(lr);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use candle_nn::Optimizer;

    #[test]
    fn candle_sgd_round_trips_its_learning_rate_and_refuses_momentum_state() {
        let v = Var::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap();
        let mut sgd = candle_nn::SGD::new(vec![v.clone()], 0.25).unwrap();
        let saved = sgd.save_optimizer_state(1).unwrap();
        let mut other = candle_nn::SGD::new(vec![v.clone()], 0.5).unwrap();
        other.load_optimizer_state(&saved).unwrap();
        assert_eq!(other.learning_rate(), 0.25);

        // A tandem SGD with momentum writes state candle's cannot take: refused by name.
        let mut ours = crate::TorchSgd::new(
            vec![v.clone()],
            crate::SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() },
        )
        .unwrap();
        let grads = {
            let loss = (v.as_tensor() * 2.0).unwrap().sum_all().unwrap();
            loss.backward().unwrap()
        };
        ours.step(&grads).unwrap();
        let e = sgd.load_optimizer_state(&ours.state_dict().unwrap()).unwrap_err().to_string();
        assert!(e.contains("momentum") && e.contains("tandem::optim::TorchSgd"), "{e}");
        assert_eq!(sgd.learning_rate(), 0.25, "nothing changed by the refused load");
    }
}
