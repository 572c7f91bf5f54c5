//! The `ParamModule` trait: what Ddp and DataParallel need from a model, plus state-dict helpers
//! with canonical (never `module.`-prefixed) keys.
use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};

use crate::error::{DdpError, Result};
use crate::params::ParamSet;

/// A model whose parameters Ddp and DataParallel can reach: named `Var`s read through a
/// [`ParamSet`], buffers, and replication. Named apart from candle-nn's `Module` (the forward
/// pass), which a model usually implements too.
pub trait ParamModule: Send + Sync {
    /// Parameters in PyTorch `named_parameters()` order, read through the per-step view.
    fn params(&self) -> &ParamSet;

    /// Buffers (e.g. BatchNorm running statistics) in `named_buffers()` order.
    fn named_buffers(&self) -> Vec<(String, Var)> {
        Vec::new()
    }

    /// A copy of this module with fresh `Var`s on `device` (DataParallel's replicas).
    fn replicate(&self, device: &Device) -> Result<Self>
    where
        Self: Sized;

    fn named_parameters(&self) -> Vec<(String, Var)> {
        self.params().named().to_vec()
    }

    /// Parameters then buffers, canonical names, current values (detached copies).
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
            .into_iter()
            .chain(self.named_buffers())
            .map(|(n, v)| (n, v.as_tensor().detach()))
            .collect()
    }

    /// Loads values by canonical name. Strict: a missing, unexpected or shape-mismatched key is
    /// an error naming it, and nothing is written unless everything matches.
    fn load_state_dict(&self, state: Vec<(String, Tensor)>) -> Result<()> {
        let targets: Vec<(String, Var)> =
            self.named_parameters().into_iter().chain(self.named_buffers()).collect();
        let mut given: HashMap<String, Tensor> = state.into_iter().collect();
        let mut plan = Vec::with_capacity(targets.len());
        let mut missing = Vec::new();
        let mut mismatched = Vec::new();
        for (name, var) in &targets {
            match given.remove(name) {
                None => missing.push(name.clone()),
                Some(t) if t.dims() != var.dims() => mismatched.push(format!(
                    "{name}: checkpoint {:?} vs model {:?}",
                    t.dims(),
                    var.dims()
                )),
                Some(t) => plan.push((var, t)),
            }
        }
        let mut unexpected: Vec<String> = given.into_keys().collect();
        unexpected.sort();
        if !missing.is_empty() || !unexpected.is_empty() || !mismatched.is_empty() {
            return Err(DdpError::StateDictMismatch { missing, unexpected, mismatched });
        }
        for (var, t) in plan {
            var.set(&t.to_device(var.device())?.to_dtype(var.dtype())?)?;
        }
        self.params().refresh_view();
        Ok(())
    }
}
