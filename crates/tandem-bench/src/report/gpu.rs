//! `tandem bench report --gpu DIR`: the GPU section of BENCHMARKS.md from what
//! `scripts/gpu/validate.sh` left in its output directory on the device machine, without running
//! anything. The script's stages each leave a file there:
//!
//! - `env.txt`: `key=value` lines (GPU, driver, CUDA, torch, cuDNN, date, dry run or not);
//! - `stages.tsv`: `name <TAB> exit code <TAB> seconds` per stage, in order;
//! - `twins.log`: the CUDA-vs-CPU twin tests' output (its `N passed; M failed` line);
//! - `face.json` ([`FaceResults`]), `conv.json` ([`ConvResults`]), `resnet18-f32.json` and
//!   `resnet18-f16.json` (`tandem bench ddp --json`);
//! - `busy.txt`: `nvidia-smi` GPU utilisation samples (percent, one per line) taken while the face
//!   recipe trained: the share of time a kernel was running;
//! - `profile.log`: a `TANDEM_PROFILE=ops` run's device time per op.
//!
//! A stage that failed or timed out leaves its file missing or partial; the section says so
//! instead of failing. The section goes between two markers in BENCHMARKS.md, so the full report
//! (which includes `gpu_validate.md`) and this command can each rewrite it.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde_json::{json, Value};

use crate::face::FaceResults;
use crate::ops::{ConvResults, Times};

use super::stats::Summary;

/// Where the section starts and ends in BENCHMARKS.md.
pub const BEGIN: &str = "<!-- gpu-validate:begin -->";
pub const END: &str = "<!-- gpu-validate:end -->";
/// The section's own file beside BENCHMARKS.md (what the full report includes).
pub const SECTION_FILE: &str = "gpu_validate.md";

/// One stage of the script's run.
#[derive(Debug, Clone, PartialEq)]
struct Stage {
    name: String,
    exit: i32,
    seconds: f64,
}

/// Everything read from a results directory.
#[derive(Debug, Default)]
struct Results {
    env: Vec<(String, String)>,
    stages: Vec<Stage>,
    /// Passed, failed, ignored (skipped).
    twins: Option<(usize, usize, usize)>,
    face: Option<FaceResults>,
    conv: Option<ConvResults>,
    resnet: Vec<(String, Value)>,
    busy: Vec<f64>,
    profile: Option<String>,
}

fn read_opt(dir: &Path, name: &str) -> anyhow::Result<Option<String>> {
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// A JSON file of the results, or `None` when the stage left none; a malformed one is an error
/// naming it.
fn read_json<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> anyhow::Result<Option<T>> {
    let Some(text) = read_opt(dir, name)? else { return Ok(None) };
    if text.trim().is_empty() {
        return Ok(None);
    }
    serde_json::from_str(&text)
        .map(Some)
        .with_context(|| format!("{}: not the JSON its stage writes", dir.join(name).display()))
}

fn parse_stages(text: &str, file: &Path) -> anyhow::Result<Vec<Stage>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let f: Vec<&str> = line.split('\t').collect();
            let bad =
                || format!("{} line {}: expected NAME<TAB>EXIT<TAB>SECONDS", file.display(), i + 1);
            anyhow::ensure!(f.len() == 3, bad());
            Ok(Stage {
                name: f[0].to_string(),
                exit: f[1].trim().parse().with_context(bad)?,
                seconds: f[2].trim().parse().with_context(bad)?,
            })
        })
        .collect()
}

/// The `N passed; M failed; K ignored` of the twin tests' summary line.
fn parse_twins(log: &str) -> Option<(usize, usize, usize)> {
    let line = log.lines().rev().find(|l| l.contains("passed;") && l.contains("failed"))?;
    let count = |word: &str| -> Option<usize> {
        let before = &line[..line.find(word)?];
        before.split_whitespace().last()?.trim_start_matches("ok.").parse().ok()
    };
    Some((count(" passed")?, count(" failed")?, count(" ignored").unwrap_or(0)))
}

