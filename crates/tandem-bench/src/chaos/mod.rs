//! `tandem bench chaos`: a soak of live recovery under faults drawn from a seed. A job of 3
//! simulated hosts x 2 ranks (network namespaces, each host with its own etcd member; the MLP
//! classifier under `tandem run --live-recovery --rdzv-backend etcd`) runs once fault-free and
//! then `--runs` times with `--faults` faults each: worker and launcher SIGKILLs, host 0 lost
//! whole, a link cut for 2–8 s, 10% packet loss, the run's disk full, an etcd member killed.
//! Each run passes when the job finishes within `--limit` (no hang), every launcher ends 0,
//! no process of the job outlives it, every checkpoint left is readable (checksums verified),
//! every rank a fault killed leaves the world in a recorded regroup (the fault is named), and
//! the final eval accuracy is within 0.02 of the fault-free run's (docs/live_recovery.md's
//! tolerance). Results are read from the run's typed metrics file, never from its text.
//!
//! Needs root (namespaces, a tmpfs per run), Debian's `etcd-server`, and the `tandem` binary
//! built with etcd: `cargo build --release -p tandem-cli --features etcd`.
mod plan;
mod site;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tandem::recipes::TrainConfig;
use tandem::train::checkpoint::Saved;
use tandem::train::events::Regroup;
use tandem::train::metrics::{read_metrics, MetricsRecord};

use plan::{schedule, Fault, Planned};
use site::Site;

/// How far a faulted run's eval accuracy may be from the fault-free run's (what
/// docs/live_recovery.md holds kills to).
const ACCURACY_TOLERANCE: f64 = 0.02;

#[derive(clap::Args)]
pub struct Args {
    /// Faulted runs, each with its own seed (run i: --seed + i).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// The first run's seed; a failing run is replayed by its seed alone (--runs 1 --seed S).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Faults per run, spread over its middle (15% to 75% of the fault-free run's time).
    #[arg(long, default_value_t = 4)]
    faults: usize,
    /// Epochs of the job (the MLP classifier on the digits set, 6 ranks: about 40 s
    /// fault-free on a 2-core AMD EPYC).
    #[arg(long, default_value_t = 600)]
    epochs: usize,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 200)]
    save_every: u64,
    /// Seconds a run may take; a run still going then is a hang (its processes are killed).
    #[arg(long, default_value_t = 180.0)]
    limit: f64,
    /// Directory for the runs' logs (default: a fresh one here, removed when every run passed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// End with one JSON line of the totals.
    #[arg(long)]
    json: bool,
}

/// What one run came to.
#[derive(Default)]
struct Outcome {
    wall_s: f64,
    problems: Vec<String>,
    faults_applied: usize,
    faults_named: usize,
    /// Faults applied, per entry of [`Fault::KINDS`].
    kinds: [usize; Fault::KINDS.len()],
    /// Seconds from each fault that killed ranks to the regroup that left them out.
    named_after_s: Vec<f64>,
    regroups: usize,
    checkpoints: usize,
    unreadable: usize,
    leftovers: usize,
    hung: bool,
    eval_accuracy: Option<f64>,
}

pub fn main(a: Args) -> anyhow::Result<i32> {
    if let Some(why) = tandem_testutil::netns::Hosts::unavailable()
        .or_else(tandem_testutil::etcd::etcd_missing)
        .or_else(tandem_testutil::netns::Hosts::loss_unavailable)
    {
        bail!("bench chaos cannot run here: {why}");
    }
    let tandem = crate::tandem_exe()?;
    let failed = crate::in_scratch_dir(a.dir.as_deref(), "bench-chaos", |dir| {
        let reference = run_once(&a, &tandem, dir, 0, None, 0.0)?;
        if !reference.problems.is_empty() {
            bail!("the fault-free run failed: {}", reference.problems.join("; "));
        }
        let acc = reference.eval_accuracy.context("the fault-free run recorded no accuracy")?;
        println!(
            "fault-free: {:.1} s, eval_accuracy {acc:.4}, {} checkpoint(s) readable",
            reference.wall_s, reference.checkpoints
        );
        let mut outcomes = Vec::new();
        for i in 0..a.runs {
            let seed = a.seed + i as u64;
            let o = run_once(&a, &tandem, dir, i + 1, Some((seed, acc)), reference.wall_s)?;
            let verdict = if o.problems.is_empty() { "ok" } else { "FAILED" };
            println!(
                "run {} (seed {seed}): {verdict} in {:.1} s; {}/{} faults named, {} regroup(s), \
                 {}/{} checkpoints readable, {} leftover process(es), eval_accuracy {}",
                i + 1,
                o.wall_s,
                o.faults_named,
                o.faults_applied,
                o.regroups,
                o.checkpoints - o.unreadable,
                o.checkpoints,
                o.leftovers,
                o.eval_accuracy.map_or("none".into(), |x| format!("{x:.4}"))
            );
            for p in &o.problems {
                println!("  problem: {p}");
            }
            outcomes.push(o);
        }
        report(&a, &reference, &outcomes);
        Ok(outcomes.iter().filter(|o| !o.problems.is_empty()).count())
    })?;
    Ok(if failed == 0 { 0 } else { 1 })
}

