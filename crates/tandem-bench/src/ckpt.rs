//! `tandem bench ckpt`: save and load throughput of a state dict of `--size-mib` MiB for tandem
//! (.pt and safetensors) beside `dd conv=fsync` of the same size and, when a Python with torch is
//! found, `torch.save` (+ fsync, as tandem's save syncs), `torch.load(mmap=True)` and a plain
//! `torch.load` (every byte read), all measured in this run in the same directory. Prints min and
//! median over `--repeat` runs and the ratios the targets are stated in. The page cache is not
//! dropped: loads right after saves are warm for every contender alike.
//!
//! A full read (`.pt (read)`) copies the file into memory the process has not used yet, so it
//! pays for the kernel zeroing — and, in a virtual machine that hands idle memory back to its
//! host (virtio-balloon free page reporting), the host backing — every new page. `fresh memory
//! (first touch)` measures that cost alone: writing every byte of a new buffer of the same size,
//! kept alive during the full read so the read cannot reuse its pages. `.pt (read, memory
//! reused)` is a second full read right after the first, into the pages the first freed: the
//! read's own speed once the memory is there.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use tandem::ckpt::{TensorData, Value};

#[derive(clap::Args)]
pub struct Args {
    /// Total tensor bytes, in MiB.
    #[arg(long, default_value_t = 512)]
    size_mib: usize,
    /// Tensors the size is split into.
    #[arg(long, default_value_t = 32)]
    tensors: usize,
    /// Repetitions (min and median are reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Directory for the files (default: a fresh directory under the current one, removed after).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Python with torch (default: $TANDEM_PYTHON, ./.venv-torch/bin/python, python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Which writer goes first in the first run (0 dd, 1 .pt, 2 safetensors); later runs rotate.
    /// The report runs one repetition per process and passes its run index.
    #[arg(long, default_value_t = 0, hide = true)]
    first_writer: usize,
    /// One JSON line per row ([`CkptRow`]) instead of the table.
    #[arg(long)]
    json: bool,
}

/// One row of `tandem bench ckpt --json`: a writer or reader and its throughput, MiB/s.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CkptRow {
    pub name: String,
    pub min_mib_s: f64,
    pub median_mib_s: f64,
}

pub(crate) fn find_python(explicit: Option<PathBuf>) -> Option<PathBuf> {
    let mut c = Vec::new();
    c.extend(explicit);
    c.extend(std::env::var_os("TANDEM_PYTHON").map(PathBuf::from));
    c.push(PathBuf::from(".venv-torch/bin/python"));
    c.push(PathBuf::from("python3"));
    c.into_iter().find(|p| {
        Command::new(p).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success())
    })
}

fn state_dict(total: usize, n: usize) -> Value {
    let per = (total / n / 4).max(1);
    let mut x: u32 = 0x1234_5678;
    let items = (0..n)
        .map(|i| {
            let data: Vec<f32> = (0..per)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x as f32) * 1e-9
                })
                .collect();
            (format!("layers.{i}.weight"), Value::Tensor(TensorData::from_f32(&[per], &data)))
        })
        .collect::<Vec<_>>();
    Value::dict_from(items)
}

fn time<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

fn dd(path: &Path, mib: usize) -> anyhow::Result<()> {
    let st = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", path.display()))
        .args(["bs=1M", &format!("count={mib}"), "conv=fsync", "status=none"])
        .status()
        .context("running dd")?;
    if !st.success() {
        bail!("dd failed: {st}");
    }
    Ok(())
}

/// Seconds `dd` takes to read `path` (page cache warm) to /dev/null in 1 MiB blocks, from dd's own
/// transfer line, so that starting the process is not counted.
fn dd_read(path: &Path) -> anyhow::Result<f64> {
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["of=/dev/null", "bs=1M"])
        .env("LC_ALL", "C")
        .output()
        .context("running dd")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("dd (read) failed: {stderr}");
    }
    dd_seconds(&stderr)
        .filter(|s| *s > 0.0)
        .with_context(|| format!("dd (read) printed no transfer time: {stderr}"))
}

/// Seconds from dd's transfer line ("... copied, 0.0512 s, 5.2 GB/s").
fn dd_seconds(stderr: &str) -> Option<f64> {
    let after =
        stderr.lines().rev().find_map(|l| l.split_once(" copied, ").map(|(_, rest)| rest))?;
    after.split_whitespace().next()?.parse().ok()
}

