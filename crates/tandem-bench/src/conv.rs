//! `tandem bench conv`: per-op times of tandem's CPU kernels against PyTorch on the shapes of
//! ResNet-18 for CIFAR (32x32 input) or of arcface_torch's IResNet-18 (112x112) at `--width` —
//! every distinct convolution (3x3 stride 1 and 2, 1x1 stride-2 shortcuts, the stem), the
//! BatchNorm of each map size and, for the IResNet, its PReLUs: forward, and forward +
//! backward of `sum(y * r)`, median ms over `--repeats`. The 3x3 stride-1 convolutions, which
//! tandem runs by Winograd's algorithm, are also timed through im2col + gemm (the path they
//! took before), in the same run. PyTorch's figures come from `scripts/peers/torch_conv_ops.py`,
//! which times the same op list (handed to it as JSON) with the same batch and thread count.
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use serde::Serialize;
use tandem::nn::kernels::conv2d::{conv2d, ConvParams};
use tandem::nn::kernels::winograd::{applies, MIN_CHANNELS};

/// Which network's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Net {
    /// ResNet-18 for CIFAR: 3x3 stem, stages at 32, 16, 8, 4.
    Resnet18,
    /// arcface_torch's IResNet-18: 3x3 stem at 112, stages from 112 down to 7, PReLU.
    Iresnet18,
}