fn report(a: &Args, reference: &Outcome, outcomes: &[Outcome]) {
    let walls: Vec<f64> = outcomes.iter().map(|o| o.wall_s).collect();
    let max_wall = walls.iter().cloned().fold(0.0, f64::max);
    let finished = outcomes.iter().filter(|o| o.problems.is_empty()).count();
    let sum = |f: fn(&Outcome) -> usize| outcomes.iter().map(f).sum::<usize>();
    println!(
        "chaos: {finished} of {} runs passed; {} hang(s), {} leftover process(es), {} unreadable \
         checkpoint(s); {} of {} faults named; longest run {max_wall:.1} s (fault-free {:.1} s)",
        outcomes.len(),
        outcomes.iter().filter(|o| o.hung).count(),
        sum(|o| o.leftovers),
        sum(|o| o.unreadable),
        sum(|o| o.faults_named),
        sum(|o| o.faults_applied),
        reference.wall_s,
    );
    let kinds: Vec<String> = Fault::KINDS
        .iter()
        .enumerate()
        .map(|(k, name)| format!("{name} x{}", outcomes.iter().map(|o| o.kinds[k]).sum::<usize>()))
        .collect();
    println!("chaos: faults applied: {}", kinds.join(", "));
    let mut delays: Vec<f64> =
        outcomes.iter().flat_map(|o| o.named_after_s.iter().copied()).collect();
    delays.sort_by(f64::total_cmp);
    if let (Some(lo), Some(hi)) = (delays.first(), delays.last()) {
        println!(
            "chaos: seconds from a kill to the regroup that left its ranks out: {lo:.2} / {:.2} / {hi:.2} (min / median / max of {})",
            delays[delays.len() / 2],
            delays.len()
        );
    }
    if a.json {
        let row = serde_json::json!({
            "bench": "chaos",
            "runs": outcomes.len(),
            "passed": finished,
            "hangs": outcomes.iter().filter(|o| o.hung).count(),
            "leftover_processes": sum(|o| o.leftovers),
            "unreadable_checkpoints": sum(|o| o.unreadable),
            "faults_applied": sum(|o| o.faults_applied),
            "faults_named": sum(|o| o.faults_named),
            "max_wall_s": max_wall,
            "fault_free_wall_s": reference.wall_s,
        });
        println!("{row}");
    }
}

/// One run in `dir/run-<index>`: fault-free when `faulted` is `None`, else the schedule of its
/// seed, the accuracy checked against the fault-free one.
fn run_once(
    a: &Args,
    tandem: &Path,
    dir: &Path,
    index: usize,
    faulted: Option<(u64, f64)>,
    reference_wall_s: f64,
) -> anyhow::Result<Outcome> {
    let run_dir = dir.join(format!("run-{index}"));
    let marker = format!("chaos-{}-{index}", std::process::id());
    let mut site = Site::new(&run_dir.join("mnt"), tandem, &marker, "256m")?;
    let cfg = TrainConfig {
        model: tandem::models::ModelKind::Mlp,
        hidden: 16,
        batch_size: 4,
        epochs: a.epochs,
        seed: 11,
        save_every: a.save_every,
        out: Some("out".into()),
        ..TrainConfig::default()
    };
    let cfg_file = site.dir.join("chaos.toml");
    let text = toml::to_string_pretty(&cfg).context("writing the job's settings as TOML")?;
    std::fs::write(&cfg_file, text).with_context(|| format!("writing {}", cfg_file.display()))?;
    let worker = ["train".to_string(), "--config".into(), cfg_file.to_string_lossy().into()];

    let plan: Vec<Planned> = faulted.map_or_else(Vec::new, |(seed, _)| {
        schedule(seed, a.faults, 0.15 * reference_wall_s, 0.75 * reference_wall_s)
    });
    let start = Instant::now();
    let mut outcome = Outcome::default();
    site.start(&worker)?;
    // (fault, seconds since the Unix epoch when it began), for finding its regroups.
    let mut applied: Vec<(Fault, f64)> = Vec::new();
    for p in &plan {
        while start.elapsed().as_secs_f64() < p.at_s && !site.finished() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let at = start.elapsed().as_secs_f64();
        if site.finished() {
            println!("  {at:6.1} s: not applied (the job had ended): {}", p.fault);
            continue;
        }
        let began = unix_now();
        match site.apply(p.fault) {
            Ok(()) => {
                println!("  {at:6.1} s: {}", p.fault);
                applied.push((p.fault, began));
            }
            Err(e) => outcome
                .problems
                .push(format!("at {at:.1} s, {} could not be applied: {e:#}", p.fault)),
        }
    }
    let deadline = start + Duration::from_secs_f64(a.limit);
    if let Err(e) = site.wait(deadline) {
        outcome.hung = true;
        outcome.problems.push(format!("{e:#}"));
    }
    outcome.wall_s = start.elapsed().as_secs_f64();
    outcome.faults_applied = applied.len();
    for (f, _) in &applied {
        outcome.kinds[f.kind()] += 1;
    }
    let left = site.leftovers(Duration::from_secs(3));
    outcome.leftovers = left.len();
    if !left.is_empty() {
        outcome.problems.push(format!("processes of the job outlived it: {left:?}"));
    }
    for e in site.ended().iter().filter(|e| !e.killed_by_fault && e.code != Some(0)) {
        // (Its log is copied out of the run's tmpfs below, beside the others.)
        let log = run_dir.join(e.log.file_name().unwrap_or_default());
        outcome.problems.push(format!(
            "host {}'s launcher ended with {:?} (log: {})",
            e.host,
            e.code,
            log.display()
        ));
    }
    let out = site.dir.join("out");
    check_records(&out, &applied, faulted.map(|(_, acc)| acc), &mut outcome);
    check_checkpoints(&out.join("checkpoints"), &mut outcome);
    keep_logs(&site.dir, &run_dir);
    Ok(outcome)
}

