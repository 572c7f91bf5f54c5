//! `tandem bench ops`: per-op times of tandem's CPU kernels against PyTorch on one network's
//! shapes, every distinct op of its training step in one table, with the host's CPU and ISA in
//! its header:
//! - ResNet-18 for CIFAR (32x32) or arcface_torch's IResNet-18 (112x112) at `--width`: every
//!   distinct convolution (3x3 stride 1 and 2, 1x1 stride-2 shortcuts, the stem), the BatchNorm
//!   of each map size and, for the IResNet, its PReLUs;
//! - arcface_torch's `vit_t`, each op as its step runs it: the patch embedding (one product
//!   over the patches; PyTorch's `PatchEmbed` convolution on the other side), LayerNorm, the
//!   qkv / proj / fc2 linears and fc1 with its ReLU6 (one fused op) at its 129 kept tokens,
//!   attention, the feature head's linear and BatchNorm1d, and SGD (the face bench's) and
//!   AdamW (arcface_torch's config) over its parameters;
//! - arcface_torch's `mbf`: every distinct convolution (stem, grouped, expand / depthwise /
//!   project 1x1 and 3x3 of each stage, the 7x7 GDC), BatchNorm and PReLU, the embedding
//!   linear, and SGD over its parameters.
//!
//! Each op: forward, and forward + backward of `sum(y * r)` through `tandem::nn::backward`
//! less what that harness costs alone (timed on a leaf of `y`'s shape, on each side), median
//! ms over `--repeats`; an optimizer row is one `step`. The 3x3 stride-1 convolutions,
//! which tandem runs by Winograd's algorithm, are also timed through im2col + gemm. PyTorch's
//! figures come from `scripts/peers/torch_ops.py`, which times the same op list (handed to it
//! as JSON) with the same batch and thread count on the same inputs: both sides fill them by
//! one integer formula, and each side's forward output sum (an optimizer's parameter sum after
//! one step) must agree, or the run fails naming the op — proof the two time the same work.
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::Context;
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use serde::Serialize;

mod timing;

use timing::{time_op, Checksum};

/// Which network's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Net {
    /// ResNet-18 for CIFAR: 3x3 stem, stages at 32, 16, 8, 4.
    Resnet18,
    /// arcface_torch's IResNet-18: 3x3 stem at 112, stages from 112 down to 7, PReLU.
    Iresnet18,
    /// arcface_torch's ViT-Tiny (width 256, 12 blocks, 8 heads) on 112x112 faces.
    #[value(name = "vit_t")]
    VitT,
    /// arcface_torch's MobileFaceNet (`mbf`: blocks 1, 4, 6, 2, scale 2).
    Mbf,
}

