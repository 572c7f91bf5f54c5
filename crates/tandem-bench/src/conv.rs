//! `tandem bench conv`: per-op times of tandem's CPU kernels against PyTorch on the shapes of
//! ResNet-18 for CIFAR at `--width` — every distinct convolution (3x3 stride 1 and 2, 1x1 stride
//! 2 shortcuts, the stem) and the BatchNorm of each stage: forward, and forward + backward of
//! `sum(y * r)`, median ms over `--repeats`. PyTorch's figures come from
//! `scripts/peers/torch_conv_ops.py` with the same batch, width and thread count.
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use tandem_nn::kernels::conv2d::{conv2d, ConvParams};

#[derive(clap::Args)]
pub struct Args {
    /// Batch of every op.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// ResNet width (stages w, 2w, 4w, 8w).
    #[arg(long, default_value_t = 16)]
    width: usize,
    /// Timed repetitions per op (after one warm-up); medians are reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// A Python with torch: also time PyTorch on the same ops.
    #[arg(long)]
    torch: Option<PathBuf>,
}

struct Op {
    kind: &'static str,
    name: String,
    fwd_ms: f64,
    fwdbwd_ms: f64,
}

/// Median ms of `f` over `repeats` runs after one warm-up (its result is dropped).
fn median_ms<T>(
    repeats: usize,
    mut f: impl FnMut() -> candle_core::Result<T>,
) -> anyhow::Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// (name, cin, cout, kernel, stride, side) of each distinct convolution, as the peer lists them.
fn conv_shapes(w: usize) -> Vec<(String, usize, usize, usize, usize, usize)> {
    let mut v = vec![("stem 3x3".to_string(), 3, w, 3, 1, 32)];
    for (stage, (cin, cout, side)) in
        [(w, w, 32), (w, 2 * w, 32), (2 * w, 4 * w, 16), (4 * w, 8 * w, 8)].into_iter().enumerate()
    {
        let stride = if stage == 0 { 1 } else { 2 };
        v.push((format!("layer{} 3x3 s{stride}", stage + 1), cin, cout, 3, stride, side));
        if stride == 2 {
            v.push((format!("layer{} 3x3 s1", stage + 1), cout, cout, 3, 1, side / 2));
            v.push((format!("layer{} 1x1 s2", stage + 1), cin, cout, 1, 2, side));
        }
    }
    v
}

fn tandem_ops(a: &Args) -> anyhow::Result<Vec<Op>> {
    let dev = Device::Cpu;
    let mut ops = Vec::new();
    for (name, cin, cout, k, stride, side) in conv_shapes(a.width) {
        let x = Tensor::randn(0f32, 1.0, (a.batch, cin, side, side), &dev)?;
        let x =
            if name.starts_with("stem") { x } else { Var::from_tensor(&x)?.as_tensor().clone() };
        let w = Var::randn(0f32, 0.1, (cout, cin, k, k), &dev)?;
        let p = ConvParams { stride, padding: k / 2, dilation: 1 };
        let y = conv2d(&x, w.as_tensor(), p)?;
        let r = Tensor::randn(0f32, 1.0, y.shape(), &dev)?;
        let fwd_ms = median_ms(a.repeats, || conv2d(&x, w.as_tensor(), p))?;
        let fwdbwd_ms =
            median_ms(a.repeats, || (conv2d(&x, w.as_tensor(), p)? * &r)?.sum_all()?.backward())?;
        ops.push(Op { kind: "conv2d", name: name.replace(' ', "_"), fwd_ms, fwdbwd_ms });
    }
    for (c, side) in [(a.width, 32), (2 * a.width, 16), (4 * a.width, 8), (8 * a.width, 4)] {
        let vm = VarMap::new();
        let bn = tandem_nn::batch_norm2d(c, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
        let x = Var::randn(0f32, 1.0, (a.batch, c, side, side), &dev)?;
        let r = Tensor::randn(0f32, 1.0, x.shape(), &dev)?;
        let fwd_ms = median_ms(a.repeats, || bn.forward_t(x.as_tensor(), true))?;
        let fwdbwd_ms = median_ms(a.repeats, || {
            (bn.forward_t(x.as_tensor(), true)? * &r)?.sum_all()?.backward()
        })?;
        ops.push(Op {
            kind: "batch_norm",
            name: format!("bn_{c}x{side}x{side}"),
            fwd_ms,
            fwdbwd_ms,
        });
    }
    Ok(ops)
}

fn torch_ops(a: &Args, python: &PathBuf) -> anyhow::Result<HashMap<String, (f64, f64)>> {
    let script = crate::report::repo_root().join(crate::PEERS_DIR).join("torch_conv_ops.py");
    let threads = rayon::current_num_threads();
    let out = Command::new(python)
        .arg(&script)
        .args([a.batch, a.width, a.repeats, threads].map(|v| v.to_string()))
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut m = HashMap::new();
    for line in text.lines() {
        let kv: HashMap<&str, &str> =
            line.split_whitespace().filter_map(|w| w.split_once('=')).collect();
        if let (Some(name), Some(f), Some(fb)) =
            (kv.get("name"), kv.get("fwd_ms"), kv.get("fwdbwd_ms"))
        {
            m.insert(name.to_string(), (f.parse()?, fb.parse()?));
        }
    }
    anyhow::ensure!(!m.is_empty(), "{}: no op timings in its output: {text:?}", script.display());
    Ok(m)
}

pub fn main(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(a.batch > 0 && a.width > 0, "--batch and --width must be at least 1");
    let ops = tandem_ops(&a)?;
    let torch = a.torch.as_ref().map(|p| torch_ops(&a, p)).transpose()?;
    println!(
        "ResNet-18 (CIFAR) ops at width {}, batch {}, {} threads, median of {} (ms)",
        a.width,
        a.batch,
        rayon::current_num_threads(),
        a.repeats
    );
    println!(
        "| op | shape | tandem fwd | torch fwd | × torch | tandem fwd+bwd | torch fwd+bwd | × torch |\n|---|---|--:|--:|--:|--:|--:|--:|"
    );
    for op in &ops {
        let t = torch.as_ref().and_then(|m| m.get(&op.name)).copied();
        let cell = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.4}"));
        // × torch: how many times faster tandem is (torch time / tandem time).
        let ratio = |ours: f64, theirs: Option<f64>| {
            theirs.map_or("–".into(), |t| format!("{:.2}", t / ours))
        };
        println!(
            "| {} | {} | {:.4} | {} | {} | {:.4} | {} | {} |",
            op.kind,
            op.name,
            op.fwd_ms,
            cell(t.map(|t| t.0)),
            ratio(op.fwd_ms, t.map(|t| t.0)),
            op.fwdbwd_ms,
            cell(t.map(|t| t.1)),
            ratio(op.fwdbwd_ms, t.map(|t| t.1)),
        );
    }
    Ok(0)
}
