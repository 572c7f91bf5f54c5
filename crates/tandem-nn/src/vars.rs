//! Ddp for stock candle models: the parameters live in a `candle_nn::VarMap` (layers built from
//! a `VarBuilder`) or in any list of named `Var`s, and the model code stays as it is.
//!
//! ```ignore
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let model = MyNet::new(vb)?;                          // candle-nn layers, nothing tandem-specific
//! let ddp = Ddp::from_varmap(&varmap, &group, DdpOptions::default())?; // rank 0's values everywhere
//! let mut opt = candle_nn::SGD::new(varmap.all_vars(), 0.05)?;       // or tandem's optimizers
//! let grads = ddp.backward(&model.forward(&x)?.loss(&y)?)?;          // world-averaged GradStore
//! opt.step(&grads)?;
//! ```
//!
//! Such a model reads its `Var`s directly, so Ddp sees no per-parameter hook: the gradients are
//! reduced after backward, bucketed, each full bucket handed to the communication thread while
//! the next ones are copied. Models written against a [`ParamSet`] view overlap the all-reduce
//! with backward instead (`tandem bench ddp --mode varmap|paramset` measures both).
//!
//! Buffers: entries named `*.running_mean`, `*.running_var` and `*.num_batches_tracked`
//! (candle-nn's and PyTorch's BatchNorm statistics) are buffers, not parameters: they take no
//! gradient and are broadcast from rank 0 at every step when `broadcast_buffers` is on. Without
//! a forward hook that broadcast happens in `backward`, after this step's forward has updated
//! the statistics, so every rank leaves the step holding rank 0's, and the next forward uses
//! them, as with PyTorch's broadcast before each forward.
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};

use crate::error::{NnError, Result};
use crate::module::ParamModule;
use crate::params::ParamSet;
use crate::torch_init::copy_vars;

/// Final name components of non-trainable state kept beside the parameters.
const BUFFER_NAMES: [&str; 3] = ["running_mean", "running_var", "num_batches_tracked"];

/// Whether `name` is a buffer (BatchNorm's statistics: kept beside the parameters, never
/// stepped by an optimizer), not a parameter: by its last component, as PyTorch names them.
pub fn is_buffer(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or(name);
    BUFFER_NAMES.contains(&last)
}

/// A model's variables as Ddp sees them: parameters in a fixed order, and buffers.
pub struct NamedVars {
    params: ParamSet,
    buffers: Vec<(String, Var)>,
}

impl NamedVars {
    /// Every variable of `varmap`, sorted by name: a `VarMap` is a hash map, and the order must
    /// be the same on every rank (it fixes the gradient buckets).
    pub fn from_varmap(varmap: &VarMap) -> NamedVars {
        let mut named: Vec<(String, Var)> = {
            let data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
            data.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
        };
        named.sort_by(|a, b| a.0.cmp(&b.0));
        NamedVars::new(named)
    }

    /// These variables in this order (PyTorch's `named_parameters()` order, say); buffers are
    /// recognised by name and set apart.
    pub fn new(named: Vec<(String, Var)>) -> NamedVars {
        let (buffers, params): (Vec<_>, Vec<_>) =
            named.into_iter().partition(|(name, _)| is_buffer(name));
        NamedVars { params: ParamSet::new(params), buffers }
    }

    /// Moves the parameters named in `frozen` among the buffers (PyTorch's parameters with
    /// `requires_grad = False`, such as arcface_torch's `features.weight`): they stay in the
    /// state dict and are broadcast like buffers, but take no gradient, so Ddp does not wait
    /// for one and optimizers built from [`ParamModule::params`] leave them alone. A name that
    /// is not a parameter here is an error naming it.
    pub fn freeze(self, frozen: &[&str]) -> Result<NamedVars> {
        let mut params = self.params.named().to_vec();
        let mut buffers = self.buffers;
        for name in frozen {
            let Some(i) = params.iter().position(|(n, _)| n == name) else {
                return Err(NnError::InvalidOption {
                    what: "freeze",
                    why: format!("`{name}` is not a parameter of this model"),
                });
            };
            buffers.push(params.remove(i));
        }
        Ok(NamedVars { params: ParamSet::new(params), buffers })
    }
}

