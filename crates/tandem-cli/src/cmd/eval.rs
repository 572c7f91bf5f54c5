//! `tandem eval ijb DIR --target IJBC --model WEIGHTS --network NAME`: insightface's
//! `eval_ijbc.py` — IJB-B/C 1:1 verification of a face backbone. Every image of
//! `DIR/meta/{target}_name_5pts_score.txt` is aligned to the arcface template from its five
//! landmarks, embedded with its mirror image (eval mode), and scored as the script scores it
//! (flip sum, detector-score weighting, media-then-template pooling, cosine per template
//! pair); prints TAR at FAR 1e-6 … 1e-1 and writes `OUT/{target}.npy` (the pair scores),
//! `OUT/{target}_roc.svg` and `OUT/{target}_tar_far.json`. Under `tandem run` the images are
//! split over the ranks and rank 0 scores.
use std::path::PathBuf;

use anyhow::{bail, Context};
use tandem::data::datasets::ijb::IjbSet;
use tandem::models::ModelKind;
use tandem::recipes::face_eval::ijb;

use super::embed::{Embedder, Runtime};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// IJB-B/C 1:1 verification (insightface's eval_ijbc.py): TAR at FAR 1e-6 .. 1e-1.
    Ijb(Ijb),
}

#[derive(clap::Args)]
struct Ijb {
    /// The IJB folder: meta/ and loose_crop/.
    dir: PathBuf,
    /// IJBB or IJBC.
    #[arg(long, default_value = "IJBC", value_parser = ["IJBB", "IJBC"])]
    target: String,
    /// The backbone's weights: a state dict (arcface_torch's model.pt), a training checkpoint
    /// or its directory, or an ONNX model `tandem export` wrote; with `--runtime onnxruntime`
    /// any ONNX face model.
    #[arg(long)]
    model: PathBuf,
    /// The backbone (r18 .. r200, mbf, vit_t, ...); read from a tandem ONNX file's metadata
    /// when not given.
    #[arg(long, value_parser = tandem::recipes::options::choice::<ModelKind>())]
    network: Option<ModelKind>,
    /// What runs the model: tandem's own backbone with the file's weights, or ONNX Runtime
    /// running the ONNX graph as written (found at run time: ORT_DYLIB_PATH or pip's
    /// onnxruntime).
    #[arg(long, value_enum, default_value_t = Runtime::Tandem)]
    runtime: Runtime,
    /// Images per forward pass (each with its mirror).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Where the scores, the ROC plot and the table go.
    #[arg(long, default_value = "ijb_results")]
    out: PathBuf,
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    match args.command {
        Command::Ijb(a) => ijb_main(a),
    }
}

fn ijb_main(a: Ijb) -> anyhow::Result<i32> {
    if a.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if let Some(network) = a.network.filter(|n| !n.is_face()) {
        bail!("--network {network}: IJB evaluates a face backbone (r50, mbf, vit_t, ...)");
    }
    let set = IjbSet::open(&a.dir, &a.target)?;
    // The name in the table and the plot: the network, or for a graph run as written, the
    // network if named, else the file's stem.
    let (label, mut model) = Embedder::open(a.runtime, a.network, &a.model, "--network")?;
    // Under a launcher the ranks split the images (round robin) and rank 0 scores.
    let group = match std::env::var("WORLD_SIZE") {
        Ok(w) if w.trim() != "1" => Some(tandem::init().context("joining the job's ranks")?),
        _ => None,
    };
    let mut embed = |x: Vec<f32>, n: usize| {
        model.embed(x, n).map_err(|e| tandem::train::TrainError::invalid(format!("{e:#}")))
    };
    let Some(found) = ijb::evaluate(&set, &mut embed, a.batch_size, group.as_ref())? else {
        return Ok(0);
    };
    found.write(&a.out, &a.target, &label)?;
    print!("{}", ijb::table(&label, &a.target, &found.tars));
    let (images, templates, pairs) = (found.images, found.templates, found.scores.len());
    let out = a.out.display();
    println!(
        "{images} images, {templates} templates, {pairs} pairs; scores, ROC and table in {out}"
    );
    Ok(0)
}