fn read(dir: &Path) -> anyhow::Result<Results> {
    let mut r = Results::default();
    if let Some(env) = read_opt(dir, "env.txt")? {
        r.env = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
    }
    if let Some(t) = read_opt(dir, "stages.tsv")? {
        r.stages = parse_stages(&t, &dir.join("stages.tsv"))?;
    }
    r.twins = read_opt(dir, "twins.log")?.as_deref().and_then(parse_twins);
    r.face = read_json(dir, "face.json")?;
    r.conv = read_json(dir, "conv.json")?;
    for precision in ["f32", "f16"] {
        let name = format!("resnet18-{precision}.json");
        if let Some(v) = read_json::<Value>(dir, &name)? {
            r.resnet.push((precision.to_string(), v));
        }
    }
    if let Some(t) = read_opt(dir, "busy.txt")? {
        r.busy =
            t.lines().filter_map(|l| l.trim().trim_end_matches('%').trim().parse().ok()).collect();
    }
    r.profile = read_opt(dir, "profile.log")?;
    if r.stages.is_empty() && r.env.is_empty() {
        anyhow::bail!(
            "{}: no stages.tsv or env.txt: not an output directory of scripts/gpu/validate.sh",
            dir.display()
        );
    }
    Ok(r)
}

fn env<'a>(r: &'a Results, key: &str) -> &'a str {
    r.env.iter().find(|(k, _)| k == key).map_or("?", |(_, v)| v.as_str())
}

fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// `min / median / max`, or a dash.
fn spread(values: &[f64], digits: usize) -> String {
    Summary::of(values).map_or("–".into(), |s| {
        format!("{:.d$} / {:.d$} / {:.d$}", s.min, s.median, s.max, d = digits)
    })
}

fn median(values: &[f64]) -> Option<f64> {
    Summary::of(values).map(|s| s.median)
}

/// The section's markdown.
fn render(r: &Results) -> String {
    let mut out = String::new();
    let dry = env(r, "dry_run") == "1";
    let _ = writeln!(out, "## GPU: scripts/gpu/validate.sh\n");
    if dry {
        let _ = writeln!(
            out,
            "**A dry run on the CPU** (`scripts/gpu/validate.sh --dry-run`, as CI runs it): every \
             stage at a toy size, so the figures below check the script and this report, not a GPU.\n"
        );
    }
    let _ = writeln!(
        out,
        "{} · driver {} · CUDA {} · torch {} · cuDNN {} · {}\n",
        env(r, "gpu"),
        env(r, "driver"),
        env(r, "cuda"),
        env(r, "torch"),
        env(r, "cudnn"),
        env(r, "date")
    );
    let _ = writeln!(out, "| stage | exit | seconds |\n|---|--:|--:|");
    for s in &r.stages {
        let exit = match s.exit {
            0 => "0".to_string(),
            124 | 137 => format!("{} (timed out)", s.exit),
            e => e.to_string(),
        };
        let _ = writeln!(out, "| {} | {exit} | {:.0} |", s.name, s.seconds);
    }
    out.push('\n');
    match r.twins {
        Some((p, f, i)) => {
            let skipped =
                if i > 0 { format!(", {i} skipped (see twins.log)") } else { String::new() };
            let _ = writeln!(
                out,
                "CUDA paths against their CPU twins: **{p} passed, {f} failed**{skipped}.\n"
            );
        }
        None => {
            let _ =
                writeln!(out, "CUDA paths against their CPU twins: no summary (see twins.log).\n");
        }
    }
    render_face(&mut out, r);
    render_conv(&mut out, r);
    render_resnet(&mut out, r);
    if let Some(m) = median(&r.busy) {
        let _ = writeln!(
            out,
            "Kernels busy (nvidia-smi utilisation while the face recipe trained, {} samples): \
             median {m:.0}%, mean {:.0}% (goal ≥ 90%).\n",
            r.busy.len(),
            r.busy.iter().sum::<f64>() / r.busy.len() as f64
        );
    } else {
        let _ =
            writeln!(out, "Kernels busy: not sampled (no nvidia-smi, or the stage did not run).\n");
    }
    if let Some(p) = &r.profile {
        let table: Vec<&str> =
            p.lines().skip_while(|l| !l.starts_with("device time by op")).take(16).collect();
        if !table.is_empty() {
            let _ = writeln!(
                out,
                "Device time per op (`TANDEM_PROFILE=ops`, rank 0):\n\n```\n{}\n```\n",
                table.join("\n")
            );
        }
    }
    out
}

