//! The run's optimizer: `--optimizer sgd|adamw` over every parameter, or with `--zero` the same
//! optimizer sharded over the ranks (ZeroRedundancyOptimizer: each rank keeps the state of its
//! share of the parameters; the weights are the same bit for bit).
use std::sync::Arc;

use candle_core::Var;
use tandem_ckpt::Value;
use tandem_comm::ProcessGroup;
use tandem_optim::{
    AdamWConfig, OptimError, SgdConfig, ShardOptimizer, TorchAdamW, TorchOptimizer, TorchSgd,
    ZeroRedundancyOptimizer,
};

use crate::error::Result;
use crate::options::{OptimizerKind, TrainOptions};

pub enum TrainOptimizer {
    Plain(ShardOptimizer),
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
        Ok(if cfg.optim.zero {
            let comm = Arc::new(group.clone());
            TrainOptimizer::Zero(ZeroRedundancyOptimizer::new(params, comm, |shard| {
                plain(cfg, shard)
            })?)
        } else {
            TrainOptimizer::Plain(plain(cfg, params)?)
        })
    }

    pub fn get(&self) -> &dyn TorchOptimizer {
        match self {
            TrainOptimizer::Plain(o) => o.as_ref(),
            TrainOptimizer::Zero(z) => z,
        }
    }

    pub fn get_mut(&mut self) -> &mut dyn TorchOptimizer {
        match self {
            TrainOptimizer::Plain(o) => o.as_mut(),
            TrainOptimizer::Zero(z) => z,
        }
    }

    /// The whole optimizer state for rank 0's checkpoint, in torch's layout. A collective with
    /// `--zero` (every rank sends its shard to rank 0; the others get `Value::None`, as they
    /// write nothing), so every rank calls it at every save.
    pub fn checkpoint_state(&mut self, rank: usize) -> Result<Value> {
        match self {
            TrainOptimizer::Plain(o) => Ok(o.state_dict()?),
            TrainOptimizer::Zero(z) => {
                z.consolidate_state_dict(0)?;
                Ok(if rank == 0 { z.state_dict()? } else { Value::None })
            }
        }
    }
}
