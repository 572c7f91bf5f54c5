//! The run's optimizer: `--optimizer sgd|adamw` over every parameter, or with `--zero` the same
//! optimizer sharded over the ranks (ZeroRedundancyOptimizer: each rank keeps the state of its
//! share of the parameters; the weights are the same bit for bit).
use std::sync::Arc;

use candle_core::Var;
use tandem_ckpt::Value;
use tandem_comm::{Collectives, ProcessGroup};
#[cfg(feature = "zero")]
use tandem_optim::ZeroRedundancyOptimizer;
use tandem_optim::{AdamWConfig, OptimError, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};

/// One optimizer over the parameters it is given (all of them, or ZeRO's shard).
type ShardOptimizer = Box<dyn TorchOptimizer + Send>;

use tandem_train::Result;

use crate::options::{OptimizerKind, TrainOptions};

pub enum TrainOptimizer {
    Plain(ShardOptimizer),
    #[cfg(feature = "zero")]
    Zero(ZeroRedundancyOptimizer),
}

/// The optimizer `cfg` names over `params`.
fn plain(cfg: &TrainOptions, params: Vec<Var>) -> Result<ShardOptimizer, OptimError> {
    Ok(match cfg.optim.kind {
        OptimizerKind::Sgd => Box::new(TorchSgd::new(
            params,
            SgdConfig {
                lr: cfg.optim.lr,
                momentum: cfg.optim.momentum,
                dampening: 0.0,
                weight_decay: cfg.optim.weight_decay,
                nesterov: false,
            },
        )?),
        OptimizerKind::Adamw => Box::new(TorchAdamW::new(
            params,
            AdamWConfig {
                lr: cfg.optim.lr,
                weight_decay: cfg.optim.weight_decay,
                ..AdamWConfig::default()
            },
        )?),
    })
}

impl TrainOptimizer {
    pub fn new(cfg: &TrainOptions, params: Vec<Var>, group: &ProcessGroup) -> Result<Self> {
        Self::with_comm(cfg, params, Arc::new(group.clone()))
    }

    /// [`TrainOptimizer::new`] with ZeRO's collectives `comm` (a live world's follow its
    /// regroups).
    #[cfg_attr(not(feature = "zero"), allow(unused_variables))]
    pub fn with_comm(
        cfg: &TrainOptions,
        params: Vec<Var>,
        comm: Arc<dyn Collectives>,
    ) -> Result<Self> {
        #[cfg(feature = "zero")]
        if cfg.optim.zero {
            let zero = ZeroRedundancyOptimizer::new(params, comm, |shard| plain(cfg, shard))?;
            return Ok(TrainOptimizer::Zero(zero));
        }
        Ok(TrainOptimizer::Plain(plain(cfg, params)?))
    }

    pub fn get(&self) -> &dyn TorchOptimizer {
        match self {
            TrainOptimizer::Plain(o) => o.as_ref(),
            #[cfg(feature = "zero")]
            TrainOptimizer::Zero(z) => z,
        }
    }

    pub fn get_mut(&mut self) -> &mut dyn TorchOptimizer {
        match self {
            TrainOptimizer::Plain(o) => o.as_mut(),
            #[cfg(feature = "zero")]
            TrainOptimizer::Zero(z) => z,
        }
    }

    /// What a live regroup's source sends: the whole state, or with `--zero` the
    /// hyperparameters only (torch's layout over every parameter, no `state` entries: each
    /// shard moves with [`TrainOptimizer::repartition`]). Not a collective.
    pub fn live_state(&self) -> Result<Value> {
        match self {
            TrainOptimizer::Plain(o) => Ok(o.state_dict()?),
            #[cfg(feature = "zero")]
            TrainOptimizer::Zero(z) => Ok(z.hyperparameters()?),
        }
    }

    /// ZeRO after a live regroup: this rank's shard of the new world's partition, loaded from
    /// `state` (the entries this rank now owns and the hyperparameters).
    #[cfg(feature = "zero")]
    pub fn repartition(&mut self, cfg: &TrainOptions, state: &Value) -> Result<()> {
        if let TrainOptimizer::Zero(z) = self {
            z.repartition(state, |shard| plain(cfg, shard))?;
        }
        Ok(())
    }
}