fn render_face(out: &mut String, r: &Results) {
    let Some(f) = &r.face else {
        let _ = writeln!(out, "Face recipe: no results (see face.log).\n");
        return;
    };
    let _ = writeln!(
        out,
        "### Face recipe: {} width {}, {}-d, PartialFC {} classes at {}, {} rank(s) x batch {}, {}, \
         {} steps ({} warm-up untimed)\n",
        f.model, f.width, f.embedding, f.classes, f.sample_rate, f.nproc, f.batch, f.precision,
        f.steps, f.warmup_steps
    );
    let _ = writeln!(
        out,
        "| | samples/s min / median / max | peak GPU memory (GiB) | peak host memory (GiB) |\n|---|--:|--:|--:|"
    );
    for (name, s) in [("tandem", &f.tandem), ("PyTorch", &f.torch)] {
        let gpu: Vec<f64> = s.device_peak.iter().map(|&b| gib(b)).collect();
        let host: Vec<f64> = s.peak_rss.iter().map(|&b| gib(b)).collect();
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} |",
            spread(&s.samples_per_s, 1),
            spread(&gpu, 2),
            spread(&host, 2)
        );
    }
    if let (Some(a), Some(b)) = (median(&f.tandem.samples_per_s), median(&f.torch.samples_per_s)) {
        let _ = write!(out, "\ntandem / PyTorch: samples/s **{:.2}x** (goal ≥ 1.2x)", a / b);
        if let (Some(a), Some(b)) = (median(&f.tandem.device_peak), median(&f.torch.device_peak)) {
            let _ = write!(out, ", peak GPU memory **{:.2}x** (goal ≤ 1.0x)", a / b);
        }
        out.push_str(".\n");
    }
    for (name, s) in [("tandem", &f.tandem), ("PyTorch", &f.torch)] {
        if !s.breakdown.is_empty() {
            let _ = writeln!(out, "\n- {name}: {}", s.breakdown);
        }
    }
    out.push('\n');
}

