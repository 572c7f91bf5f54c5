//! PyTorch's side of the report: finding a Python that imports torch, and running the peer
//! scripts in `scripts/peers/` (gloo all_reduce, DDP training) on the same work as tandem.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;

use super::child::stdout_of;

/// The exact words the report puts where a PyTorch figure would be when torch is missing.
pub const UNAVAILABLE: &str = "PyTorch not available";

pub struct Torch {
    pub python: PathBuf,
    pub version: String,
}

/// The first of the candidates that imports torch, with its version; the reasons the others
/// were rejected otherwise (the report prints them).
pub fn find(candidates: &[PathBuf]) -> Result<Torch, String> {
    let mut why = Vec::new();
    for py in candidates {
        let mut cmd = Command::new(py);
        cmd.args(["-c", "import torch; print(torch.__version__)"]);
        match stdout_of(
            &mut cmd,
            Duration::from_secs(180),
            &format!("{} -c 'import torch'", py.display()),
        ) {
            Ok(out) => return Ok(Torch { python: py.clone(), version: out.trim().to_string() }),
            Err(e) => why.push(e.to_string().lines().next().unwrap_or_default().to_string()),
        }
    }
    Err(why.join("; "))
}

fn number_after(text: &str, key: &str, suffix: &str) -> Option<f64> {
    text.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_suffix(suffix)?.parse().ok())
}

/// gloo all_reduce busbw in GB/s (1e9 B/s) for `world` ranks and `mib` MiB. The peer prints
/// GiB/s with two decimals; converted here.
pub fn gloo_busbw(
    t: &Torch,
    peers: &Path,
    world: usize,
    mib: usize,
    iters: usize,
) -> anyhow::Result<f64> {
    let script = peers.join("torch_allreduce.py");
    let mut cmd = Command::new(&t.python);
    cmd.arg(&script).args([world.to_string(), mib.to_string(), iters.to_string()]);
    let out = stdout_of(
        &mut cmd,
        Duration::from_secs(120),
        &format!("{} (gloo, {mib} MiB)", script.display()),
    )?;
    let gib = number_after(&out, "busbw=", "GiB/s")
        .with_context(|| format!("{}: no busbw=...GiB/s in {out:?}", script.display()))?;
    Ok(gib * (1u64 << 30) as f64 / 1e9)
}

/// PyTorch DDP (gloo, CPU) samples/s with `world` ranks and `per_rank` samples per rank.
pub fn ddp_samples_per_s(
    t: &Torch,
    peers: &Path,
    (world, steps, per_rank): (usize, usize, usize),
    (model, width): (&str, usize),
) -> anyhow::Result<f64> {
    let script = peers.join("torch_ddp_step.py");
    let mut cmd = Command::new(&t.python);
    cmd.arg(&script).args([
        world.to_string(),
        steps.to_string(),
        per_rank.to_string(),
        model.to_string(),
        width.to_string(),
    ]);
    let out = stdout_of(
        &mut cmd,
        Duration::from_secs(180),
        &format!("{} ({world} ranks)", script.display()),
    )?;
    number_after(&out, "samples/s=", "")
        .with_context(|| format!("{}: no samples/s=... in {out:?}", script.display()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_the_peers_output() {
        let line = "torch-gloo world=2 size=1MiB time=2.18ms algbw=0.45GiB/s busbw=0.45GiB/s";
        assert_eq!(super::number_after(line, "busbw=", "GiB/s"), Some(0.45));
        let line = "torch-ddp model=mlp device=cpu world=2 batch/rank=64 samples/s=3327";
        assert_eq!(super::number_after(line, "samples/s=", ""), Some(3327.0));
        assert_eq!(super::number_after("nothing here", "samples/s=", ""), None);
    }
}
