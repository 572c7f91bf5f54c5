//! The optimizer interface ([`TorchOptimizer`]) and its errors.
use candle_core::backprop::GradStore;
use tandem_ckpt::Value;

/// What can go wrong building, stepping or (re)loading an optimizer, a learning-rate
/// scheduler or a GradScaler, or clipping gradients: the crate's one error.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A setting outside its valid range (torch raises `ValueError` for the same).
    #[error("invalid {of} setting {name}={value}: {why}")]
    InvalidConfig { of: Part, name: &'static str, value: String, why: &'static str },
    /// A parameter the optimizer cannot handle (for example an integer tensor).
    #[error("parameter {index}: {why}")]
    InvalidParam { index: usize, why: String },
    /// A state_dict that does not fit; `key` is the path inside the state_dict, for example
    /// `state.3.exp_avg`, `param_groups.0.lr` or a scheduler's `last_epoch`.
    #[error("{of} state_dict: {key}: {why}")]
    StateDict { of: Part, key: String, why: String },
    /// A tensor operation failed while updating parameter `index`.
    #[error("updating parameter {index}: {source}")]
    Step {
        index: usize,
        #[source]
        source: candle_core::Error,
    },
    /// A tensor operation on parameter `index`'s gradient failed (unscaling, clipping).
    #[error("{of}: gradient of parameter {index}: {source}")]
    Gradient {
        of: Part,
        index: usize,
        #[source]
        source: candle_core::Error,
    },
    /// A collective of the sharded optimizer failed (a peer died, timed out, ...).
    #[cfg(feature = "zero")]
    #[error("ZeroRedundancyOptimizer {op}: {source}")]
    Collective {
        op: &'static str,
        #[source]
        source: tandem_comm::CommSource,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("unscale_() has already been called on this optimizer since the last update()")]
    AlreadyUnscaled,
    #[error("step() has already been called on this optimizer since the last update()")]
    AlreadyStepped,
    #[error(
        "update() found no inf checks since the last update(): call step() (or unscale_()) first"
    )]
    NoInfChecks,
    /// torch's "Attempting to unscale FP16 gradients.": float16 gradients have too little range to
    /// be unscaled in place; the parameters should stay float32 (see
    /// [`autocast_var_builder`](crate::amp::autocast_var_builder)).
    #[error("gradient of parameter {index} is float16: GradScaler needs float32 (or bf16) master parameters; build the model with autocast_var_builder to compute in float16")]
    Fp16Gradient { index: usize },
    #[error("GradScaler state_dict is empty: it was saved from a disabled GradScaler")]
    EmptyStateDict,
    #[error("GradScaler: scaling the loss: {0}")]
    Scale(#[source] candle_core::Error),
    #[error("invalid max_norm {0}: must be a finite number >= 0")]
    InvalidMaxNorm(f64),
    /// torch's `error_if_nonfinite=True`: clipping by a NaN/inf norm would zero or poison every
    /// gradient, so the gradients are left untouched and the caller decides (skip the step).
    #[error("the total gradient norm is {norm} (non-finite); gradients were left unchanged")]
    NonFiniteNorm { norm: f64 },
    /// Summing a number over the ranks that hold a sharded model's gradients failed (the
    /// squared gradient norm for clipping, the GradScaler's inf/NaN check).
    #[error("{what}: summing over the ranks: {source}")]
    OverRanks {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What an [`OptimError`] is about: the optimizer, a learning-rate scheduler, the GradScaler
/// or gradient clipping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Optimizer,
    Scheduler,
    GradScaler,
    Clipping,
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Part::Optimizer => "optimizer",
            Part::Scheduler => "scheduler",
            Part::GradScaler => "GradScaler",
            Part::Clipping => "clipping",
        })
    }
}

impl OptimError {
    /// `of`'s state_dict entry `key` does not fit: `why`.
    pub(crate) fn state_dict(of: Part, key: impl Into<String>, why: impl Into<String>) -> Self {
        OptimError::StateDict { of, key: key.into(), why: why.into() }
    }

    pub(crate) fn state(key: impl Into<String>, why: impl Into<String>) -> Self {
        OptimError::state_dict(Part::Optimizer, key, why)
    }
}

/// `v >= 0`, false for NaN (hyperparameter checks must refuse NaN too).
pub(crate) fn non_negative(v: f64) -> bool {
    v >= 0.0
}