impl Net {
    pub fn title(self) -> &'static str {
        match self {
            Net::Resnet18 => "ResNet-18 (CIFAR)",
            Net::Iresnet18 => "IResNet-18 (112x112)",
            Net::VitT => "ViT-T (112x112)",
            Net::Mbf => "MobileFaceNet mbf (112x112)",
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Whose shapes.
    #[arg(long, value_enum, default_value_t = Net::Resnet18)]
    net: Net,
    /// Batch of every op (default 32 for resnet18, 8 for iresnet18 and vit_t, 16 for mbf: the
    /// benches' per-rank batches).
    #[arg(long)]
    batch: Option<usize>,
    /// Stage widths w, 2w, 4w, 8w (resnet18, iresnet18).
    #[arg(long, default_value_t = 16)]
    width: usize,
    /// The face backbones' embedding width (vit_t, mbf).
    #[arg(long, default_value_t = 128)]
    embedding: usize,
    /// Only the ops whose name contains this (for profiling one op).
    #[arg(long)]
    only: Option<String>,
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

/// One op as both sides time it (the peer reads these as JSON). Which fields an op reads
/// depends on its kind.
#[derive(Serialize, Clone, Debug, Default)]
struct OpSpec {
    /// conv2d, patch_embed, batch_norm, prelu, linear, linear_relu6, layer_norm, attention,
    /// sgd or adamw.
    kind: &'static str,
    name: String,
    /// Channels (conv2d, patch_embed, batch_norm, prelu); features (linear in / out,
    /// layer_norm);
    /// width D (attention).
    c_in: usize,
    c_out: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    groups: usize,
    /// Input height = width (conv2d, batch_norm, prelu).
    side: usize,
    /// Rows of a `[rows, c_in]` input (linear, linear_relu6, layer_norm); 0: the batch.
    rows: usize,
    /// attention: tokens per sample and heads.
    tokens: usize,
    heads: usize,
    bias: bool,
    /// Whether the input gets a gradient (not for a stem, whose input is data).
    input_grad: bool,
    /// sgd, adamw: the parameters' element counts.
    numels: Vec<usize>,
}

fn conv(
    name: String,
    (c_in, c_out): (usize, usize),
    kernel: usize,
    stride: usize,
    side: usize,
) -> OpSpec {
    let input_grad = !name.starts_with("stem");
    let (padding, groups) = (kernel / 2, 1);
    OpSpec {
        kind: "conv2d",
        name,
        c_in,
        c_out,
        kernel,
        stride,
        padding,
        groups,
        side,
        input_grad,
        ..OpSpec::default()
    }
}

fn per_channel(kind: &'static str, c: usize, side: usize) -> OpSpec {
    let short = if kind == "batch_norm" { "bn" } else { "prelu" };
    OpSpec {
        kind,
        name: format!("{short}_{c}x{side}x{side}"),
        c_in: c,
        c_out: c,
        stride: 1,
        side,
        input_grad: true,
        ..OpSpec::default()
    }
}

/// `[rows, c_in]` → `[rows, c_out]` (the Linear's weight is `[c_out, c_in]`).
fn linear(name: &str, rows: usize, (c_in, c_out): (usize, usize), bias: bool) -> OpSpec {
    let name = format!("{name}_{rows}x{c_in}to{c_out}");
    OpSpec { kind: "linear", name, c_in, c_out, rows, bias, input_grad: true, ..OpSpec::default() }
}

/// LayerNorm over `[rows, c]`.
fn layer_norm(rows: usize, c: usize) -> OpSpec {
    let (kind, name) = ("layer_norm", format!("layer_norm_{rows}x{c}"));
    OpSpec { kind, name, c_in: c, c_out: c, rows, input_grad: true, ..OpSpec::default() }
}

/// An optimizer step over parameters of `numels` elements.
fn optimizer(kind: &'static str, numels: Vec<usize>) -> OpSpec {
    let total: usize = numels.iter().sum();
    let name = format!("{kind}_{}_tensors_{total}", numels.len());
    OpSpec { kind, name, numels, ..OpSpec::default() }
}

/// The element counts of a face backbone's parameters, in its registration order.
fn face_params(net: Net, embedding: usize) -> anyhow::Result<Vec<usize>> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    match net {
        Net::VitT => {
            drop(tandem::models::Vit::new(tandem::models::VitConfig::VIT_T, embedding, vb)?)
        }
        _ => {
            let (blocks, scale) = tandem::models::MobileFaceNet::MBF;
            drop(tandem::models::MobileFaceNet::new(blocks, scale, embedding, vb)?)
        }
    }
    let mut numels: Vec<usize> = vm.all_vars().iter().map(|v| v.elem_count()).collect();
    numels.sort_unstable_by(|a, b| b.cmp(a));
    Ok(numels)
}

/// Every distinct op of `net` at width `w` (`batch` sets the token rows of the ViT).
fn ops(net: Net, w: usize, batch: usize, embedding: usize) -> anyhow::Result<Vec<OpSpec>> {
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
        Net::VitT => {
            let cfg = tandem::models::VitConfig::VIT_T;
            let d = cfg.embed_dim;
            // Training keeps int(144 · 0.9) patches of each sample (random masking).
            let kept = tandem::models::VIT_PATCHES * 9 / 10;
            let rows = batch * kept;
            v.push(OpSpec {
                kind: "patch_embed",
                name: "stem patch 9x9 s9".into(),
                c_in: 3,
                c_out: d,
                kernel: 9,
                stride: 9,
                side: tandem::models::FACE_SIDE,
                ..OpSpec::default()
            });
            v.push(layer_norm(rows, d));
            v.push(linear("qkv", rows, (d, 3 * d), false));
            v.push(OpSpec {
                kind: "attention",
                name: format!("attention_{batch}x{kept}x{d}_{}heads", cfg.num_heads),
                c_in: d,
                tokens: kept,
                heads: cfg.num_heads,
                input_grad: true,
                ..OpSpec::default()
            });
            v.push(linear("proj", rows, (d, d), true));
            let mut fc1 = linear("fc1_relu6", rows, (d, cfg.mlp_ratio * d), true);
            fc1.kind = "linear_relu6";
            v.push(fc1);
            v.push(linear("fc2", rows, (cfg.mlp_ratio * d, d), true));
            v.push(linear("feature", batch, (tandem::models::VIT_PATCHES * d, d), false));
            v.push(per_channel("batch_norm", d, 1));
            v.push(linear("embed", batch, (d, embedding), false));
            let numels = face_params(net, embedding)?;
            v.push(optimizer("sgd", numels.clone()));
            v.push(optimizer("adamw", numels));
        }
        Net::Mbf => {
            let (c1, c2) = (128, 256);
            v.push(conv("stem 3x3 s2".into(), (3, c1), 3, 2, 112));
            let mut grouped = conv(format!("grouped 3x3 g64 {c1}x56"), (c1, c1), 3, 1, 56);
            grouped.groups = 64;
            v.push(grouped);
            // (cin, inner, cout, stride, side) of each stage's down block, then its residual.
            let stages = [
                (c1, 128, c1, 2, 56),
                (c1, 128, c1, 1, 28),
                (c1, 256, c2, 2, 28),
                (c2, 256, c2, 1, 14),
                (c2, 512, c2, 2, 14),
                (c2, 256, c2, 1, 7),
            ];
            for (cin, inner, cout, stride, side) in stages {
                let out_side = side / stride;
                let mut dw = conv(
                    format!("dw 3x3 s{stride} {inner}x{side}"),
                    (inner, inner),
                    3,
                    stride,
                    side,
                );
                dw.groups = inner;
                v.push(conv(format!("expand 1x1 {cin}to{inner}x{side}"), (cin, inner), 1, 1, side));
                v.push(dw);
                v.push(conv(
                    format!("project 1x1 {inner}to{cout}x{out_side}"),
                    (inner, cout),
                    1,
                    1,
                    out_side,
                ));
            }
            v.push(conv("conv_sep 1x1 256to512x7".into(), (c2, 512), 1, 1, 7));
            let mut gdc = conv("gdc 7x7 g512".into(), (512, 512), 7, 1, 7);
            (gdc.padding, gdc.groups) = (0, 512);
            v.push(gdc);
            v.push(linear("embed", batch, (512, embedding), false));
            for (c, side) in [(c1, 56), (c1, 28), (c2, 28), (c2, 14), (512, 14), (c2, 7), (512, 7)]
            {
                v.push(per_channel("batch_norm", c, side));
            }
            for (c, side) in [(c1, 56), (c1, 28), (c2, 28), (c2, 14), (512, 14), (512, 7)] {
                v.push(per_channel("prelu", c, side));
            }
            v.push(per_channel("batch_norm", embedding, 1));
            v.push(optimizer("sgd", face_params(net, embedding)?));
        }
    }
    for op in &mut v {
        op.name = op.name.replace(' ', "_");
    }
    let mut seen = std::collections::HashSet::new();
    v.retain(|op| seen.insert(op.name.clone()));
    Ok(v)
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

/// One op's row of the results (`--json`).
#[derive(Serialize, serde::Deserialize, Clone, Debug)]
pub struct OpRow {
    pub kind: String,
    pub name: String,
    pub tandem: Times,
    pub torch: Option<Times>,
    /// 3x3 stride-1 convolutions (Winograd's): forward + backward through im2col + gemm.
    #[serde(default)]
    pub im2col_fwdbwd_ms: Option<f64>,
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
    /// Where the ops ran (`cpu: <model> (<ISA>)` or the device) and on how many threads.
    #[serde(default)]
    pub on: String,
    #[serde(default)]
    pub threads: usize,
}

/// The results as the table `tandem bench ops` prints (and the report shows): a caption line
/// naming the machine, then a markdown table.
pub fn render(r: &ConvResults) -> String {
    let mut out = format!(
        "{} ops at width {}, batch {}, on {} in {}, {} threads, median of {} (ms)\n",
        r.net, r.width, r.batch, r.on, r.dtype, r.threads, r.repeats
    );
    out += "| op | shape | tandem fwd | torch fwd | × torch | tandem fwd+bwd | torch fwd+bwd | × torch | \
            tandem fwd+bwd-data | torch | × torch | tandem fwd+bwd-filter | torch | × torch | \
            tandem fwd+bwd by im2col | Winograd gain |\n\
            |---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n";
    let cell = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.4}"));
    // × torch: how many times faster tandem is (torch time / tandem time).
    let ratio = |ours: Option<f64>, theirs: Option<f64>| match (ours, theirs) {
        (Some(o), Some(t)) => format!("{:.2}", t / o),
        _ => "–".into(),
    };
    for row in &r.ops {
        out += &format!("| {} | {} |", row.kind, row.name);
        for pick in [
            |t: &Times| Some(t.fwd_ms),
            |t: &Times| Some(t.fwdbwd_ms),
            |t: &Times| t.data_ms,
            |t: &Times| t.filter_ms,
        ] {
            let (o, p) = (pick(&row.tandem), row.torch.as_ref().and_then(pick));
            out += &format!(" {} | {} | {} |", cell(o), cell(p), ratio(o, p));
        }
        let gain = row.im2col_fwdbwd_ms.map(|i| format!("{:.2}", i / row.tandem.fwdbwd_ms));
        out += &format!(" {} | {} |\n", cell(row.im2col_fwdbwd_ms), gain.unwrap_or("–".into()));
    }
    out
}

