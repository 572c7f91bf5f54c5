//! `tandem bench loader`: how fast the face recipe's input pipeline decodes batches — JPEG
//! decode, flip, float conversion and collation of insightface RecordIO images at 112x112 — as
//! the decode threads (`tandem train --num-workers`) grow, against PyTorch's `DataLoader` with
//! as many worker processes over the same files (arcface_torch's MXFaceDataset decode, from
//! `scripts/peers/torch_loader.py`). On the CPU: what a GPU step can be fed. Images/s of the
//! best of `--repeats` passes of `--batches` batches per worker count.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::Device;
use tandem::data::datasets::faces::{write_synthetic_faces, FaceFormat, FaceRecDataset};
use tandem::data::{DataLoader, Dataset, DistributedSampler, LoaderOptions};

#[derive(clap::Args)]
pub struct Args {
    /// Identities in the synthetic set (8 JPEG images each).
    #[arg(long, default_value_t = 128)]
    identities: usize,
    /// Images per batch.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Batches per timed pass.
    #[arg(long, default_value_t = 8)]
    batches: usize,
    /// Timed passes per worker count (the best is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Worker counts to time, comma-separated (0: decode on the consuming thread).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4")]
    workers: Vec<usize>,
    /// Directory for the data (default: a fresh one, removed after).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// A Python with torch: also time PyTorch's DataLoader.
    #[arg(long)]
    torch: Option<PathBuf>,
}

/// Images/s of the best pass: `batches` batches from a loader with `workers` threads.
fn tandem_rate(data: &Arc<FaceRecDataset>, a: &Args, workers: usize) -> anyhow::Result<f64> {
    let sampler = DistributedSampler::builder(data.len()).num_replicas(1).rank(0).build()?;
    let options = LoaderOptions {
        batch_size: a.batch,
        drop_last: true,
        num_workers: workers,
        prefetch_factor: 2,
    };
    let mut loader = DataLoader::new(Arc::clone(data), sampler, options, Device::Cpu)?;
    let mut best = 0f64;
    let mut epoch = 0;
    for _ in 0..a.repeats.max(1) {
        let clock = Instant::now();
        let mut images = 0usize;
        // Passes span epochs when an epoch holds fewer batches than a pass takes.
        while images < a.batches * a.batch {
            loader.set_epoch(epoch);
            epoch += 1;
            for batch in loader.iter()? {
                images += batch?.len();
                if images >= a.batches * a.batch {
                    break;
                }
            }
        }
        best = best.max(images as f64 / clock.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn torch_rates(python: &Path, faces: &Path, a: &Args) -> anyhow::Result<Vec<(usize, f64)>> {
    let script = crate::report::repo_root().join(crate::PEERS_DIR).join("torch_loader.py");
    let workers: Vec<String> = a.workers.iter().map(usize::to_string).collect();
    let out = Command::new(python)
        .arg(&script)
        .arg(faces)
        .args([a.batch, a.batches, a.repeats].map(|v| v.to_string()))
        .arg(workers.join(","))
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "{} failed ({}): {text}{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    /// One worker count's rate (the peer's `RESULT {json}` lines).
    #[derive(serde::Deserialize)]
    struct Rate {
        workers: usize,
        images_per_s: f64,
    }
    let rates: Vec<Rate> = crate::local_ranks::results(&text, &script.display().to_string())?;
    Ok(rates.into_iter().map(|r| (r.workers, r.images_per_s)).collect())
}

pub fn main(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(
        a.batch > 0 && a.batches > 0 && a.identities >= 2,
        "--batch and --batches must be at least 1, --identities at least 2"
    );
    crate::in_scratch_dir(a.dir.as_deref(), "bench-loader", |dir| {
        let faces = dir.join("faces");
        if !faces.join("train.rec").is_file() {
            write_synthetic_faces(&faces, a.identities, 8, 112, FaceFormat::Jpeg, 20)?;
        }
        let data = Arc::new(FaceRecDataset::open(&faces)?.with_flip(0));
        let torch = a.torch.as_ref().map(|p| torch_rates(p, &faces, &a)).transpose()?;
        println!(
            "face loader: {} JPEG images at 112x112 ({} identities), batch {}, {} batches per pass, best of {}; {} cores",
            data.len(),
            a.identities,
            a.batch,
            a.batches,
            a.repeats,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        println!("| workers | tandem images/s | PyTorch images/s | x PyTorch |\n|--:|--:|--:|--:|");
        for &w in &a.workers {
            let ours = tandem_rate(&data, &a, w)?;
            let theirs =
                torch.as_ref().and_then(|t| t.iter().find(|(tw, _)| *tw == w)).map(|t| t.1);
            let cell = theirs.map_or("–".into(), |t| format!("{t:.0}"));
            let ratio = theirs.map_or("–".into(), |t| format!("{:.2}", ours / t));
            println!("| {w} | {ours:.0} | {cell} | {ratio} |");
        }
        Ok(0)
    })
}
