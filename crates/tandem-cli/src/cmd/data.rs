//! `tandem data`: dataset tools. `synth-faces DIR` writes a synthetic identity set in
//! insightface's layout (`train.rec`/`train.idx` and a `pairs.bin` verification set), so the
//! face-recognition recipe, its tests and its benchmark need no download.
use std::path::PathBuf;

use anyhow::{bail, Context};
use tandem_data::datasets::faces::{write_synthetic_faces, FaceFormat};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Write a synthetic face identity set: DIR/train.rec, DIR/train.idx, DIR/pairs.bin.
    SynthFaces(SynthFaces),
}

#[derive(clap::Args)]
struct SynthFaces {
    /// The directory to write (created if missing).
    dir: PathBuf,
    /// Identities (classes).
    #[arg(long)]
    classes: usize,
    /// Images per identity.
    #[arg(long)]
    per_class: usize,
    /// Image side in pixels (arcface_torch's backbones take 112).
    #[arg(long, default_value_t = 112)]
    size: usize,
    /// Image encoding.
    #[arg(long, value_enum, default_value_t = Format::Jpeg)]
    format: Format,
    /// Verification pairs in pairs.bin (half of them same-identity), from images the training
    /// set does not hold.
    #[arg(long, default_value_t = 200)]
    pairs: usize,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Jpeg,
    Png,
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    match args.command {
        Command::SynthFaces(a) => synth_faces(a),
    }
}

fn synth_faces(a: SynthFaces) -> anyhow::Result<i32> {
    if a.classes < 2 {
        bail!("--classes {}: a face set needs at least 2 identities", a.classes);
    }
    if a.per_class == 0 {
        bail!("--per-class 0: every identity needs at least one image");
    }
    if a.size < 8 {
        bail!("--size {}: images need at least 8 pixels a side", a.size);
    }
    let format = match a.format {
        Format::Jpeg => FaceFormat::Jpeg,
        Format::Png => FaceFormat::Png,
    };
    let w = write_synthetic_faces(&a.dir, a.classes, a.per_class, a.size, format, a.pairs)
        .with_context(|| format!("writing synthetic faces to {}", a.dir.display()))?;
    println!(
        "wrote {}: {} images of {} identities ({}x{}, {}), {} verification pairs in pairs.bin",
        a.dir.display(),
        w.images,
        w.classes,
        a.size,
        a.size,
        match format {
            FaceFormat::Jpeg => "jpeg",
            FaceFormat::Png => "png",
        },
        w.pairs
    );
    Ok(0)
}