impl Net {
    pub fn title(self) -> &'static str {
        match self {
            Net::Resnet18 => "ResNet-18 (CIFAR)",
            Net::Iresnet18 => "IResNet-18 (112x112)",
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Whose shapes.
    #[arg(long, value_enum, default_value_t = Net::Resnet18)]
    net: Net,
    /// Batch of every op (default 32 for resnet18, 8 for iresnet18, the benches' per-rank batches).
    #[arg(long)]
    batch: Option<usize>,
    /// Stage widths w, 2w, 4w, 8w.
    #[arg(long, default_value_t = 16)]
    width: usize,
    /// Timed repetitions per op (after one warm-up); medians are reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// A Python with torch: also time PyTorch on the same ops.
    #[arg(long)]
    torch: Option<PathBuf>,
    /// `cpu`, or `cuda` (GPU 0: tandem through cuDNN and its CUDA kernels, PyTorch with
    /// cudnn.benchmark; both wait for the device after every timed call).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// The activations' and weights' type on a GPU (`f16`, `bf16`: mixed precision, BatchNorm
    /// and PReLU parameters in f32).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    dtype: String,
    /// Also write the results as JSON to this file (for `tandem bench report --gpu`).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One op as both sides time it (the peer reads these as JSON).
#[derive(Serialize, Clone, Debug)]
struct OpSpec {
    /// conv2d, batch_norm or prelu.
    kind: &'static str,
    name: String,
    c_in: usize,
    c_out: usize,
    kernel: usize,
    stride: usize,
    /// Input height = width.
    side: usize,
    /// Whether the input gets a gradient (not for a stem, whose input is data).
    input_grad: bool,
}

fn conv(
    name: String,
    (c_in, c_out): (usize, usize),
    kernel: usize,
    stride: usize,
    side: usize,
) -> OpSpec {
    let input_grad = !name.starts_with("stem");
    OpSpec { kind: "conv2d", name, c_in, c_out, kernel, stride, side, input_grad }
}

fn per_channel(kind: &'static str, c: usize, side: usize) -> OpSpec {
    let short = if kind == "batch_norm" { "bn" } else { "prelu" };
    OpSpec {
        kind,
        name: format!("{short}_{c}x{side}x{side}"),
        c_in: c,
        c_out: c,
        kernel: 0,
        stride: 1,
        side,
        input_grad: true,
    }
}

/// Every distinct op of `net` at width `w`.
fn ops(net: Net, w: usize) -> Vec<OpSpec> {
    let mut v = Vec::new();
    match net {
        Net::Resnet18 => {
            v.push(conv("stem 3x3".into(), (3, w), 3, 1, 32));
            let stages = [(w, w, 32), (w, 2 * w, 32), (2 * w, 4 * w, 16), (4 * w, 8 * w, 8)];
            for (stage, (cin, cout, side)) in stages.into_iter().enumerate() {
                let stride = if stage == 0 { 1 } else { 2 };
                let s = stage + 1;
                v.push(conv(format!("layer{s} 3x3 s{stride}"), (cin, cout), 3, stride, side));
                if stride == 2 {
                    v.push(conv(format!("layer{s} 3x3 s1"), (cout, cout), 3, 1, side / 2));
                    v.push(conv(format!("layer{s} 1x1 s2"), (cin, cout), 1, 2, side));
                }
            }
            for (c, side) in [(w, 32), (2 * w, 16), (4 * w, 8), (8 * w, 4)] {
                v.push(per_channel("batch_norm", c, side));
            }
        }
        Net::Iresnet18 => {
            // Each stage's first block: conv1 3x3 stride 1 (cin → cout) at the stage's input
            // size, conv2 3x3 stride 2 halving it, a 1x1 stride-2 shortcut; then 3x3 stride 1
            // at the halved size.
            v.push(conv("stem 3x3".into(), (3, w), 3, 1, 112));
            let stages = [(w, w, 112), (w, 2 * w, 56), (2 * w, 4 * w, 28), (4 * w, 8 * w, 14)];
            for (stage, (cin, cout, side)) in stages.into_iter().enumerate() {
                let s = stage + 1;
                v.push(conv(format!("layer{s} 3x3 s1 in"), (cin, cout), 3, 1, side));
                v.push(conv(format!("layer{s} 3x3 s2"), (cout, cout), 3, 2, side));
                v.push(conv(format!("layer{s} 1x1 s2"), (cin, cout), 1, 2, side));
                v.push(conv(format!("layer{s} 3x3 s1"), (cout, cout), 3, 1, side / 2));
            }
            for (c, side) in [(w, 112), (w, 56), (2 * w, 28), (4 * w, 14), (8 * w, 7)] {
                v.push(per_channel("batch_norm", c, side));
            }
            for (c, side) in [(w, 112), (2 * w, 56), (4 * w, 28), (8 * w, 14)] {
                v.push(per_channel("prelu", c, side));
            }
        }
    }
    for op in &mut v {
        op.name = op.name.replace(' ', "_");
    }
    v
}

/// One side's median ms for an op.
#[derive(Serialize, serde::Deserialize, Clone, Copy, Debug, Default, PartialEq)]
pub struct Times {
    pub fwd_ms: f64,
    /// Forward + backward with every gradient the op's place in a network needs.
    pub fwdbwd_ms: f64,
    /// Convolutions: forward + the input's gradient alone (backward-data), when the input
    /// takes one.
    pub data_ms: Option<f64>,
    /// Convolutions: forward + the weight's gradient alone (backward-filter).
    pub filter_ms: Option<f64>,
}

struct Timed {
    times: Times,
    /// Convolutions tandem runs by Winograd's algorithm only: forward + backward through
    /// im2col + gemm.
    im2col_fwdbwd_ms: Option<f64>,
}

/// One op's row of the results (`--json`).
#[derive(Serialize, serde::Deserialize, Clone, Debug)]
pub struct OpRow {
    pub kind: String,
    pub name: String,
    pub tandem: Times,
    pub torch: Option<Times>,
}

/// What `--json` writes.
#[derive(Serialize, serde::Deserialize, Clone, Debug)]
pub struct ConvResults {
    pub net: String,
    pub width: usize,
    pub batch: usize,
    pub device: String,
    pub dtype: String,
    pub repeats: usize,
    pub ops: Vec<OpRow>,
}

/// Median ms of `f` over `repeats` runs after one warm-up (its result is dropped), each run
/// waiting for `dev` to finish its work.
fn median_ms<T>(
    dev: &Device,
    repeats: usize,
    mut f: impl FnMut() -> candle_core::Result<T>,
) -> anyhow::Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn time_op(
    op: &OpSpec,
    batch: usize,
    repeats: usize,
    (dev, dtype): (&Device, DType),
) -> anyhow::Result<Timed> {
    let x = Tensor::randn(0f32, 1.0, (batch, op.c_in, op.side, op.side), dev)?.to_dtype(dtype)?;
    let x = if op.input_grad { Var::from_tensor(&x)?.as_tensor().clone() } else { x };
    match op.kind {
        "conv2d" => {
            let w = Var::from_tensor(
                &Tensor::randn(0f32, 0.1, (op.c_out, op.c_in, op.kernel, op.kernel), dev)?
                    .to_dtype(dtype)?,
            )?;
            let p = ConvParams { stride: op.stride, padding: op.kernel / 2, dilation: 1 };
            let r = Tensor::randn(0f32, 1.0, conv2d(&x, w.as_tensor(), p)?.shape(), dev)?
                .to_dtype(dtype)?;
            let fwd = || conv2d(&x, w.as_tensor(), p);
            let step = || (conv2d(&x, w.as_tensor(), p)? * &r)?.sum_all()?.backward();
            let fwd_ms = median_ms(dev, repeats, fwd)?;
            let fwdbwd_ms = median_ms(dev, repeats, step)?;
            // Each backward alone: the other operand out of the graph.
            let (x_fixed, w_fixed) = (x.detach(), w.as_tensor().detach());
            let data_ms = op
                .input_grad
                .then(|| {
                    median_ms(dev, repeats, || {
                        (conv2d(&x, &w_fixed, p)? * &r)?.sum_all()?.backward()
                    })
                })
                .transpose()?;
            let filter_ms = Some(median_ms(dev, repeats, || {
                (conv2d(&x_fixed, w.as_tensor(), p)? * &r)?.sum_all()?.backward()
            })?);
            let times = Times { fwd_ms, fwdbwd_ms, data_ms, filter_ms };
            let winograd = dev.is_cpu()
                && applies((op.kernel, op.kernel), op.stride, p.padding, 1, op.c_in, op.c_out);
            let im2col_fwdbwd_ms = if winograd {
                let default = MIN_CHANNELS.swap(usize::MAX, Ordering::Relaxed);
                let ms = median_ms(dev, repeats, step);
                MIN_CHANNELS.store(default, Ordering::Relaxed);
                Some(ms?)
            } else {
                None
            };
            Ok(Timed { times, im2col_fwdbwd_ms })
        }
        "batch_norm" => {
            let vm = VarMap::new();
            let bn = tandem::nn::fast_batch_norm2d(
                op.c_in,
                VarBuilder::from_varmap(&vm, DType::F32, dev),
            )?;
            let r = Tensor::randn(0f32, 1.0, x.shape(), dev)?.to_dtype(dtype)?;
            let fwd_ms = median_ms(dev, repeats, || bn.forward_t(&x, true))?;
            let fwdbwd_ms =
                median_ms(dev, repeats, || (bn.forward_t(&x, true)? * &r)?.sum_all()?.backward())?;
            let times = Times { fwd_ms, fwdbwd_ms, ..Times::default() };
            Ok(Timed { times, im2col_fwdbwd_ms: None })
        }
        _ => {
            let a = Var::from_tensor(&Tensor::full(0.25f32, op.c_in, dev)?)?;
            let r = Tensor::randn(0f32, 1.0, x.shape(), dev)?.to_dtype(dtype)?;
            let f = || tandem::nn::kernels::prelu::prelu(&x, a.as_tensor());
            let fwd_ms = median_ms(dev, repeats, f)?;
            let fwdbwd_ms = median_ms(dev, repeats, || (f()? * &r)?.sum_all()?.backward())?;
            let times = Times { fwd_ms, fwdbwd_ms, ..Times::default() };
            Ok(Timed { times, im2col_fwdbwd_ms: None })
        }
    }
}

fn torch_ops(
    ops: &[OpSpec],
    (batch, repeats): (usize, usize),
    (device, dtype): (&str, &str),
    python: &PathBuf,
) -> anyhow::Result<HashMap<String, Times>> {
    let script = crate::report::repo_root().join(crate::PEERS_DIR).join("torch_conv_ops.py");
    let threads = rayon::current_num_threads();
    let mut child = Command::new(python)
        .arg(&script)
        .args([batch, repeats, threads].map(|v| v.to_string()))
        .args([device, dtype])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    let spec = serde_json::to_vec(ops)?;
    child.stdin.take().context("the peer's stdin")?.write_all(&spec)?;
    let out =
        child.wait_with_output().with_context(|| format!("waiting for {}", script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(out.status.success(), "{} failed ({}): {text}", script.display(), out.status);
    let mut m = HashMap::new();
    for line in text.lines() {
        let kv: HashMap<&str, &str> =
            line.split_whitespace().filter_map(|w| w.split_once('=')).collect();
        let number = |key: &str| kv.get(key).map(|v| v.parse::<f64>()).transpose();
        if let (Some(name), Some(fwd_ms), Some(fwdbwd_ms)) =
            (kv.get("name"), number("fwd_ms")?, number("fwdbwd_ms")?)
        {
            let (data_ms, filter_ms) = (number("data_ms")?, number("filter_ms")?);
            m.insert(name.to_string(), Times { fwd_ms, fwdbwd_ms, data_ms, filter_ms });
        }
    }
    anyhow::ensure!(!m.is_empty(), "{}: no op timings in its output: {text:?}", script.display());
    Ok(m)
}

pub fn main(a: Args) -> anyhow::Result<i32> {
    let batch = a.batch.unwrap_or(match a.net {
        Net::Resnet18 => 32,
        Net::Iresnet18 => 8,
    });
    anyhow::ensure!(batch > 0 && a.width > 0, "--batch and --width must be at least 1");
    let ops = ops(a.net, a.width);
    let dev = if a.device == "cuda" { Device::new_cuda(0)? } else { Device::Cpu };
    let dtype = match a.dtype.as_str() {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        _ => DType::F32,
    };
    anyhow::ensure!(
        dtype == DType::F32 || !dev.is_cpu(),
        "--dtype {}: tandem's CPU kernels compute in f32 (16-bit types are for --device cuda)",
        a.dtype
    );
    let mut timed = Vec::with_capacity(ops.len());
    for op in &ops {
        let t = time_op(op, batch, a.repeats, (&dev, dtype));
        timed.push(t.with_context(|| format!("timing {}", op.name))?);
    }
    let torch = a
        .torch
        .as_ref()
        .map(|p| torch_ops(&ops, (batch, a.repeats), (&a.device, &a.dtype), p))
        .transpose()?;
    println!(
        "{} ops at width {}, batch {batch}, on {} in {}, {} threads, median of {} (ms)",
        a.net.title(),
        a.width,
        a.device,
        a.dtype,
        rayon::current_num_threads(),
        a.repeats
    );
    println!(
        "| op | shape | tandem fwd | torch fwd | × torch | tandem fwd+bwd | torch fwd+bwd | × torch | \
         tandem fwd+bwd-data | torch | × torch | tandem fwd+bwd-filter | torch | × torch | \
         tandem fwd+bwd by im2col | Winograd gain |\n\
         |---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    let cell = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.4}"));
    // × torch: how many times faster tandem is (torch time / tandem time).
    let ratio = |ours: Option<f64>, theirs: Option<f64>| match (ours, theirs) {
        (Some(o), Some(t)) => format!("{:.2}", t / o),
        _ => "–".into(),
    };
    let mut rows = Vec::with_capacity(ops.len());
    for (op, t) in ops.iter().zip(&timed) {
        let theirs = torch.as_ref().and_then(|m| m.get(&op.name)).copied();
        let mut line = format!("| {} | {} |", op.kind, op.name);
        for pick in [
            |t: &Times| Some(t.fwd_ms),
            |t: &Times| Some(t.fwdbwd_ms),
            |t: &Times| t.data_ms,
            |t: &Times| t.filter_ms,
        ] {
            let (o, p) = (pick(&t.times), theirs.as_ref().and_then(pick));
            line += &format!(" {} | {} | {} |", cell(o), cell(p), ratio(o, p));
        }
        let gain = t.im2col_fwdbwd_ms.map(|i| format!("{:.2}", i / t.times.fwdbwd_ms));
        line += &format!(" {} | {} |", cell(t.im2col_fwdbwd_ms), gain.unwrap_or("–".into()));
        println!("{line}");
        rows.push(OpRow {
            kind: op.kind.to_string(),
            name: op.name.clone(),
            tandem: t.times,
            torch: theirs,
        });
    }
    if let Some(path) = &a.json {
        let results = ConvResults {
            net: a.net.title().to_string(),
            width: a.width,
            batch,
            device: a.device.clone(),
            dtype: a.dtype.clone(),
            repeats: a.repeats,
            ops: rows,
        };
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_lists_have_unique_names_and_the_nets_shapes() {
        for net in [Net::Resnet18, Net::Iresnet18] {
            let ops = ops(net, 16);
            let mut names: Vec<&str> = ops.iter().map(|o| o.name.as_str()).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), ops.len(), "{net:?}: duplicate op names");
            assert!(ops.iter().all(|o| !o.name.contains(' ')));
        }
        let iresnet = ops(Net::Iresnet18, 16);
        let stage4 = iresnet.iter().find(|o| o.name == "layer4_3x3_s1").unwrap();
        assert_eq!((stage4.c_in, stage4.side), (128, 7), "the last stage runs at 7x7");
        assert!(iresnet.iter().any(|o| o.kind == "prelu"));
        assert!(!ops(Net::Resnet18, 16)[0].input_grad, "the stem's input is data");
    }
}
