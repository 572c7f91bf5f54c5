//! `tandem embed WEIGHTS INPUT... --model NAME --out OUT.npy`: arcface_torch's `inference.py`
//! for many images at once: a face backbone's embeddings (eval mode) of image files, of
//! folders of them (walked in sorted order) or of every image of a RecordIO set (`rec:DIR`),
//! written as a float32 `.npy` of shape `[N, E]` (numpy's format, version 1.0) and
//! `OUT.txt`, one line per row naming its source. Images that are not 112x112 are resized
//! first, as inference.py does (bilinear; its OpenCV rounds a little differently).
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use candle_core::{DType, Device, Tensor};
use tandem::data::datasets::faces::{decode_face_resized, FaceRecDataset, FACE_SIDE};
use tandem::data::datasets::image_folder::files_under;
use tandem::data::Dataset;
use tandem::models::{FaceBackbone, ModelKind};
use tandem::train::TrainError;

#[derive(clap::Args)]
pub struct Args {
    /// The backbone's weights: a state dict (arcface_torch's model.pt, `--save-final`), a
    /// training checkpoint or a checkpoint directory (`RUN/checkpoints/step-N`), an ONNX file
    /// `tandem export` wrote; with `--runtime onnxruntime` any ONNX face model.
    weights: PathBuf,
    /// Image files, folders of images, or rec:DIR (every image of DIR/train.rec).
    #[arg(required = true)]
    inputs: Vec<String>,
    /// The backbone (r18 .. r200, iresnet18 .. iresnet200, mbf, mbf_large, vit_t ..); sizes are read
    /// from the weights. Not needed for a tandem ONNX file (it names its network) or with
    /// `--runtime onnxruntime`.
    #[arg(long, value_parser = tandem::recipes::options::choice::<ModelKind>())]
    model: Option<ModelKind>,
    /// What runs the model: tandem's own backbone with the file's weights, or ONNX Runtime
    /// running an ONNX graph as written (found at run time: ORT_DYLIB_PATH or pip's
    /// onnxruntime).
    #[arg(long, value_enum, default_value_t = Runtime::Tandem)]
    runtime: Runtime,
    /// The `.npy` file to write (`OUT.txt` beside it names each row's image).
    #[arg(long, short)]
    out: PathBuf,
    /// Images per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

/// What runs the model (`--runtime`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Runtime {
    /// tandem's own backbone, with the file's weights.
    Tandem,
    /// ONNX Runtime, running the ONNX graph as written (any ONNX face model).
    Onnxruntime,
}

/// What embeds the images: tandem's backbone, or an ONNX graph in ONNX Runtime.
pub(crate) enum Embedder {
    Tandem(Box<FaceBackbone>),
    Ort(super::onnxruntime::OrtEmbedder),
}

impl Embedder {
    /// The model at `path` run by `runtime`, and the name its results go by: the network, or
    /// for a graph run as written the network if named, else the file's stem. `flag` is the
    /// command's flag that names the network (for its errors).
    pub(crate) fn open(
        runtime: Runtime,
        network: Option<ModelKind>,
        path: &Path,
        flag: &str,
    ) -> anyhow::Result<(String, Embedder)> {
        Ok(match runtime {
            Runtime::Tandem => {
                // The library names the network's option `model`; this command's flag is `flag`.
                let (network, model) = tandem::recipes::face::load_backbone(network, path)
                    .map_err(|e| match e {
                        TrainError::Option { .. } => {
                            anyhow!(e.naming_option(|k| (k == "model").then(|| flag.into())))
                        }
                        e => e.into(),
                    })?;
                (network.name().to_string(), Embedder::Tandem(Box::new(model)))
            }
            Runtime::Onnxruntime => {
                let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
                let label = network.map(|n| n.name().to_string()).or(stem).unwrap_or_default();
                (label, Embedder::Ort(super::onnxruntime::OrtEmbedder::open(path)?))
            }
        })
    }

