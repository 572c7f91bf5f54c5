//! Sampler and loader throughput, printed as ratios against references measured in the same run:
//! PyTorch's `DistributedSampler` / `DataLoader` (when a Python with torch is found) and the
//! loader without workers.
//!
//!     cargo bench -p tandem-data --bench sampler            # release profile
//!     cargo bench -p tandem-data --bench sampler --profile dev   # reuses the test build
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use tandem_data::{
    datasets, DataError, DataLoader, Dataset, DistributedSampler, Example, InMemoryDataset,
    LoaderOptions,
};

/// A dataset whose `get` costs ~`SLOW_GET` of CPU (decoding, augmentation): where workers pay off.
struct Slow(Arc<InMemoryDataset>);
const SLOW_GET: Duration = Duration::from_micros(50);

impl Dataset for Slow {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn input_dim(&self) -> usize {
        self.0.input_dim()
    }
    fn num_classes(&self) -> usize {
        self.0.num_classes()
    }
    fn get(&self, index: usize) -> Result<Example, DataError> {
        let t = Instant::now();
        while t.elapsed() < SLOW_GET {
            std::hint::spin_loop();
        }
        self.0.get(index)
    }
}

const SAMPLER_LEN: usize = 1_000_000;
const SAMPLER_RANKS: usize = 8;
const LOADER_LEN: usize = 20_000;
const LOADER_DIM: usize = 64;
const LOADER_BATCH: usize = 64;
const LOADER_EPOCHS: u64 = 5;

/// Best of `reps` runs.
fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn torch_times() -> Option<(f64, f64)> {
    let python = std::env::var_os("TANDEM_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tandem_testutil::workspace_root().join(".venv-torch/bin/python"));
    let script = format!(
        r#"
import time, torch
from torch.utils.data import DistributedSampler, DataLoader, TensorDataset
def best(f, reps=3):
    out = []
    for _ in range(reps):
        t = time.perf_counter(); f(); out.append(time.perf_counter() - t)
    return min(out)
def sampler():
    for rank in range({ranks}):
        s = DistributedSampler(range({n}), num_replicas={ranks}, rank=rank, shuffle=True, seed=0)
        s.set_epoch(3)
        list(iter(s))
ds = TensorDataset(torch.randn({ln}, {dim}), torch.randint(0, 10, ({ln},)))
def loader():
    s = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size={batch}, sampler=s, num_workers=0)
    for e in range({epochs}):
        s.set_epoch(e)
        for x, y in dl:
            pass
print(best(sampler), best(loader, 1))
"#,
        ranks = SAMPLER_RANKS,
        n = SAMPLER_LEN,
        ln = LOADER_LEN,
        dim = LOADER_DIM,
        batch = LOADER_BATCH,
        epochs = LOADER_EPOCHS
    );
    let out = Command::new(python).args(["-c", &script]).output().ok()?;
    if !out.status.success() {
        eprintln!("torch reference failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().filter_map(|v| v.parse::<f64>().ok());
    Some((it.next()?, it.next()?))
}

fn main() {
    let sampler_time = best_of(3, || {
        for rank in 0..SAMPLER_RANKS {
            let mut s =
                DistributedSampler::new(SAMPLER_LEN, SAMPLER_RANKS, rank, true, 0, false).unwrap();
            s.set_epoch(3);
            std::hint::black_box(s.indices());
        }
    });

    let ds = Arc::new(datasets::synthetic(LOADER_LEN, LOADER_DIM, 10, 0).unwrap());
    let loader_time = |workers: usize| {
        let sampler = DistributedSampler::new(LOADER_LEN, 1, 0, true, 0, false).unwrap();
        let options = LoaderOptions {
            batch_size: LOADER_BATCH,
            drop_last: false,
            num_workers: workers,
            prefetch_factor: 2,
        };
        let mut loader = DataLoader::new(ds.clone(), sampler, options, Device::Cpu).unwrap();
        best_of(1, || {
            for e in 0..LOADER_EPOCHS {
                loader.set_epoch(e);
                for b in loader.iter().unwrap() {
                    std::hint::black_box(b.unwrap());
                }
            }
        })
    };
    let l0 = loader_time(0);
    let l2 = loader_time(2);
    let slow = Arc::new(Slow(Arc::new(datasets::synthetic(4000, LOADER_DIM, 10, 0).unwrap())));
    let slow_time = |workers: usize| {
        let sampler = DistributedSampler::new(slow.len(), 1, 0, true, 0, false).unwrap();
        let options = LoaderOptions {
            batch_size: LOADER_BATCH,
            drop_last: false,
            num_workers: workers,
            prefetch_factor: 2,
        };
        let loader = DataLoader::new(slow.clone(), sampler, options, Device::Cpu).unwrap();
        best_of(1, || {
            for b in loader.iter().unwrap() {
                std::hint::black_box(b.unwrap());
            }
        })
    };
    let (s0, s2) = (slow_time(0), slow_time(2));

    println!("sampler: {SAMPLER_RANKS} ranks x DistributedSampler({SAMPLER_LEN}, shuffle) indices: tandem {:.1} ms", sampler_time.as_secs_f64() * 1e3);
    println!(
        "loader: {LOADER_EPOCHS} epochs of {LOADER_LEN}x{LOADER_DIM} f32, batch {LOADER_BATCH}: tandem 0 workers {:.1} ms, 2 workers {:.1} ms (2 workers / 0 workers = {:.2}x time)",
        l0.as_secs_f64() * 1e3,
        l2.as_secs_f64() * 1e3,
        l2.as_secs_f64() / l0.as_secs_f64()
    );
    println!(
        "loader, 4000 examples with a {SLOW_GET:?} get: 0 workers {:.1} ms, 2 workers {:.1} ms (2 workers / 0 workers = {:.2}x time, {} cores)",
        s0.as_secs_f64() * 1e3,
        s2.as_secs_f64() * 1e3,
        s2.as_secs_f64() / s0.as_secs_f64(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    match torch_times() {
        Some((ts, tl)) => {
            println!(
                "torch reference: sampler {:.1} ms, DataLoader(num_workers=0) {:.1} ms",
                ts * 1e3,
                tl * 1e3
            );
            println!(
                "speedup vs torch: sampler {:.1}x, loader (0 workers) {:.1}x",
                ts / sampler_time.as_secs_f64(),
                tl / l0.as_secs_f64()
            );
        }
        None => println!("torch reference: skipped (no Python with torch)"),
    }
}
