//! The run's optimizer: `--optimizer sgd|adamw` with the run's settings over parameter groups
//! that share them (the classifier's one group; the face recipe's backbone and head, as
//! arcface_torch), or with `--zero` the same optimizer sharded over the ranks
//! (ZeroRedundancyOptimizer: each rank keeps the state of its share of the parameters; the
//! weights are the same bit for bit).
use std::sync::Arc;

use candle_core::Var;
use tandem_comm::Collectives;
#[cfg(feature = "zero")]
use tandem_optim::ZeroRedundancyOptimizer;
use tandem_optim::{AdamWConfig, OptimError, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};

use crate::options::{OptimOptions, OptimizerKind};

/// An optimizer picked at run time.
pub type RunOptimizer = Box<dyn TorchOptimizer + Send>;

/// The optimizer `optim` names over `groups`, each group with the same settings.
pub fn build(optim: &OptimOptions, groups: Vec<Vec<Var>>) -> Result<RunOptimizer, OptimError> {
    Ok(match optim.kind {
        OptimizerKind::Sgd => {
            let c = SgdConfig {
                lr: optim.lr,
                momentum: optim.momentum,
                weight_decay: optim.weight_decay,
                ..SgdConfig::default()
            };
            Box::new(TorchSgd::with_groups(groups.into_iter().map(|g| (g, c.clone())).collect())?)
        }
        OptimizerKind::Adamw => {
            let c = AdamWConfig {
                lr: optim.lr,
                weight_decay: optim.weight_decay,
                ..AdamWConfig::default()
            };
            let groups = groups.into_iter().map(|g| (g, c.clone())).collect();
            Box::new(TorchAdamW::with_groups(groups)?)
        }
    })
}

/// The optimizer over a whole model's `params`: sharded over `comm`'s ranks with `--zero`
/// (its collectives: a live world's follow its regroups, and so does the shard).
#[cfg_attr(not(feature = "zero"), allow(unused_variables))]
pub fn for_model(
    optim: &OptimOptions,
    params: Vec<Var>,
    comm: Arc<dyn Collectives>,
) -> Result<RunOptimizer, OptimError> {
    #[cfg(feature = "zero")]
    if optim.zero {
        let optim = optim.clone();
        let make = move |shard| build(&optim, vec![shard]);
        return Ok(Box::new(ZeroRedundancyOptimizer::new(params, comm, make)?));
    }
    build(optim, vec![params])
}
