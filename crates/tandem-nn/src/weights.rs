//! A model's weights to and from files, for any [`ParamModule`] — tandem's models and stock
//! candle models wrapped by their `VarMap` ([`crate::NamedVars`]) alike. Files are PyTorch's
//! `.pt` (which `torch.load(weights_only=True)` opens) or safetensors, chosen by extension;
//! keys are the canonical names (never `module.`). Loading goes through tandem-ckpt's
//! `LoadReport`: any container (`state_dict`, `model`, bare, ...) and any wrapping (`module.`,
//! `_orig_mod.`, ...) is accepted; strict loading refuses a missing, unexpected or mis-shaped
//! key and lists all of them, non-strict loading applies what fits and returns the report.
use std::path::Path;

use candle_core::Device;
use tandem_ckpt::{LoadReport, Value};

use crate::convert::{ckpt_dtype, state_dict_from_ckpt, state_dict_to_ckpt};
use crate::error::Result;
use crate::module::ParamModule;

/// The model's state dict (parameters, then buffers) as a checkpoint value.
pub fn state_dict_value(model: &(impl ParamModule + ?Sized)) -> Result<Value> {
    let tensors = state_dict_to_ckpt(&model.named_tensors())?;
    Ok(Value::dict_from(tensors.into_iter().map(|(k, t)| (k, Value::Tensor(t)))))
}

/// Writes the model's weights: safetensors for a `.safetensors` path, else `.pt`.
pub fn save_weights(model: &(impl ParamModule + ?Sized), path: &Path) -> Result<()> {
    save_state_dict(&state_dict_value(model)?, path)
}

/// Writes a state dict already made (a [`state_dict_value`], a sharded model's gathered one):
/// safetensors for a `.safetensors` path, else `.pt`.
pub fn save_state_dict(value: &Value, path: &Path) -> Result<()> {
    if path.extension().is_some_and(|e| e == "safetensors") {
        tandem_ckpt::safetensors::save(path, value)?;
    } else {
        tandem_ckpt::save(path, value)?;
    }
    Ok(())
}

/// Loads weights from a PyTorch or tandem file into the model (see the module docs).
pub fn load_weights(
    model: &(impl ParamModule + ?Sized),
    path: &Path,
    strict: bool,
) -> Result<LoadReport> {
    let value = tandem_ckpt::load(path)?;
    load_weights_from(model, &value, strict)
}

/// As [`load_weights`], from a value already read (e.g. a training checkpoint's `model`).
pub fn load_weights_from(
    model: &(impl ParamModule + ?Sized),
    value: &Value,
    strict: bool,
) -> Result<LoadReport> {
    let targets: Vec<(String, Vec<usize>, tandem_ckpt::ElemType)> = model
        .named_parameters()
        .into_iter()
        .chain(model.named_buffers())
        .map(|(n, v)| (n, v.dims().to_vec(), ckpt_dtype(v.dtype())))
        .collect();
    let (tensors, report) = tandem_ckpt::load_state_dict(value, &targets, strict)?;
    let device = model.named_parameters().first().map_or(Device::Cpu, |(_, v)| v.device().clone());
    let state = state_dict_from_ckpt(&tensors, &device)?;
    if strict {
        model.load_named_tensors(state)?;
    } else {
        // Only the keys the report matched (shapes already checked there).
        let vars: Vec<_> =
            model.named_parameters().into_iter().chain(model.named_buffers()).collect();
        for (name, t) in state {
            if let Some((_, var)) = vars.iter().find(|(n, _)| *n == name) {
                var.set(&t.to_dtype(var.dtype())?)?;
            }
        }
        model.param_set().refresh_view();
    }
    Ok(report)
}