/// One op's row from the PyTorch peer (its `RESULT {json}` line).
#[derive(serde::Deserialize)]
struct PeerOp {
    name: String,
    #[serde(flatten)]
    times: Times,
    sum: f64,
    abs_sum: f64,
}

fn torch_ops(
    ops: &[OpSpec],
    (batch, repeats): (usize, usize),
    (device, dtype): (&str, &str),
    python: &PathBuf,
) -> anyhow::Result<HashMap<String, (Times, Checksum)>> {
    let script = crate::report::repo_root().join(crate::PEERS_DIR).join("torch_ops.py");
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
    let rows: Vec<PeerOp> = crate::local_ranks::results(&text, &script.display().to_string())?;
    let row = |PeerOp { name, times, sum, abs_sum }| (name, (times, Checksum { sum, abs_sum }));
    Ok(rows.into_iter().map(row).collect())
}

pub fn main(a: Args) -> anyhow::Result<i32> {
    let batch = a.batch.unwrap_or(match a.net {
        Net::Resnet18 => 32,
        Net::Iresnet18 | Net::VitT => 8,
        Net::Mbf => 16,
    });
    anyhow::ensure!(
        batch > 0 && a.width > 0 && a.embedding > 0,
        "--batch, --width and --embedding must be at least 1"
    );
    let mut ops = ops(a.net, a.width, batch, a.embedding)?;
    if let Some(part) = &a.only {
        ops.retain(|op| op.name.contains(part.as_str()));
        anyhow::ensure!(
            !ops.is_empty(),
            "--only {part}: no op of {} has it in its name",
            a.net.title()
        );
    }
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
    if let Some(m) = &torch {
        // Same inputs on both sides: a forward (or a step) that sums differently is another op.
        let rel = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
        for (op, t) in ops.iter().zip(&timed) {
            let Some((_, theirs)) = m.get(&op.name) else {
                anyhow::bail!("the PyTorch peer printed no timing for op {}", op.name)
            };
            anyhow::ensure!(
                t.checksum.agrees(*theirs, rel),
                "op {}: tandem and PyTorch computed different values (sum {} vs {}, magnitudes \
                 {} vs {}): the two sides do not time the same op",
                op.name,
                t.checksum.sum,
                theirs.sum,
                t.checksum.abs_sum,
                theirs.abs_sum
            );
        }
    }
    let on = if dev.is_cpu() {
        format!("cpu: {}", crate::report::machine::host_cpu())
    } else {
        a.device.clone()
    };
    let rows = ops
        .iter()
        .zip(&timed)
        .map(|(op, t)| OpRow {
            kind: op.kind.to_string(),
            name: op.name.clone(),
            tandem: t.times,
            torch: torch.as_ref().and_then(|m| m.get(&op.name)).map(|(t, _)| *t),
            im2col_fwdbwd_ms: t.im2col_fwdbwd_ms,
        })
        .collect();
    let results = ConvResults {
        net: a.net.title().to_string(),
        width: a.width,
        batch,
        device: a.device.clone(),
        dtype: a.dtype.clone(),
        repeats: a.repeats,
        ops: rows,
        on,
        threads: rayon::current_num_threads(),
    };
    print!("{}", render(&results));
    if let Some(path) = &a.json {
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
        for net in [Net::Resnet18, Net::Iresnet18, Net::VitT, Net::Mbf] {
            let ops = ops(net, 16, 8, 128).unwrap();
            let mut names: Vec<&str> = ops.iter().map(|o| o.name.as_str()).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), ops.len(), "{net:?}: duplicate op names");
            assert!(ops.iter().all(|o| !o.name.contains(' ')));
        }
        let iresnet = ops(Net::Iresnet18, 16, 8, 128).unwrap();
        let stage4 = iresnet.iter().find(|o| o.name == "layer4_3x3_s1").unwrap();
        assert_eq!((stage4.c_in, stage4.side), (128, 7), "the last stage runs at 7x7");
        assert!(iresnet.iter().any(|o| o.kind == "prelu"));
        assert!(!ops(Net::Resnet18, 16, 8, 128).unwrap()[0].input_grad, "the stem's input is data");
        let vit = ops(Net::VitT, 16, 8, 128).unwrap();
        let qkv = vit.iter().find(|o| o.name.starts_with("qkv")).unwrap();
        assert_eq!(
            (qkv.rows, qkv.c_in, qkv.c_out),
            (8 * 129, 256, 768),
            "129 kept tokens a sample"
        );
        let sgd = vit.iter().find(|o| o.kind == "sgd").unwrap();
        let params: usize = sgd.numels.iter().sum();
        assert!(
            (19_000_000..20_000_000).contains(&params),
            "vit_t has ~19.5M parameters: {params}"
        );
        let mbf = ops(Net::Mbf, 16, 16, 128).unwrap();
        let dw = mbf.iter().filter(|o| o.kind == "conv2d" && o.groups == o.c_in && o.c_in > 1);
        assert_eq!(dw.count(), 7, "six depthwise stages and the GDC");
    }
}