const TORCH_SCRIPT: &str = r#"
import json, os, sys, time, torch
d, total, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
per = max(total // n // 4, 1)
g = torch.Generator().manual_seed(0)
sd = {f"layers.{i}.weight": torch.rand(per, generator=g) for i in range(n)}
p = os.path.join(d, "torch.pt")
for _ in range(reps):
    t = time.perf_counter()
    torch.save(sd, p)
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
    save = time.perf_counter() - t
    t = time.perf_counter()
    x = torch.load(p, mmap=True, weights_only=True)
    load = time.perf_counter() - t
    del x
    t = time.perf_counter()
    x = torch.load(p, weights_only=True)
    load_read = time.perf_counter() - t
    del x
    print(json.dumps({"save": save, "load": load, "load_read": load_read}), flush=True)
os.remove(p)
"#;

/// Seconds of one torch.save (+ fsync), torch.load(mmap=True) and plain torch.load of the same
/// shapes, timed inside Python (interpreter start and tensor creation are not timed).
struct TorchTimes {
    save: f64,
    load_mmap: f64,
    load_read: f64,
}

fn torch_once(py: &Path, dir: &Path, total: usize, tensors: usize) -> anyhow::Result<TorchTimes> {
    let out = Command::new(py)
        .args(["-c", TORCH_SCRIPT])
        .arg(dir)
        .args([total.to_string(), tensors.to_string(), "1".to_string()])
        .output()
        .context("running torch")?;
    if !out.status.success() {
        bail!("torch benchmark failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().context("torch benchmark printed nothing")?;
    let j: serde_json::Value = serde_json::from_str(line)?;
    match (j["save"].as_f64(), j["load"].as_f64(), j["load_read"].as_f64()) {
        (Some(save), Some(load_mmap), Some(load_read)) => {
            Ok(TorchTimes { save, load_mmap, load_read })
        }
        _ => bail!("torch benchmark printed {line}"),
    }
}

/// A new anonymous mapping of `len` bytes, advised to use huge pages as the full read's buffer is,
/// with every byte written once.
fn touch_fresh_memory(len: usize) -> anyhow::Result<memmap2::MmapMut> {
    let mut map = memmap2::MmapMut::map_anon(len).context("mapping fresh memory")?;
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(1);
    Ok(std::hint::black_box(map))
}

fn stats(v: &[f64], bytes: f64) -> (f64, f64) {
    // Throughput in MiB/s: min and median of the per-run throughputs.
    let mut t: Vec<f64> = v.iter().map(|s| bytes / s / (1 << 20) as f64).collect();
    t.sort_by(|a, b| a.total_cmp(b));
    (t[0], t[t.len() / 2])
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.size_mib == 0 || args.tensors == 0 || args.repeat == 0 {
        bail!("--size-mib, --tensors and --repeat must be positive");
    }
    crate::in_scratch_dir(args.dir.as_deref(), "tandem-bench-ckpt", |dir| run(&args, dir))
}

fn run(args: &Args, dir: &Path) -> anyhow::Result<i32> {
    let total = args.size_mib << 20;
    eprintln!(
        "building a {} MiB state dict of {} f32 tensors in {}",
        args.size_mib,
        args.tensors,
        dir.display()
    );
    let sd = state_dict(total, args.tensors);
    let bytes = total as f64;
    let (pt, st, ddf) = (dir.join("tandem.pt"), dir.join("tandem.safetensors"), dir.join("dd.bin"));
    let mut rows: Vec<(&str, Vec<f64>)> = vec![
        ("dd conv=fsync (write)", vec![]),
        ("tandem save .pt", vec![]),
        ("tandem save .safetensors", vec![]),
        ("tandem load .pt (mmap)", vec![]),
        ("dd (read, warm cache)", vec![]),
        ("fresh memory (first touch)", vec![]),
        ("tandem load .pt (read)", vec![]),
        ("tandem load .pt (read, memory reused)", vec![]),
        ("tandem load .safetensors", vec![]),
    ];
    let python = find_python(args.python.clone());
    match &python {
        Some(py) => eprintln!("torch runs with {}", py.display()),
        None => eprintln!("no Python with torch found: torch rows skipped"),
    }
    let mut torch_times: Option<Vec<TorchTimes>> = python.as_ref().map(|_| vec![]);
    let no_mmap = tandem::ckpt::LoadOptions { mmap: false, ..Default::default() };
    for r in 0..args.repeat {
        eprintln!("run {}/{}", r + 1, args.repeat);
        if let (Some(py), Some(times)) = (&python, &mut torch_times) {
            times.push(torch_once(py, dir, total, args.tensors)?);
        }
        // The writers take turns going first: on a shared disk the first writer after a pause
        // is measurably faster, and a fixed order would hand that to one of them.
        for i in 0..3 {
            match (i + r + args.first_writer) % 3 {
                0 => {
                    rows[0].1.push(time(|| dd(&ddf, args.size_mib))?);
                    std::fs::remove_file(&ddf).ok();
                }
                1 => rows[1].1.push(time(|| Ok(tandem::ckpt::save(&pt, &sd)?))?),
                _ => rows[2].1.push(time(|| Ok(tandem::ckpt::safetensors::save(&st, &sd)?))?),
            }
        }
        rows[3].1.push(time(|| Ok(tandem::ckpt::load(&pt)?))?);
        // Times of whole-file reads are scaled to the tensor bytes, as every other row is.
        let file_len = std::fs::metadata(&pt).context("reading the .pt file's size")?.len();
        let per_tensor_byte = total as f64 / file_len as f64;
        rows[4].1.push(dd_read(&pt)? * per_tensor_byte);
        let start = Instant::now();
        let held = touch_fresh_memory(file_len as usize)?;
        rows[5].1.push(start.elapsed().as_secs_f64() * per_tensor_byte);
        rows[6].1.push(time(|| Ok(tandem::ckpt::load_with(&pt, &no_mmap)?))?);
        drop(held);
        rows[7].1.push(time(|| Ok(tandem::ckpt::load_with(&pt, &no_mmap)?))?);
        rows[8].1.push(time(|| Ok(tandem::ckpt::safetensors::load(&st)?))?);
        std::fs::remove_file(&pt).ok();
        std::fs::remove_file(&st).ok();
    }
    let mut torch_rows: Vec<(&str, Vec<f64>)> = vec![];
    if let Some(times) = torch_times {
        torch_rows.push(("torch.save + fsync", times.iter().map(|t| t.save).collect()));
        torch_rows.push(("torch.load(mmap=True)", times.iter().map(|t| t.load_mmap).collect()));
        torch_rows.push(("torch.load (read)", times.iter().map(|t| t.load_read).collect()));
    }
    if args.json {
        for (name, v) in rows.iter().chain(torch_rows.iter()) {
            let (min_mib_s, median_mib_s) = stats(v, bytes);
            let row = CkptRow { name: name.to_string(), min_mib_s, median_mib_s };
            println!("{}", serde_json::to_string(&row)?);
        }
        return Ok(0);
    }
    println!(
        "checkpoint of {} MiB ({} tensors), {} runs; throughput in MiB/s",
        args.size_mib, args.tensors, args.repeat
    );
    println!("{:<40} {:>10} {:>10}", "", "min", "median");
    let mut med = std::collections::HashMap::new();
    for (name, v) in rows.iter().chain(torch_rows.iter()) {
        let (mn, md) = stats(v, bytes);
        med.insert(*name, md);
        println!("{name:<40} {mn:>10.0} {md:>10.0}");
    }
    let ratio = |a: &str, b: &str| med.get(a).zip(med.get(b)).map(|(x, y)| x / y);
    println!("ratios of medians:");
    for (a, b, target) in [
        ("tandem save .pt", "dd conv=fsync (write)", ">= 0.80"),
        ("tandem save .safetensors", "dd conv=fsync (write)", ">= 0.80"),
        ("tandem save .pt", "torch.save + fsync", ">= 1.00"),
        ("tandem load .pt (mmap)", "torch.load(mmap=True)", ">= 1.00"),
        ("tandem load .pt (read)", "torch.load (read)", ">= 1.00"),
        ("tandem load .pt (read)", "dd (read, warm cache)", ">= 0.50"),
        ("tandem load .pt (read, memory reused)", "dd (read, warm cache)", ">= 0.50"),
        ("fresh memory (first touch)", "dd (read, warm cache)", "-"),
    ] {
        if let Some(r) = ratio(a, b) {
            println!("  {a} / {b}: {r:.2} (target {target})");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_dd_transfer_time() {
        let err = "2048+0 records in\n2048+0 records out\n8388608 bytes (8.4 MB, 8.0 MiB) copied, 0.00312 s, 2.7 GB/s\n";
        assert_eq!(dd_seconds(err), Some(0.00312));
        assert_eq!(dd_seconds("dd: error"), None);
    }
}
