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
    // The face recipe's checkpoints hold the network under `backbone`.
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
