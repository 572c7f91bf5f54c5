//! `tandem export CHECKPOINT --model M FILE.onnx`: a built-in model's weights as an ONNX model
//! (eval mode) that onnxruntime and other ONNX tools run. `tandem train --export-onnx` writes
//! the same file at the end of training.
use std::path::{Path, PathBuf};

use anyhow::Context;
use tandem::models::ModelKind;

#[derive(clap::Args)]
pub struct Args {
    /// A tandem training checkpoint (a file, or a checkpoint directory such as the face
    /// recipe's `RUN/checkpoints/step-N`), a weights file (`--save-final`) or a PyTorch state
    /// dict (.pt or .safetensors; `module.` and other wrappers are fine).
    #[arg(value_parser = super::ckpt::checkpoint_path)]
    checkpoint: PathBuf,
    /// The architecture of the weights; layer sizes are read from them.
    #[arg(long, value_parser = tandem::recipes::options::choice::<ModelKind>())]
    model: ModelKind,
    /// The ONNX file to write.
    output: PathBuf,
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    // Checksums verified, as `tandem ckpt` reads (a directory put together whole).
    let value = super::ckpt::read(&args.checkpoint, false)
        .with_context(|| format!("reading {}", args.checkpoint.display()))?;
    let summary = write(args.model, &value, &args.output)
        .with_context(|| format!("exporting {}", args.checkpoint.display()))?;
    println!("{summary}");
    Ok(0)
}

/// Exports the state dict in `value` and writes it atomically to `path`; returns a one-line
/// summary (see [`tandem::onnx::export_to_file`]).
pub fn write(kind: ModelKind, value: &tandem::ckpt::Value, path: &Path) -> anyhow::Result<String> {
    Ok(tandem::onnx::export_to_file(kind, value, path)?)
}