/// The optimizer interface (as `torch.optim.Optimizer`, minus closures and `zero_grad`: a
/// candle [`GradStore`] is fresh after every backward): torch's update rules, param groups and
/// `state_dict` layout. Named apart from candle-nn's `Optimizer`, which users import too.
pub trait TorchOptimizer {
    /// One update of every parameter that has a gradient in `grads`.
    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError>;
    /// The learning rate of the first param group.
    fn lr(&self) -> f64;
    /// Sets the learning rate of every param group.
    fn set_lr(&mut self, lr: f64);
    /// The learning rate of each param group, in group order.
    fn group_lrs(&self) -> Vec<f64>;
    /// Sets the learning rate of each param group (`lrs.len()` must equal the group count).
    fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<(), OptimError>;
    /// The parameters in state_dict index order.
    fn params(&self) -> Vec<candle_core::Var>;
    /// The state in `torch.optim.Optimizer.state_dict()` layout. Fails only when a state tensor
    /// cannot be copied to the host.
    fn state_dict(&self) -> Result<Value, OptimError>;
    /// The `state` entry of parameter `index` alone (`Value::None` before its first step):
    /// what [`TorchOptimizer::state_dict`] holds under that index, without copying the others.
    fn param_state(&self, index: usize) -> Result<Value, OptimError> {
        let sd = self.state_dict()?;
        let entry = sd.get("state").and_then(Value::as_dict).and_then(|items| {
            items.iter().find(|(k, _)| k.as_int() == Some(index as i64)).map(|(_, v)| v.clone())
        });
        Ok(entry.unwrap_or(Value::None))
    }
    /// Loads a state made by [`TorchOptimizer::state_dict`] or by torch (same optimizer type, same
    /// group sizes). Hyperparameters, the learning rate included, come from the loaded groups,
    /// as in torch. Nothing changes when an error is returned.
    fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), OptimError>;
    /// The next [`step`](TorchOptimizer::step)'s gradient of parameter `index` holds only rows
    /// `rows` of it (ascending, unique), stacked: `[rows.len(), ...]` instead of the
    /// parameter's shape, every other row's gradient being zero. The step is the one the dense
    /// gradient would give (momentum and weight decay still move every row, as in torch),
    /// without the dense gradient ever existing: what PartialFC's sampled head needs. tandem's
    /// SGD updates in place row by row; Adam densifies. Unsupported by default.
    fn set_grad_rows(&mut self, index: usize, _rows: Vec<u32>) -> Result<(), OptimError> {
        Err(OptimError::InvalidParam {
            index,
            why: "this optimizer takes dense gradients only".into(),
        })
    }
    /// Parameter `index` becomes `var`, of any shape (a model-parallel part re-split over
    /// another world: PartialFC's rows), with no state until a state dict is loaded or it is
    /// stepped. Unsupported by default.
    fn set_param(&mut self, index: usize, _var: candle_core::Var) -> Result<(), OptimError> {
        Err(OptimError::InvalidParam {
            index,
            why: "this optimizer cannot replace a parameter".into(),
        })
    }
    /// For an optimizer whose state is sharded over the ranks (ZeRO-1): the global parameter
    /// indices whose state this rank holds. `None` (the default): it holds all of it, and
    /// [`TorchOptimizer::state_dict`] is the whole state.
    fn owned_params(&self) -> Option<Vec<usize>> {
        None
    }
    /// This rank's part of a sharded state, for a sharded checkpoint (`None` where
    /// [`TorchOptimizer::owned_params`] is `None`). Loading takes the hyperparameters with the
    /// entries this rank owns under `state` (see [`OptimizerShard::full`]).
    fn shard(&self) -> Result<Option<OptimizerShard>, OptimError> {
        Ok(None)
    }
    /// For a sharded optimizer: the rank that holds each parameter's state (by global index)
    /// in a world of `world` ranks, as [`TorchOptimizer::repartition`] would split it. `None`
    /// (the default): not sharded.
    fn owners_for(&self, _world: usize) -> Option<Vec<usize>> {
        None
    }
    /// For a sharded optimizer, after its collectives re-formed over another world (a live
    /// regroup): takes this rank's share and loads `state` (the hyperparameters, and the
    /// entries this rank now owns under `state`; an entry left out starts afresh). Refused by
    /// an optimizer that is not sharded.
    fn repartition(&mut self, _state: &Value) -> Result<(), OptimError> {
        Err(OptimError::state("(repartition)", "this optimizer is not sharded over the ranks"))
    }
}

/// A boxed optimizer is one (`Box<dyn TorchOptimizer + Send>` is what a recipe picking its
/// optimizer at run time holds), and so an [`OptimizerState`](crate::OptimizerState) too.
impl<T: TorchOptimizer + ?Sized> TorchOptimizer for Box<T> {
    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        (**self).step(grads)
    }
    fn lr(&self) -> f64 {
        (**self).lr()
    }
    fn set_lr(&mut self, lr: f64) {
        (**self).set_lr(lr)
    }
    fn group_lrs(&self) -> Vec<f64> {
        (**self).group_lrs()
    }
    fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<(), OptimError> {
        (**self).set_group_lrs(lrs)
    }
    fn params(&self) -> Vec<candle_core::Var> {
        (**self).params()
    }
    fn state_dict(&self) -> Result<Value, OptimError> {
        (**self).state_dict()
    }
    fn param_state(&self, index: usize) -> Result<Value, OptimError> {
        (**self).param_state(index)
    }
    fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), OptimError> {
        (**self).load_state_dict(state_dict)
    }
    fn set_grad_rows(&mut self, index: usize, rows: Vec<u32>) -> Result<(), OptimError> {
        (**self).set_grad_rows(index, rows)
    }
    fn set_param(&mut self, index: usize, var: candle_core::Var) -> Result<(), OptimError> {
        (**self).set_param(index, var)
    }
    fn owned_params(&self) -> Option<Vec<usize>> {
        (**self).owned_params()
    }
    fn shard(&self) -> Result<Option<OptimizerShard>, OptimError> {
        (**self).shard()
    }
    fn owners_for(&self, world: usize) -> Option<Vec<usize>> {
        (**self).owners_for(world)
    }
    fn repartition(&mut self, state: &Value) -> Result<(), OptimError> {
        (**self).repartition(state)
    }
}

/// A rank's part of an optimizer state sharded over the ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerShard {
    /// torch's layout over every parameter with an empty `state`: the hyperparameters.
    pub groups: Value,
    /// The global parameter indices whose state this rank holds.
    pub indices: Vec<usize>,
    /// `{global index: entry}` for those (an index without state yet is absent).
    pub entries: Value,
}

impl OptimizerShard {
    /// `groups` with `entries` as its `state`: a state dict over every parameter that holds
    /// only these entries (what a sharded optimizer loads).
    pub fn full(groups: &Value, entries: Value) -> Value {
        let mut full = groups.clone();
        full.insert("state", entries);
        full
    }
}