    /// The embeddings of `n` faces `x` (`[n, 3, 112, 112]`): `n` rows, and their width.
    pub(crate) fn embed(&mut self, x: Vec<f32>, n: usize) -> anyhow::Result<(Vec<f32>, usize)> {
        match self {
            Embedder::Tandem(model) => {
                let x = Tensor::from_vec(x, (n, 3, FACE_SIDE, FACE_SIDE), &Device::Cpu)?;
                let e = tandem::nn::no_grad(|| model.forward_t(&x, false))?.to_dtype(DType::F32)?;
                Ok((e.flatten_all()?.to_vec1::<f32>()?, e.dim(1)?))
            }
            Embedder::Ort(session) => session.embed(x, n, FACE_SIDE),
        }
    }
}

/// Where one row's image comes from.
enum Source {
    File(PathBuf),
    Rec { dataset: std::sync::Arc<FaceRecDataset>, dir: String, index: usize },
}

impl Source {
    fn name(&self) -> String {
        match self {
            Source::File(p) => p.display().to_string(),
            Source::Rec { dir, index, .. } => format!("rec:{dir}#{index}"),
        }
    }

    fn pixels(&self) -> anyhow::Result<Vec<f32>> {
        match self {
            Source::File(p) => {
                let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
                decode_face_resized(&bytes, FACE_SIDE)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
            }
            Source::Rec { dataset, index, .. } => Ok(dataset.get(*index)?.features),
        }
    }
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if let Some(model) = args.model.filter(|m| !m.is_face()) {
        bail!("--model {model}: embeddings come from a face backbone (r50, mbf, ...)");
    }
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let sources = list_sources(&args.inputs)?;
    if sources.is_empty() {
        bail!("no images in {}", args.inputs.join(" "));
    }
    let (label, mut model) = Embedder::open(args.runtime, args.model, &args.weights, "--model")?;
    let mut rows: Vec<f32> = Vec::new();
    let mut width = 0;
    for chunk in sources.chunks(args.batch_size) {
        let mut x = Vec::with_capacity(chunk.len() * 3 * FACE_SIDE * FACE_SIDE);
        for s in chunk {
            x.extend(s.pixels()?);
        }
        let (e, w) = model.embed(x, chunk.len())?;
        width = w;
        rows.extend(e);
    }
    tandem::ckpt::npy::write_f32_matrix(&args.out, &rows, (sources.len(), width))?;
    let names: String = sources.iter().map(|s| s.name() + "\n").collect();
    let list = args.out.with_extension("txt");
    std::fs::write(&list, names).with_context(|| format!("writing {}", list.display()))?;
    println!(
        "wrote {}: {} embeddings of {width} ({label}), sources in {}",
        args.out.display(),
        sources.len(),
        list.display()
    );
    Ok(0)
}

/// Every input as rows: a file, a folder's JPEG/PNG files (sorted, at any depth), or a rec.
fn list_sources(inputs: &[String]) -> anyhow::Result<Vec<Source>> {
    let mut out = Vec::new();
    for input in inputs {
        if let Some(dir) = input.strip_prefix("rec:") {
            let dataset = std::sync::Arc::new(
                FaceRecDataset::open(Path::new(dir)).with_context(|| input.clone())?,
            );
            for index in 0..dataset.len() {
                out.push(Source::Rec { dataset: dataset.clone(), dir: dir.to_string(), index });
            }
            continue;
        }
        let path = PathBuf::from(input);
        if path.is_dir() {
            let mut files: Vec<PathBuf> = files_under(&path)?
                .into_iter()
                .filter(|f| {
                    let ext = f.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
                    ext.is_some_and(|e| ["jpg", "jpeg", "png"].contains(&e.as_str()))
                })
                .collect();
            files.sort();
            out.extend(files.into_iter().map(Source::File));
        } else if path.is_file() {
            out.push(Source::File(path));
        } else {
            bail!("{input}: no such file or folder (images, folders of them, or rec:DIR)");
        }
    }
    Ok(out)
}
