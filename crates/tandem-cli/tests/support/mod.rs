//! Helpers for the reliability suite (crates/tandem-cli/tests/reliability.rs): a seeded RNG whose
//! seed goes into every failure message, child processes with captured output and a deadline,
//! finding a launcher's rank processes through /proc, SIGKILL, the orphan check by a per-trial
//! environment marker, and the per-scenario tally that prints the `reliability:` summary lines.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::{Duration, Instant};
use tandem_testutil::children_of;
#[allow(unused_imports)] // (not every test program that uses this module needs them)
pub use tandem_testutil::procs::{
    environ, leftovers, marked_processes, marked_processes_with, sigkill, MARKER_VAR,
};
#[allow(unused_imports)]
pub use tandem_testutil::Rng;

pub fn tandem_exe() -> &'static str {
    env!("CARGO_BIN_EXE_tandem")
}

/// `tandem` with no world inherited from an outer launcher.
pub fn tandem() -> Command {
    let mut c = Command::new(tandem_exe());
    clean_env(&mut c);
    c
}

/// Removes every variable through which an outer launcher could describe a world.
pub fn clean_env(c: &mut Command) {
    tandem_testutil::without_world(c);
}

/// The suite's base seed: `RELIABILITY_SEED` or a fixed default, so CI runs are reproducible.
pub fn base_seed() -> u64 {
    std::env::var("RELIABILITY_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20261121)
}

/// Trials for a scenario: the count, or `RELIABILITY_TRIALS` (for quick local runs).
pub fn trials(default: usize) -> usize {
    std::env::var("RELIABILITY_TRIALS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

#[allow(unused_imports)] // (not every test program that uses this module needs them)
pub use tandem_testutil::{Finished, Running};

/// The live children of `launcher` that carry a `RANK` variable, as (rank, pid), sorted by rank.
pub fn rank_pids(launcher: i32) -> Vec<(u32, i32)> {
    let mut out = Vec::new();
    for (pid, _) in children_of(launcher).into_iter().filter(|(_, s)| !s.is_dead()) {
        if let Some(r) =
            environ(pid).iter().find_map(|v| v.strip_prefix("RANK=").and_then(|r| r.parse().ok()))
        {
            out.push((r, pid));
        }
    }
    out.sort();
    out
}

/// Polls until `launcher` has `n` rank children (None past `limit`).
pub fn wait_for_ranks(launcher: i32, n: usize, limit: Duration) -> Option<Vec<(u32, i32)>> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let r = rank_pids(launcher);
        if r.len() == n {
            return Some(r);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// Counts a scenario's trials, keeps each failure's description (with its seed), prints the
/// `reliability:` summary line and fails the test when any trial failed.
pub struct Tally {
    scenario: String,
    pub trials: usize,
    pub failures: Vec<String>,
    pub extra: Vec<(String, String)>,
}

impl Tally {
    pub fn new(scenario: &str) -> Tally {
        Tally { scenario: scenario.to_string(), trials: 0, failures: Vec::new(), extra: Vec::new() }
    }

    /// Records one trial: `Ok` passes, `Err(why)` fails with `why` (which should hold the seed).
    pub fn record(&mut self, result: Result<(), String>) {
        self.trials += 1;
        if let Err(why) = result {
            eprintln!("reliability: {} trial {} FAILED: {why}", self.scenario, self.trials);
            self.failures.push(why);
        }
    }

    pub fn note(&mut self, key: &str, value: impl std::fmt::Display) {
        self.extra.push((key.to_string(), value.to_string()));
    }

    pub fn passed(&self) -> usize {
        self.trials - self.failures.len()
    }

    /// A scenario that cannot run here (the harness prints `skipped: <test>: <reason>`): a
    /// `reliability: <scenario> skipped reason=...` summary line that the table shows as skipped.
    pub fn skipped(scenario: &str, reason: &str) {
        append_summary(&format!("reliability: {scenario} skipped reason={reason}"));
    }

    /// Prints `reliability: <scenario> trials=N passed=M k=v ...` and panics on any failure.
    pub fn finish(self) {
        let mut line = format!(
            "reliability: {} trials={} passed={}",
            self.scenario,
            self.trials,
            self.passed()
        );
        for (k, v) in &self.extra {
            line.push_str(&format!(" {k}={v}"));
        }
        println!("{line}");
        append_summary(&line);
        assert!(
            self.failures.is_empty(),
            "{} of {} trials failed:\n{}",
            self.failures.len(),
            self.trials,
            self.failures.join("\n\n")
        );
    }
}

/// Appends a line to `$RELIABILITY_SUMMARY` (scripts/reliability.sh builds its table from it).
fn append_summary(line: &str) {
    use std::io::Write;
    if let Some(path) = std::env::var_os("RELIABILITY_SUMMARY") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// The model weights of a `.pt` / `.safetensors` file as (key, raw bytes), sorted by key.
pub fn weight_bytes(path: &Path) -> Result<Vec<(String, Vec<u8>)>, String> {
    let v = tandem::ckpt::load(path).map_err(|e| format!("loading {}: {e}", path.display()))?;
    let dict = v.as_dict().ok_or_else(|| format!("{} is not a dict", path.display()))?;
    let mut out = Vec::new();
    for (k, t) in dict {
        let k = k.as_str().ok_or("non-string key")?.to_string();
        let t = t.as_tensor().ok_or_else(|| format!("{k} is not a tensor"))?;
        out.push((k, t.contiguous_bytes().into_owned()));
    }
    out.sort();
    Ok(out)
}

/// Err naming the first differing key when two weight files are not bitwise equal.
pub fn same_weights(a: &Path, b: &Path) -> Result<(), String> {
    let (x, y) = (weight_bytes(a)?, weight_bytes(b)?);
    if x.len() != y.len() {
        return Err(format!(
            "{} has {} tensors, {} has {}",
            a.display(),
            x.len(),
            b.display(),
            y.len()
        ));
    }
    for ((kx, bx), (ky, by)) in x.iter().zip(&y) {
        if kx != ky || bx != by {
            return Err(format!("`{kx}` differs between {} and {}", a.display(), b.display()));
        }
    }
    Ok(())
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

pub fn pathbuf(p: &Path, rel: &str) -> PathBuf {
    p.join(rel)
}

/// The weights of a saved state dict, sorted by name, as f64 (for comparing runs).
pub fn weights(path: &Path) -> Vec<(String, Vec<f64>)> {
    let v = tandem::ckpt::load(path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let mut out: Vec<(String, Vec<f64>)> = v
        .as_dict()
        .expect("a state dict")
        .iter()
        .map(|(k, t)| (k.as_str().unwrap().to_string(), t.as_tensor().unwrap().to_f64_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Waits until `dir` holds a finished checkpoint (`checkpoint-*.pt`), up to `limit`.
pub fn wait_for_checkpoint(dir: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        let found = std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("checkpoint-") && n.ends_with(".pt")
        });
        if found {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// `tandem train` arguments for a run long enough to kill a worker after its first checkpoint
/// (every 5 steps) and resume it from `out`; the final weights go to `fin`.
pub fn restartable_train_args(out: &Path, fin: &Path) -> Vec<String> {
    let (out, fin) = (out.to_str().unwrap(), fin.to_str().unwrap());
    [
        "train",
        "--epochs",
        "4",
        "--hidden",
        "16",
        "--batch-size",
        "4",
        "--data",
        "digits",
        "--save-every",
        "5",
        "--resume",
        "--out",
        out,
        "--save-final",
        fin,
    ]
    .map(String::from)
    .to_vec()
}
