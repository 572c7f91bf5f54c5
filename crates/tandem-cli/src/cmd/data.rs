//! `tandem data`: dataset tools. `synth-faces DIR` writes a synthetic identity set in
//! insightface's layout (`train.rec`/`train.idx` and a `pairs.bin` verification set), so the
//! face-recognition recipe, its tests and its benchmark need no download; `pack DIR OUT` packs
//! a folder of your own identities into that layout, as mxnet's im2rec does; `synth-ijb DIR`
//! writes a small IJB-B/C set for `tandem eval ijb`.
use std::path::PathBuf;

use anyhow::{bail, Context};
use tandem::data::datasets::faces::{write_synthetic_faces, FaceFormat, FACE_SIDE};
use tandem::data::datasets::image_folder::{pack, ImageFolder};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Write a synthetic face identity set: DIR/train.rec, DIR/train.idx, DIR/pairs.bin.
    SynthFaces(SynthFaces),
    /// Pack a folder of identities (DIR/IDENTITY/IMAGE.jpg, 112x112 aligned faces) into
    /// OUT/train.rec, OUT/train.idx and OUT/train.lst, as mxnet's `im2rec --list --recursive`
    /// then `im2rec --pass-through` do (arcface_torch's prepare_custom_dataset.md).
    Pack(Pack),
    /// Write a small synthetic IJB-B/C set in insightface's layout (DIR/meta/*.txt,
    /// DIR/loose_crop/*.png) for `tandem eval ijb`.
    SynthIjb(SynthIjb),
}

#[derive(clap::Args)]
struct SynthIjb {
    /// The directory to write (created if missing).
    dir: PathBuf,
    /// IJBB or IJBC (names the meta files).
    #[arg(long, default_value = "IJBC", value_parser = ["IJBB", "IJBC"])]
    target: String,
    /// Identities, each with two templates (a genuine pair) and two impostor pairs.
    #[arg(long, default_value_t = 20)]
    identities: usize,
    /// Images per template (in two media).
    #[arg(long, default_value_t = 4)]
    per_template: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(clap::Args)]
struct Pack {
    /// The image folder: one sub-folder of images per identity.
    dir: PathBuf,
    /// The directory to write (created if missing).
    out: PathBuf,
    /// Refuse the first image that does not decode or is not 112x112, rather than skipping it.
    #[arg(long)]
    strict: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
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
        Command::SynthIjb(a) => {
            let w = tandem::data::datasets::ijb::write_synthetic_ijb(
                &a.dir,
                &a.target,
                a.identities,
                a.per_template,
                a.seed,
            )
            .with_context(|| format!("writing a synthetic IJB set to {}", a.dir.display()))?;
            println!(
                "wrote {} ({}): {} images in {} templates, {} template pairs",
                a.dir.display(),
                a.target,
                w.images,
                w.templates,
                w.pairs
            );
            Ok(0)
        }
        Command::Pack(a) => pack_folder(a),
    }
}

fn pack_folder(a: Pack) -> anyhow::Result<i32> {
    let folder =
        ImageFolder::list(&a.dir).with_context(|| format!("listing {}", a.dir.display()))?;
    let bar = indicatif::ProgressBar::new(folder.samples.len() as u64);
    if a.quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    } else {
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "packing {wide_bar} {pos}/{len} images ({per_sec}, {eta} left)",
            )
            .context("progress bar template")?,
        );
    }
    let mut show = |done: usize, _| bar.set_position(done as u64);
    let packed = pack(&folder, &a.out, FACE_SIDE, a.strict, &mut show);
    bar.finish_and_clear();
    let report =
        packed.with_context(|| format!("packing {} into {}", a.dir.display(), a.out.display()))?;
    println!(
        "wrote {}: {} images of {} identities (train.rec, train.idx, train.lst); train with \
         --data rec:{}",
        a.out.display(),
        report.images,
        report.classes,
        a.out.display()
    );
    if !report.skipped.is_empty() {
        eprintln!(
            "skipped {} image(s) that did not decode or are not {FACE_SIDE}x{FACE_SIDE}:",
            report.skipped.len()
        );
        for (path, why) in report.skipped.iter().take(10) {
            eprintln!("  {}: {why}", path.display());
        }
        if report.skipped.len() > 10 {
            eprintln!("  ... and {} more", report.skipped.len() - 10);
        }
    }
    if report.not_images > 0 {
        eprintln!("ignored {} file(s) that are not images by extension", report.not_images);
    }
    Ok(0)
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
    let (format, name) = match a.format {
        Format::Jpeg => (FaceFormat::Jpeg, "jpeg"),
        Format::Png => (FaceFormat::Png, "png"),
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
        name,
        w.pairs
    );
    Ok(0)
}
