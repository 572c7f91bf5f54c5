//! The `ParamModule` trait: what Ddp and DataParallel need from a model, plus state-dict helpers
//! with canonical (never `module.`-prefixed) keys.
//!
//! Names mean one thing across tandem: `params()` is the parameters as candle `Var`s in
//! `named_parameters()` order (as on an optimizer); `state_dict()` is a checkpoint value in
//! PyTorch's layout (as on an optimizer, a scheduler or a GradScaler) and `load_state_dict`
//! takes one back; `named_tensors()` / `load_named_tensors()` are the same state as candle
//! tensors, for code that never leaves the process.
use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use tandem_ckpt::{LoadReport, Value};

use crate::error::{NnError, Result};
use crate::params::ParamSet;

/// A model whose parameters Ddp and DataParallel can reach: named `Var`s read through a
/// [`ParamSet`], buffers, and replication. Named apart from candle-nn's `Module` (the forward
/// pass), which a model usually implements too.
pub trait ParamModule: Send + Sync {
    /// Parameters in PyTorch `named_parameters()` order, read through the per-step view (what
    /// lets Ddp hook each parameter's gradient).
    fn param_set(&self) -> &ParamSet;

    /// The parameters as `Var`s, in `named_parameters()` order (what an optimizer takes).
    fn params(&self) -> Vec<Var> {
        self.param_set().vars()
    }

    /// Buffers (e.g. BatchNorm running statistics) in `named_buffers()` order.
    fn named_buffers(&self) -> Vec<(String, Var)> {
        Vec::new()
    }

    /// A copy of this module with fresh `Var`s on `device` (DataParallel's replicas).
    fn replicate(&self, device: &Device) -> Result<Self>
    where
        Self: Sized;

    fn named_parameters(&self) -> Vec<(String, Var)> {
        self.param_set().named().to_vec()
    }

    /// Parameters then buffers, canonical names, current values (detached copies).
    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
            .into_iter()
            .chain(self.named_buffers())
            .map(|(n, v)| (n, v.as_tensor().detach()))
            .collect()
    }

    /// Loads values by canonical name. Strict: a missing, unexpected or shape-mismatched key is
    /// an error naming it, and nothing is written unless everything matches.
    fn load_named_tensors(&self, state: Vec<(String, Tensor)>) -> Result<()> {
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
            return Err(NnError::StateDictMismatch { missing, unexpected, mismatched });
        }
        for (var, t) in plan {
            var.set(&t.to_device(var.device())?.to_dtype(var.dtype())?)?;
        }
        self.param_set().refresh_view();
        Ok(())
    }

    /// Parameters then buffers as a checkpoint value in PyTorch's `state_dict()` layout
    /// (canonical names; what `torch.save(model.state_dict())` writes).
    fn state_dict(&self) -> Result<Value> {
        crate::weights::state_dict_value(self)
    }

    /// Loads a PyTorch-layout state dict strictly: any container or `module.` wrapping is
    /// accepted, a missing, unexpected or mis-shaped key is an error listing all of them, and
    /// nothing is written unless everything matches.
    fn load_state_dict(&self, state_dict: &Value) -> Result<LoadReport> {
        crate::weights::load_weights_from(self, state_dict, true)
    }
}