/// The run's typed records: every fault that killed ranks is named by a regroup that left them
/// out (after it began), and the run's final accuracy.
fn check_records(out: &Path, applied: &[(Fault, f64)], reference: Option<f64>, o: &mut Outcome) {
    let records = match read_metrics(&out.join("metrics.jsonl")) {
        Ok(r) => r,
        Err(e) => {
            o.problems.push(format!("the run's metrics: {e}"));
            return;
        }
    };
    let regroups: Vec<&Regroup> = records
        .iter()
        .filter_map(|r| if let MetricsRecord::Regrouped(g) = r { Some(g) } else { None })
        .collect();
    o.regroups = regroups.len();
    for (i, (fault, began)) in applied.iter().enumerate() {
        // Its regroups: from its start until the next fault's, except that the members it
        // killed may still be left out later (the world may still be recovering from it when
        // the next fault comes) — until a later fault kills one of them again.
        let want = fault.members_lost();
        let next = applied.get(i + 1).map_or(f64::INFINITY, |n| n.1);
        let again = applied[i + 1..]
            .iter()
            .find(|(f, _)| f.members_lost().iter().any(|m| want.contains(m)))
            .map_or(f64::INFINITY, |n| n.1);
        let after = |until: f64| {
            regroups.iter().filter(move |g| g.at_unix_s >= *began && g.at_unix_s < until)
        };
        let missing: Vec<usize> = want
            .iter()
            .copied()
            .filter(|m| !after(again).any(|g| g.change.lost.contains(m)))
            .collect();
        let named_after = after(again)
            .find(|g| want.iter().any(|m| g.change.lost.contains(m)))
            .map(|g| g.at_unix_s - began);
        let what: Vec<String> = after(next).map(|g| format!("{}", g.change)).collect();
        let response = if what.is_empty() { "no regroup".into() } else { what.join(" | ") };
        let delay = named_after.map_or(String::new(), |s| format!(" (left out after {s:.1} s)"));
        println!("    fault {}: {fault}{delay} -> {response}", i + 1);
        if missing.is_empty() {
            o.faults_named += 1;
            o.named_after_s.extend(named_after);
        } else {
            o.problems.push(format!("{fault}: no regroup left out member(s) {missing:?}"));
        }
    }
    let summary = records.iter().rev().find_map(|r| match r {
        MetricsRecord::Summary(s) => s.eval_accuracy,
        _ => None,
    });
    o.eval_accuracy = summary;
    match (summary, reference) {
        (None, _) => o.problems.push("the run recorded no final accuracy".into()),
        (Some(acc), Some(want)) if (acc - want).abs() > ACCURACY_TOLERANCE => {
            o.problems.push(format!(
                "eval_accuracy {acc:.4}, fault-free {want:.4} (tolerance {ACCURACY_TOLERANCE})"
            ))
        }
        _ => {}
    }
}

/// Every checkpoint left in `dir` opens with its checksums verified (a sharded one: every
/// rank's file read); unfinished writes (`*.tmp`) are not checkpoints.
fn check_checkpoints(dir: &Path, o: &mut Outcome) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        o.problems.push(format!("no checkpoint directory {}", dir.display()));
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("checkpoint-") || name.ends_with(".tmp") {
            continue;
        }
        o.checkpoints += 1;
        let read =
            Saved::open(&path)
                .and_then(|s| if path.is_dir() { s.inspect().map(drop) } else { Ok(()) });
        if let Err(e) = read {
            o.unreadable += 1;
            o.problems.push(format!("checkpoint {} unreadable: {e}", path.display()));
        }
    }
    if o.checkpoints == 0 {
        o.problems.push(format!("no checkpoint in {}", dir.display()));
    }
}

/// Copies the launchers' logs and the metrics file out of the run's tmpfs into `to`.
fn keep_logs(from: &Path, to: &Path) {
    let files = std::fs::read_dir(from).into_iter().flatten().flatten().map(|e| e.path());
    for f in files.chain([from.join("out").join("metrics.jsonl")]) {
        let keep = f.extension().is_some_and(|x| x == "log" || x == "jsonl");
        if let (true, Some(name)) = (keep, f.file_name()) {
            let _ = std::fs::copy(&f, to.join(name));
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}
