//! A face backbone from a file of weights, whatever wrote it: a state dict (arcface_torch's
//! `model.pt`, `--save-final`), a training checkpoint or its directory, or the initializers of
//! an ONNX graph `tandem export` wrote; the network's sizes are read from the weights.
use std::path::Path;

use candle_core::{DType, Device};
use tandem_models::{FaceBackbone, ModelKind};
use tandem_nn::{OrderedVarMap, ParamModule};
use tandem_train::checkpoint::Saved;
use tandem_train::{bail, bail_option, Context, Result};

/// The backbone with the weights at `path` (a state dict, a training checkpoint or its
/// directory, or an ONNX model's initializers), its sizes read from them; `kind`, or when
/// `None` the network a tandem ONNX file names in its metadata (the file is read once).
pub fn load_backbone(kind: Option<ModelKind>, path: &Path) -> Result<(ModelKind, FaceBackbone)> {
    let shown = path.display();
    let is_onnx = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx"));
    let (arch, value) = if path.is_dir() {
        (None, Saved::open(path)?.consolidated()?)
    } else if is_onnx {
        let (arch, tensors) =
            tandem_onnx::read_weights(path).with_context(|| format!("reading {shown}"))?;
        let dict = tensors
            .into_iter()
            .map(|(k, mut t)| {
                // The export stores PReLU slopes as [C, 1, 1] to broadcast over the planes.
                if t.shape.len() == 3 && t.shape[1..] == [1, 1] {
                    t = tandem_ckpt::TensorData::from_storage(t.dtype, &t.shape[..1], t.storage);
                }
                (tandem_ckpt::Value::Str(k), tandem_ckpt::Value::Tensor(t))
            })
            .collect();
        (arch, tandem_ckpt::Value::Dict(dict))
    } else {
        (None, tandem_ckpt::load(path).with_context(|| format!("reading {shown}"))?)
    };
    let kind = match (kind, arch) {
        (Some(kind), _) => kind,
        (None, Some(arch)) => {
            arch.parse::<ModelKind>().with_context(|| format!("{shown}: tandem.model"))?
        }
        (None, None) if is_onnx => {
            bail_option!("model", None, "{shown} has no tandem.model metadata: name the network")
        }
        (None, None) => {
            bail_option!(
                "model",
                None,
                "needed for {shown} (only a tandem ONNX file names its network)"
            )
        }
    };
    // A face checkpoint holds the network under `model` (found below), or under `backbone`
    // when an earlier build wrote it.
    let value = value.get("backbone").cloned().unwrap_or(value);
    let found = tandem_ckpt::keys::find_state_dicts(&value);
    let Some((_, tensors)) = found.first() else {
        bail!("{shown}: no state dict (a dict of tensors, bare or under model/state_dict/module)")
    };
    let dim = |suffix: &str| {
        tensors
            .iter()
            .find(|(k, _)| k.ends_with(suffix))
            .and_then(|(_, t)| t.shape.first())
            .copied()
    };
    let width = match kind.iresnet_depth() {
        Some(_) => dim("conv1.weight")
            .with_context(|| format!("{shown}: no conv1.weight (an IResNet's stem)"))?,
        None => 64,
    };
    let embedding = dim("fc.weight")
        .filter(|_| kind.iresnet_depth().is_some())
        .or_else(|| dim("features.layers.2.weight"))
        .or_else(|| dim("feature.2.weight").filter(|_| kind.vit().is_some()))
        .with_context(|| {
            format!(
                "{shown}: no embedding layer of a {kind} (fc.weight, features.layers.2.weight \
                 or feature.2.weight)"
            )
        })?;
    let vars = OrderedVarMap::new();
    let model =
        FaceBackbone::new(kind, width, embedding, 0.0, vars.var_builder(DType::F32, &Device::Cpu))?;
    let named = vars.named_vars().freeze(FaceBackbone::frozen(kind))?;
    let value = if is_onnx { with_training_only_keys(value, &vars)? } else { value };
    named.load_state_dict(&value).with_context(|| {
        format!("{shown}: the weights of a {kind} (width {width}, {embedding}-d)")
    })?;
    Ok((kind, model))
}

/// An exported inference graph leaves out what only training reads (BatchNorm's
/// `num_batches_tracked`, a ViT's `mask_token`): those keys come from the freshly built model,
/// so the strict load still checks every weight the graph holds.
fn with_training_only_keys(
    value: tandem_ckpt::Value,
    vars: &OrderedVarMap,
) -> Result<tandem_ckpt::Value> {
    let tandem_ckpt::Value::Dict(mut items) = value else { return Ok(value) };
    let has = |items: &[(tandem_ckpt::Value, tandem_ckpt::Value)], key: &str| {
        items.iter().any(|(k, _)| matches!(k, tandem_ckpt::Value::Str(s) if s == key))
    };
    for (name, var) in vars.named() {
        let training_only = name.ends_with("num_batches_tracked") || name == "mask_token";
        if training_only && !has(&items, &name) {
            let t = tandem_nn::convert::to_ckpt(var.as_tensor())?;
            items.push((tandem_ckpt::Value::Str(name), tandem_ckpt::Value::Tensor(t)));
        }
    }
    Ok(tandem_ckpt::Value::Dict(items))
}