fn render_conv(out: &mut String, r: &Results) {
    let Some(c) = &r.conv else {
        let _ = writeln!(out, "Per op: no results (see conv.log).\n");
        return;
    };
    let _ = writeln!(
        out,
        "### Per op: {} shapes at width {}, batch {}, {} (median ms of {}; × = PyTorch's time / tandem's)\n",
        c.net, c.width, c.batch, c.dtype, c.repeats
    );
    let _ = writeln!(
        out,
        "| op | fwd | × | fwd + bwd-data | × | fwd + bwd-filter | × | fwd + both | × |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    let picks: [fn(&Times) -> Option<f64>; 4] =
        [|t| Some(t.fwd_ms), |t| t.data_ms, |t| t.filter_ms, |t| Some(t.fwdbwd_ms)];
    let (mut convs, mut within) = (0, 0);
    for op in &c.ops {
        let _ = write!(out, "| {} |", op.name);
        for pick in picks {
            let ours = pick(&op.tandem);
            let theirs = op.torch.as_ref().and_then(pick);
            let cell = ours.map_or("–".into(), |v| format!("{v:.3}"));
            let ratio = match (ours, theirs) {
                (Some(o), Some(t)) => format!("{:.2}", t / o),
                _ => "–".into(),
            };
            let _ = write!(out, " {cell} | {ratio} |");
        }
        out.push('\n');
        if op.kind == "conv2d" {
            convs += 1;
            // The goal: forward + both backwards within 1.1x of PyTorch's time.
            if let Some(t) = &op.torch {
                if op.tandem.fwdbwd_ms <= 1.1 * t.fwdbwd_ms {
                    within += 1;
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "\nConvolutions whose forward + both backwards are within 1.1x of PyTorch's time: \
         **{within} of {convs}** (goal: all).\n"
    );
}

fn render_resnet(out: &mut String, r: &Results) {
    if r.resnet.is_empty() {
        let _ = writeln!(out, "CIFAR ResNet-18: no results (see resnet18-*.log).\n");
        return;
    }
    let _ = writeln!(
        out,
        "### CIFAR ResNet-18, 1 rank (goal ≥ 1.0x PyTorch)\n\n| precision | batch | tandem samples/s | PyTorch samples/s | tandem / PyTorch |\n|---|--:|--:|--:|--:|"
    );
    for (precision, v) in &r.resnet {
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let cell = |x: Option<f64>| x.map_or("–".into(), |x| format!("{x:.1}"));
        let _ = writeln!(
            out,
            "| {precision} | {} | {} | {} | {} |",
            v.get("global_batch").map_or("?".into(), Value::to_string),
            cell(num("ddpN_samples_per_s")),
            cell(num("torch_ddp_samples_per_s")),
            num("ddpN_over_torch").map_or("–".into(), |x| format!("**{x:.2}x**"))
        );
    }
    out.push('\n');
}

/// Everything read, as one JSON object (`validate.json`).
fn combined(r: &Results) -> Value {
    json!({
        "env": r.env.iter().map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect::<serde_json::Map<_, _>>(),
        "stages": r.stages.iter().map(|s| json!({"name": s.name, "exit": s.exit, "seconds": s.seconds})).collect::<Vec<_>>(),
        "twins": r.twins.map(|(p, f, i)| json!({"passed": p, "failed": f, "ignored": i})),
        "face": r.face,
        "conv": r.conv,
        "resnet18": r.resnet.iter().map(|(p, v)| (p.clone(), v.clone())).collect::<serde_json::Map<_, _>>(),
        "busy_percent": r.busy,
    })
}

/// `text` with the section between the markers replaced by `section` (appended when absent).
fn splice(text: &str, section: &str) -> String {
    let block = format!("{BEGIN}\n{section}{END}\n");
    match (text.find(BEGIN), text.find(END)) {
        (Some(a), Some(b)) if a < b => {
            format!("{}{block}{}", &text[..a], text[b + END.len()..].trim_start_matches('\n'))
        }
        _ if text.is_empty() => block,
        _ => format!("{}\n\n{block}", text.trim_end()),
    }
}

/// The section wrapped in its markers, for the full report.
pub fn wrapped(section: &str) -> String {
    splice("", section)
}

/// `tandem bench report --gpu DIR`: writes `OUT/gpu_validate.md`, puts it into
/// `OUT/BENCHMARKS.md` and writes `DIR/validate.json`.
pub fn main(dir: &Path, out: &Path) -> anyhow::Result<i32> {
    let r = read(dir)?;
    let section = render(&r);
    std::fs::create_dir_all(out).with_context(|| format!("--out: creating {}", out.display()))?;
    let file = out.join(SECTION_FILE);
    std::fs::write(&file, &section).with_context(|| format!("writing {}", file.display()))?;
    let md = out.join("BENCHMARKS.md");
    let old = read_opt(out, "BENCHMARKS.md")?.unwrap_or_default();
    std::fs::write(&md, splice(&old, &section))
        .with_context(|| format!("writing {}", md.display()))?;
    let json_path = dir.join("validate.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&combined(&r))?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    print!("{section}");
    eprintln!("wrote {}, {} and {}", file.display(), md.display(), json_path.display());
    Ok(if r.stages.iter().any(|s| s.exit != 0) { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_section_replaces_its_old_self_and_nothing_else() {
        let first = splice("# Benchmarks\n\nintro\n", "A\n");
        assert_eq!(first, format!("# Benchmarks\n\nintro\n\n{BEGIN}\nA\n{END}\n"));
        let tail = format!("{first}\n## Later\n");
        let second = splice(&tail, "B\n");
        assert_eq!(second, format!("# Benchmarks\n\nintro\n\n{BEGIN}\nB\n{END}\n## Later\n"));
        assert_eq!(splice("", "C\n"), format!("{BEGIN}\nC\n{END}\n"));
    }

    #[test]
    fn stages_and_the_twins_summary_parse_and_bad_lines_are_named() {
        let p = Path::new("stages.tsv");
        let s = parse_stages("env\t0\t1\nface\t124\t280.5\n", p).unwrap();
        assert_eq!(s[1], Stage { name: "face".into(), exit: 124, seconds: 280.5 });
        let e = parse_stages("env 0 1\n", p).unwrap_err().to_string();
        assert!(e.contains("stages.tsv line 1"), "{e}");
        let log = "running 14 tests\n...\ntest result: FAILED. 12 passed; 2 failed; 0 ignored\n";
        assert_eq!(parse_twins(log), Some((12, 2, 0)));
        let skipped = "test result: ok. 0 passed; 0 failed; 15 ignored; 0 measured";
        assert_eq!(parse_twins(skipped), Some((0, 0, 15)));
        assert_eq!(parse_twins("no summary"), None);
    }

    #[test]
    fn a_results_directory_renders_with_its_goals_and_a_missing_stage_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("env.txt"), "gpu=NVIDIA H200\ndriver=580\ndry_run=0\n").unwrap();
        std::fs::write(d.join("stages.tsv"), "twins\t0\t20\nface\t0\t250\n").unwrap();
        std::fs::write(d.join("twins.log"), "test result: ok. 16 passed; 0 failed; 0 ignored\n")
            .unwrap();
        let face = FaceResults {
            model: "iresnet50".into(),
            tandem: crate::face::SideResults {
                samples_per_s: vec![300.0, 310.0],
                device_peak: vec![8e9, 8e9],
                ..Default::default()
            },
            torch: crate::face::SideResults {
                samples_per_s: vec![250.0, 248.0],
                device_peak: vec![9e9, 9e9],
                ..Default::default()
            },
            ..Default::default()
        };
        std::fs::write(d.join("face.json"), serde_json::to_string(&face).unwrap()).unwrap();
        std::fs::write(d.join("busy.txt"), "91\n95 %\n88\n").unwrap();
        let out = d.join("docs");
        assert_eq!(main(d, &out).unwrap(), 0);
        let md = std::fs::read_to_string(out.join("BENCHMARKS.md")).unwrap();
        assert!(md.contains("NVIDIA H200"), "{md}");
        assert!(md.contains("**16 passed, 0 failed**"), "{md}");
        // Medians 305 / 249 = 1.22x; memory 8e9 / 9e9 = 0.89x.
        assert!(md.contains("samples/s **1.22x**"), "{md}");
        assert!(md.contains("peak GPU memory **0.89x**"), "{md}");
        assert!(md.contains("median 91%"), "{md}");
        assert!(md.contains("Per op: no results (see conv.log)"), "{md}");
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("validate.json")).unwrap())
                .unwrap();
        assert_eq!(v["twins"]["passed"], 16);
        assert_eq!(v["face"]["tandem"]["samples_per_s"][1], 310.0);
        // A malformed results file is named.
        std::fs::write(d.join("conv.json"), "{").unwrap();
        let e = format!("{:#}", main(d, &out).unwrap_err());
        assert!(e.contains("conv.json"), "{e}");
    }
}
