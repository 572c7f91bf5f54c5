//! ONNX export of tandem's built-in models (MLP, Cnn, ResNet-18) from a state dict, written
//! with prost and ONNX's schema; no Python at run time. The file loads in onnxruntime and
//! gives PyTorch's eval-mode outputs for the same weights (checked in CI).
//!
//! ```no_run
//! let state = tandem_ckpt::load("checkpoint.pt")?;
//! let exported = tandem_onnx::export_value(tandem_onnx::ModelKind::Cnn, &state)?;
//! tandem_onnx::save("model.onnx", &exported)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
pub mod error;
pub mod graph;
pub mod models;
pub mod proto;
mod weights;

use std::path::Path;

use prost::Message;

pub use error::{OnnxError, Result};
pub use graph::Dim;
pub use models::{export, Exported};
pub use tandem_models::ModelKind;

/// Exports from a loaded checkpoint: a bare state dict or one under `model`, `state_dict`,
/// `module`, … (the first one found, as `tandem ckpt` finds them).
pub fn export_value(arch: ModelKind, value: &tandem_ckpt::Value) -> Result<Exported> {
    let mut found = tandem_ckpt::keys::find_state_dicts(value);
    // The face recipe's checkpoints of earlier builds hold the network under `backbone`.
    if let (true, Some(backbone)) = (found.is_empty(), value.get("backbone")) {
        found = tandem_ckpt::keys::find_state_dicts(backbone);
    }
    let Some((_, tensors)) = found.into_iter().next() else {
        return Err(OnnxError::MissingKey {
            model: arch.name(),
            key: "(a state dict)".into(),
            present: "no dict of tensors at the top level or under \
                      model/state_dict/module/backbone"
                .into(),
        });
    };
    export(arch, &tensors)
}

/// The serialized model (the bytes of a `.onnx` file).
pub fn to_bytes(exported: &Exported) -> Vec<u8> {
    exported.model.encode_to_vec()
}

/// Writes the model to `path` atomically (temp file, fsync, rename).
pub fn save(path: impl AsRef<Path>, exported: &Exported) -> Result<()> {
    let bytes = to_bytes(exported);
    tandem_ckpt::atomic::write_atomic(path.as_ref(), |f| {
        use std::io::Write;
        f.write_all(&bytes)
    })?;
    Ok(())
}

/// Exports the state dict in `value` as `arch` and writes it atomically to `path`; returns a
/// one-line summary such as `wrote m.onnx: cnn, input [batch, 1, 8, 8] -> logits [batch, 10],
/// 1930 weights, ONNX IR 8 opset 17`.
pub fn export_to_file(arch: ModelKind, value: &tandem_ckpt::Value, path: &Path) -> Result<String> {
    let exported = export_value(arch, value)?;
    save(path, &exported)?;
    let dims: Vec<String> = exported
        .input
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => n.to_string(),
            Dim::Named(s) => s.to_string(),
        })
        .collect();
    Ok(format!(
        "wrote {}: {}, input [{}] -> {} [batch, {}], {} weights, ONNX IR {} opset {}",
        path.display(),
        arch.name(),
        dims.join(", "),
        exported.output,
        exported.classes,
        exported.weights,
        graph::IR_VERSION,
        graph::OPSET,
    ))
}

/// A state dict read from a file: `(key, tensor)` in the file's order.
pub type StateDict = Vec<(String, tandem_ckpt::TensorData)>;

/// The weights of an ONNX model: the architecture its `tandem.model` metadata names (files
/// tandem wrote; `None` for others) and its float initializers as a state dict — their names
/// are the state-dict keys, as tandem and `torch.onnx.export` write them. Only raw float32
/// data is read (what both write).
pub fn read_weights(path: impl AsRef<Path>) -> Result<(Option<String>, StateDict)> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let bad = |reason: String| OnnxError::Read { path: shown.clone(), reason };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let model = proto::ModelProto::decode(bytes.as_slice())
        .map_err(|e| bad(format!("not an ONNX model: {e}")))?;
    let arch =
        model.metadata_props.iter().find(|p| p.key == "tandem.model").map(|p| p.value.clone());
    let graph = model.graph.ok_or_else(|| bad("the model has no graph".into()))?;
    let mut out = Vec::with_capacity(graph.initializer.len());
    for t in graph.initializer {
        if t.data_type != proto::FLOAT {
            continue;
        }
        let shape: Vec<usize> = t.dims.iter().map(|&d| d.max(0) as usize).collect();
        let numel: usize = shape.iter().product();
        if t.raw_data.len() != numel * 4 {
            return Err(bad(format!(
                "initializer {}: {} bytes of raw data for shape {shape:?} (only raw float32 is read)",
                t.name,
                t.raw_data.len()
            )));
        }
        out.push((
            t.name,
            tandem_ckpt::TensorData::from_bytes(tandem_ckpt::ElemType::F32, &shape, t.raw_data),
        ));
    }
    Ok((arch, out))
}