/// A `VarMap` that remembers the order in which the model created its variables, like the
/// registration order behind PyTorch's `named_parameters()`. Build the model from
/// [`OrderedVarMap::var_builder`]; [`OrderedVarMap::named_vars`] then lists the variables in
/// that order, so state dicts and optimizer states line up with the PyTorch module the model
/// was written after (a plain `VarMap` can only be sorted by name).
#[derive(Clone)]
pub struct OrderedVarMap {
    map: VarMap,
    order: Arc<Mutex<Vec<String>>>,
}

impl OrderedVarMap {
    pub fn new() -> Self {
        OrderedVarMap { map: VarMap::new(), order: Arc::default() }
    }

    /// A `VarBuilder` creating (or reusing) variables in this map.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// The underlying `VarMap` (for candle-nn optimizers, `save`/`load`, ...).
    pub fn varmap(&self) -> &VarMap {
        &self.map
    }

    /// Every variable with its name, in creation order.
    pub fn named(&self) -> Vec<(String, Var)> {
        let order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let data = self.map.data().lock().unwrap_or_else(|p| p.into_inner());
        order.iter().filter_map(|n| data.get(n).map(|v| (n.clone(), v.clone()))).collect()
    }

    /// The variables as Ddp wraps them: parameters and buffers, each in creation order.
    pub fn named_vars(&self) -> NamedVars {
        NamedVars::new(self.named())
    }
}

impl Default for OrderedVarMap {
    fn default() -> Self {
        Self::new()
    }
}

impl SimpleBackend for OrderedVarMap {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.map.get(s, name, h, dtype, dev)?;
        let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        if !order.iter().any(|n| n == name) {
            order.push(name.to_string());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        SimpleBackend::get_unchecked(&self.map, name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        SimpleBackend::contains_tensor(&self.map, name)
    }
}

impl ParamModule for NamedVars {
    fn param_set(&self) -> &ParamSet {
        &self.params
    }

    fn named_buffers(&self) -> Vec<(String, Var)> {
        self.buffers.clone()
    }

    /// Fresh copies on `device`: the model code itself is not replicated, so a DataParallel
    /// over a VarMap model needs one model per device built from these.
    fn replicate(&self, device: &Device) -> Result<Self> {
        Ok(NamedVars {
            params: ParamSet::new(copy_vars(self.params.named(), device)?),
            buffers: copy_vars(&self.buffers, device)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use candle_nn::VarBuilder;

    #[test]
    fn varmap_order_is_by_name_and_batchnorm_statistics_are_buffers() {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        candle_nn::linear(3, 4, vb.pp("fc2")).unwrap();
        candle_nn::batch_norm(4, 1e-5, vb.pp("bn")).unwrap();
        candle_nn::linear(2, 3, vb.pp("fc1")).unwrap();
        let vars = NamedVars::from_varmap(&varmap);
        let params: Vec<&str> = vars.param_set().named().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            params,
            ["bn.bias", "bn.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        );
        let buffers: Vec<String> = vars.named_buffers().into_iter().map(|(n, _)| n).collect();
        assert_eq!(buffers, ["bn.running_mean", "bn.running_var"]);
        // The same Vars as the model's, not copies.
        let data = varmap.data().lock().unwrap();
        assert_eq!(
            data["fc1.weight"].as_tensor().id(),
            vars.param_set().named()[3].1.as_tensor().id()
        );
    }

    #[test]
    fn ordered_varmap_keeps_creation_order() {
        let vars = OrderedVarMap::new();
        let vb = vars.var_builder(DType::F32, &Device::Cpu);
        candle_nn::linear(3, 4, vb.pp("fc2")).unwrap();
        crate::fast_batch_norm2d(4, vb.pp("bn")).unwrap();
        candle_nn::linear(2, 3, vb.pp("fc1")).unwrap();
        // Asking again for an existing variable does not move it.
        candle_nn::linear(3, 4, vb.pp("fc2")).unwrap();
        let named = vars.named_vars();
        let params: Vec<&str> = named.param_set().named().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            params,
            ["fc2.weight", "fc2.bias", "bn.weight", "bn.bias", "fc1.weight", "fc1.bias"]
        );
        let buffers: Vec<String> = named.named_buffers().into_iter().map(|(n, _)| n).collect();
        assert_eq!(buffers, ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]);
        assert_eq!(vars.varmap().all_vars().len(), 9);
    }
}
