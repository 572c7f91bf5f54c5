//! What the benchmarks that train through `tandem train` share (`live`, `save-stall`): the
//! face set they train on, written by tandem-data, and a run described by a typed
//! [`TrainConfig`], handed to `tandem train --config` as the file a person would write — never
//! as flag text.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use tandem::data::datasets::faces::{write_synthetic_faces, FaceFormat};
use tandem::models::ModelKind;
use tandem::recipes::options::DataSource;
use tandem::recipes::TrainConfig;

/// `DIR/faces`: `identities` of 8 JPEG faces (112x112) each and `pairs` verification pairs,
/// written once (later runs in `dir` reuse them).
pub fn face_set(dir: &Path, identities: usize, pairs: usize) -> anyhow::Result<PathBuf> {
    let faces = dir.join("faces");
    if !faces.join("train.rec").is_file() {
        write_synthetic_faces(&faces, identities, 8, 112, FaceFormat::Jpeg, pairs)
            .with_context(|| format!("writing the synthetic face set to {}", faces.display()))?;
    }
    Ok(faces)
}

/// The face recipe at the benchmarks' size, run in a directory holding [`face_set`]:
/// IResNet-18 of width 8 on `faces`, batch 4, a head of `classes` x `embedding`.
pub fn small_face(classes: usize, embedding: usize) -> TrainConfig {
    TrainConfig {
        model: ModelKind::IResNet18,
        width: 8,
        embedding_size: embedding,
        num_classes: Some(classes),
        data: DataSource::Rec("faces".into()),
        batch_size: 4,
        ..TrainConfig::default()
    }
}

/// `EXE train --config FILE`, with `cfg` written to `FILE` first.
pub fn train_command(exe: &Path, cfg: &TrainConfig, file: &Path) -> anyhow::Result<Command> {
    let text = toml::to_string_pretty(cfg).context("writing the run's settings as TOML")?;
    std::fs::write(file, text).with_context(|| format!("writing {}", file.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("train").arg("--config").arg(file);
    Ok(cmd)
}
