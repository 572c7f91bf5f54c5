//! `tandem bench live`: what live recovery costs. The same `tandem train` job runs on `--nproc`
//! ranks under `tandem run --live-recovery`, once uninterrupted and once with a worker killed
//! (SIGKILL) every `--kill-every` seconds, in rounds of one each (which goes first alternating
//! from round to round). Reported: wall-clock samples/s
//! retained (same epochs, so the same samples, both ways), steps redone per failure (from the
//! regroup lines), the time from each kill to training again (the first regroup line after it,
//! as this process reads the job's output), and the final eval loss and accuracy beside the
//! uninterrupted runs' spread. `--recipe face` runs the face recipe (IResNet-18 + PartialFC on a
//! synthetic identity set, a head of `--classes` rows) and adds the head's figures: rows
//! restored from mirrors and reloaded, head training lost (row-steps), the mirror's bytes and
//! time, and the verification accuracy.
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tandem::launch::WATCHDOG_NAME;
use tandem::recipes::face::HEAD_ROWS;
use tandem::recipes::TrainConfig;
use tandem::train::events::Regroup;
use tandem::train::metrics::{read_metrics, MetricsRecord};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Recipe {
    /// The MLP classifier on the digits set.
    Mlp,
    /// IResNet-18 (width 8, 32-d embeddings) + PartialFC on a synthetic identity set.
    Face,
}

#[derive(clap::Args)]
pub struct Args {
    /// The job: the MLP classifier or the face recipe.
    #[arg(long, value_enum, default_value_t = Recipe::Mlp)]
    recipe: Recipe,
    /// Face: rows of the PartialFC head (the data holds 64 identities; the head may be larger).
    #[arg(long, default_value_t = 100_000)]
    classes: usize,
    /// Face: --mirror-every of the job.
    #[arg(long, default_value_t = 10)]
    mirror_every: u64,
    /// Ranks of the job.
    #[arg(long, default_value_t = 4)]
    nproc: usize,
    /// Seconds between kills in the interrupted run.
    #[arg(long, default_value_t = 10.0)]
    kill_every: f64,
    /// Epochs of the job (default: 1500 for the MLP on the digits set, about 0.04 s each at 4
    /// ranks on 2 cores; 12 for the face recipe, about 5 s each: about a minute either way).
    #[arg(long)]
    epochs: Option<usize>,
    /// Hidden width of the MLP (a larger one makes steps, and state transfers, longer).
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Rounds (each: one uninterrupted run and one with kills, which first alternating).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Keep each run's directory under DIR (`round-N-uninterrupted`, `round-N-killed`), its
    /// output in `job.log` and the kills' times in `kills.txt` (with `TANDEM_LOG`, a timeline).
    #[arg(long, value_name = "DIR")]
    keep: Option<std::path::PathBuf>,
}

/// One run's outcome as read from its output.
#[derive(Debug, Default)]
struct RunResult {
    wall_s: f64,
    samples: f64,
    eval_loss: f64,
    eval_accuracy: f64,
    kills: usize,
    /// Seconds from each kill to the first regroup recorded after it.
    recover_s: Vec<f64>,
    /// Seconds from each kill to the replacement joining (the first regroup after it that
    /// takes one in, the failure's own when the replacement was already waiting): while it
    /// starts, the survivors train on a smaller world.
    join_s: Vec<f64>,
    /// Steps redone, per failure regroup.
    redone: Vec<u64>,
    /// Face: verification accuracy at the end.
    verification: f64,
    /// Face, summed over the regroups: rows restored from mirrors, reloaded, row-steps lost.
    from_mirror: u64,
    reloaded: u64,
    row_steps_lost: u64,
    /// Seconds the kills cost by the run's own clock ([`lost_in_epochs`]); `None` without
    /// enough epochs to tell.
    lost_s: Option<f64>,
    /// Face: the mirror's line (`every K step(s): N taken, B KiB ..., T ms each`).
    mirror_line: String,
}

impl Args {
    fn epochs(&self) -> usize {
        self.epochs.unwrap_or(match self.recipe {
            Recipe::Mlp => 1500,
            Recipe::Face => 12,
        })
    }

    /// The job's settings (run in `dir`, whose face data it writes first): live recovery on
    /// `--nproc` ranks, restarts without end.
    fn train_config(&self, dir: &std::path::Path) -> anyhow::Result<TrainConfig> {
        let base = match self.recipe {
            Recipe::Mlp => TrainConfig {
                model: tandem::models::ModelKind::Mlp,
                hidden: self.hidden,
                batch_size: 16,
                ..TrainConfig::default()
            },
            Recipe::Face => {
                crate::train_job::face_set(dir, 64, 200)?;
                TrainConfig {
                    val: vec!["faces/pairs.bin".into()],
                    mirror_every: self.mirror_every,
                    ..crate::train_job::small_face(self.classes, 32)
                }
            }
        };
        Ok(TrainConfig {
            epochs: self.epochs(),
            seed: 11,
            out: Some("runs/live-bench".into()),
            nproc_per_node: self.nproc,
            live_recovery: true,
            max_restarts: 1000,
            ..base
        })
    }
}

/// Runs the job; with `kill_every`, SIGKILLs one of its live workers that often.
fn run(a: &Args, kill_every: Option<Duration>, dir: &std::path::Path) -> anyhow::Result<RunResult> {
    let (exe, cfg) = (crate::tandem_exe()?, a.train_config(dir)?);
    let mut child = crate::train_job::train_command(&exe, &cfg, &dir.join("live-bench.toml"))?
        .current_dir(dir)
        .env("TANDEM_LIVE_ARRIVAL_TIMEOUT", "10")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the live job")?;
    let started = Instant::now();
    // The job's output is drained (a full pipe would stall it) and kept for an error message;
    // its results are read from the run's metrics file, never from its text.
    let (tx, rx) = mpsc::channel::<String>();
    for stream in [
        child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    drop(tx);
    let launcher = child.id() as i32;
    let mut result = RunResult::default();
    // Kills as seconds since the Unix epoch, the clock the regroup records carry.
    let mut kills: Vec<f64> = Vec::new();
    let mut next_kill = kill_every.map(|k| started + k);
    let mut lines: Vec<String> = Vec::new();
    let limit = Duration::from_secs(1800);
    loop {
        if started.elapsed() > limit {
            let _ = child.kill();
            bail!("the live job ran past {limit:?}");
        }
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(l) => lines.push(l),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let (Some(at), Some(every)) = (next_kill, kill_every) {
            if Instant::now() >= at {
                if let Some(pid) = a_worker_of(launcher) {
                    // SAFETY: kill(2) on a process this benchmark's job started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    kills.push(unix_now());
                }
                next_kill = Some(at + every);
            }
        }
    }
    let status = child.wait()?;
    if a.keep.is_some() {
        let times: Vec<String> = kills.iter().map(|k| format!("{k:.6}")).collect();
        std::fs::write(dir.join("job.log"), lines.join("\n"))?;
        std::fs::write(dir.join("kills.txt"), times.join("\n"))?;
    }
    if !status.success() {
        // The whole output goes to a file: the first failure is usually far above the tail
        // (the launcher restarts ranks that then fail to join).
        let log = dir.join("job.log");
        std::fs::write(&log, lines.join("\n"))
            .with_context(|| format!("writing {}", log.display()))?;
        let first: Vec<&str> =
            lines.iter().filter(|l| l.contains("error")).take(5).map(String::as_str).collect();
        let tail: Vec<&str> = lines.iter().rev().take(10).map(String::as_str).collect();
        bail!(
            "the live job failed ({status}); its output is in {}\nfirst errors:\n{}\nlast lines:\n{}",
            log.display(),
            first.join("\n"),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    result.wall_s = started.elapsed().as_secs_f64();
    // The run's typed records (rank 0's metrics file; under live recovery rank 0 may have
    // changed, and every rank 0 appends to the same file).
    let metrics = dir.join("runs/live-bench/metrics.jsonl");
    let records = read_metrics(&metrics)?;
    let summary = tandem::train::metrics::last_summary(&metrics)?
        .with_context(|| format!("no run summary in {}", metrics.display()))?;
    result.eval_accuracy = summary.eval_accuracy.unwrap_or(f64::NAN);
    result.verification = summary.verification_accuracy.unwrap_or(f64::NAN);
    let regroups: Vec<&Regroup> = records
        .iter()
        .filter_map(|r| match r {
            MetricsRecord::Regrouped(g) => Some(g),
            _ => None,
        })
        .collect();
    for g in &regroups {
        if let Some(c) = g.resplit.as_ref().filter(|r| r.part == HEAD_ROWS).map(|r| r.counts) {
            result.from_mirror += c.from_mirror;
            result.reloaded += c.reloaded;
            result.row_steps_lost += c.stale_steps;
        }
    }
    if let Some(m) = records.iter().find_map(|r| match r {
        MetricsRecord::MirrorCost(m) => Some(m),
        _ => None,
    }) {
        result.mirror_line = format!(
            "every {} step(s): {} taken, {} KiB sent per rank each, {:.2} ms each on rank 0",
            m.every,
            m.taken,
            m.bytes_per_rank.div_ceil(1024),
            m.mean_secs * 1e3
        );
    }
    result.eval_loss = records
        .iter()
        .rev()
        .find_map(|r| match r {
            MetricsRecord::Epoch(e) => e.eval_loss,
            _ => None,
        })
        .unwrap_or(f64::NAN);
    // Every sample of every epoch, once (the dataset's size from the run's header is not
    // printed, so count the epochs' samples as epochs × the training set).
    let per_epoch = match a.recipe {
        Recipe::Mlp => tandem::data::datasets::digits()
            .map(|(t, _)| tandem::data::Dataset::len(&t))
            .unwrap_or(0),
        Recipe::Face => 64 * 8,
    };
    result.samples = (a.epochs() * per_epoch) as f64;
    result.kills = kills.len();
    result.lost_s = lost_in_epochs(&records, &kills);
    for k in &kills {
        if let Some(g) = regroups.iter().find(|g| g.at_unix_s > *k) {
            result.recover_s.push(g.at_unix_s - k);
        }
        let joined = regroups.iter().find(|g| g.at_unix_s > *k && g.has_joiner());
        if let Some(g) = joined {
            result.join_s.push(g.at_unix_s - k);
        }
    }
    for g in regroups.iter().filter(|g| !g.is_join()) {
        result.redone.push(g.redone);
    }
    Ok(result)
}

/// What the kills cost, measured inside the run (so the machine's drift from one run to the
/// next, often larger than the cost, does not enter): every epoch trains the same samples, so
/// an epoch a kill fell in (or up to a second before) took longer than the median epoch no kill
/// touched by what that kill cost. The first epoch (start-up) is left out; `None` when fewer
/// than three epochs were untouched.
fn lost_in_epochs(records: &[MetricsRecord], kills: &[f64]) -> Option<f64> {
    let mut ends: Vec<(u64, f64)> = records
        .iter()
        .filter_map(|r| match r {
            MetricsRecord::Epoch(e) => Some((e.epoch, e.at_unix_s?)),
            _ => None,
        })
        .collect();
    // (Each epoch once: under live recovery a later rank 0 appends to the same file.)
    ends.sort_by_key(|&(epoch, _)| epoch);
    ends.dedup_by_key(|&mut (epoch, _)| epoch);
    let (mut clean, mut touched) = (Vec::new(), Vec::new());
    for w in ends.windows(2) {
        let (from, to) = (w[0].1, w[1].1);
        let took = to - from;
        match kills.iter().any(|&k| k > from - 1.0 && k <= to) {
            true => touched.push(took),
            false => clean.push(took),
        }
    }
    if clean.len() < 3 {
        return None;
    }
    clean.sort_by(f64::total_cmp);
    let median = clean[clean.len() / 2];
    Some(touched.iter().map(|t| t - median).sum())
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A live worker process of the launcher `launcher`: a child whose command is `tandem train`
/// and that is not the launcher's watchdog. (The watchdog is a child too, forked without exec:
/// its command line is the launcher's — `tandem train ...` itself when `tandem train` starts
/// its own ranks — so only its process name tells it apart. Killing it stops nothing: such a
/// kill was counted with the next real kill's regroup, a 10 s "recovery", and cost nothing.)
fn a_worker_of(launcher: i32) -> Option<i32> {
    let workers: Vec<i32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().nth(1)?.parse::<i32>().ok());
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let name = std::fs::read(format!("/proc/{pid}/comm")).unwrap_or_default();
            let watchdog = name.trim_ascii_end() == WATCHDOG_NAME.to_bytes();
            ppid == Some(launcher)
                && !watchdog
                && cmd.split(|&b| b == 0).nth(1) == Some(b"train".as_slice())
        })
        .collect();
    // A different rank each time, round the ranks.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    let pick = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut workers = workers;
    workers.sort_unstable();
    workers.get(pick % workers.len().max(1)).copied()
}

fn stats(v: &[f64]) -> String {
    stats_with(v, 3)
}

fn stats_with(v: &[f64], decimals: usize) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let (lo, mid, hi) = (s[0], s[s.len() / 2], s[s.len() - 1]);
    format!("{lo:.decimals$} / {mid:.decimals$} / {hi:.decimals$}")
}

pub fn main(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(
        a.nproc >= 2,
        "--nproc must be at least 2 (a world of one has nothing to recover)"
    );
    anyhow::ensure!(a.kill_every > 0.0, "--kill-every must be positive");
    let every = Duration::from_secs_f64(a.kill_every);
    let (mut clean, mut killed) = (Vec::new(), Vec::new());
    for round in 0..a.rounds {
        let kept =
            |what: &str| a.keep.as_ref().map(|d| d.join(format!("round-{}-{what}", round + 1)));
        let one = |what: &str, kill: Option<Duration>| {
            crate::in_scratch_dir(kept(what).as_deref(), "bench-live", |d| run(&a, kill, d))
        };
        // Which run goes first alternates (ABBA): a machine slower in a round's second run
        // (seen: the killed run's epochs before its first kill 1.5–5% slower than the
        // uninterrupted run's, in each of three rounds run in one order) weighs on both alike.
        let (c, k) = match round % 2 {
            0 => (one("uninterrupted", None)?, one("killed", Some(every))?),
            _ => {
                let k = one("killed", Some(every))?;
                (one("uninterrupted", None)?, k)
            }
        };
        eprintln!(
            "round {}/{}: uninterrupted {:.1} s, with {} kill(s) {:.1} s",
            round + 1,
            a.rounds,
            c.wall_s,
            k.kills,
            k.wall_s
        );
        clean.push(c);
        killed.push(k);
    }
    let sps = |r: &[RunResult]| r.iter().map(|x| x.samples / x.wall_s).collect::<Vec<_>>();
    let retained: Vec<f64> = killed.iter().zip(&clean).map(|(k, c)| c.wall_s / k.wall_s).collect();
    let all =
        |f: fn(&RunResult) -> Vec<f64>, r: &[RunResult]| r.iter().flat_map(f).collect::<Vec<_>>();
    let job = match a.recipe {
        Recipe::Mlp => format!("MLP hidden {} on digits", a.hidden),
        Recipe::Face => format!(
            "IResNet-18 width 8 + PartialFC ({} classes x 32, mirrored every {} steps) on 512 faces",
            a.classes, a.mirror_every
        ),
    };
    println!(
        "live recovery: {} ranks, {job}, {} epochs, a worker SIGKILLed every {} s; {} round(s), min / median / max",
        a.nproc,
        a.epochs(),
        a.kill_every,
        a.rounds
    );
    println!("  samples/s uninterrupted           {}", stats_with(&sps(&clean), 0));
    println!("  samples/s with kills              {}", stats_with(&sps(&killed), 0));
    println!("  retained (uninterrupted wall / killed wall)  {}", stats(&retained));
    // The same cost measured inside each killed run (its epochs with a kill against its
    // epochs without), free of the drift between runs.
    let lost: Vec<(f64, &RunResult)> = killed.iter().filter_map(|k| Some((k.lost_s?, k))).collect();
    if !lost.is_empty() {
        let per_kill: Vec<f64> = lost.iter().map(|(l, k)| l / k.kills.max(1) as f64).collect();
        let within: Vec<f64> = lost.iter().map(|(l, k)| (k.wall_s - l) / k.wall_s).collect();
        println!("  retained within each killed run   {}", stats(&within));
        println!("  seconds lost per kill (same)      {}", stats(&per_kill));
    }
    println!(
        "  kills per run                     {}",
        stats(&killed.iter().map(|k| k.kills as f64).collect::<Vec<_>>())
    );
    println!(
        "  steps redone per failure          {}",
        stats(&all(|r| r.redone.iter().map(|&n| n as f64).collect(), &killed))
    );
    println!(
        "  seconds from a kill to training   {}",
        stats(&all(|r| r.recover_s.clone(), &killed))
    );
    println!(
        "  seconds from a kill to the replacement joining  {}",
        stats(&all(|r| r.join_s.clone(), &killed))
    );
    if a.recipe == Recipe::Face {
        let per = |f: fn(&RunResult) -> u64| {
            stats_with(&killed.iter().map(|r| f(r) as f64).collect::<Vec<_>>(), 0)
        };
        println!("  head rows restored from mirrors   {}", per(|r| r.from_mirror));
        println!("  head rows reloaded (checkpoint)   {}", per(|r| r.reloaded));
        println!("  head row-steps of training lost   {}", per(|r| r.row_steps_lost));
        if let Some(r) = clean.first() {
            println!("  head mirror (uninterrupted run)   {}", r.mirror_line);
        }
        println!(
            "  final verification accuracy: uninterrupted {}, with kills {}",
            stats(&clean.iter().map(|r| r.verification).collect::<Vec<_>>()),
            stats(&killed.iter().map(|r| r.verification).collect::<Vec<_>>())
        );
        return Ok(0);
    }
    println!(
        "  final eval loss: uninterrupted {}, with kills {}",
        stats(&clean.iter().map(|r| r.eval_loss).collect::<Vec<_>>()),
        stats(&killed.iter().map(|r| r.eval_loss).collect::<Vec<_>>())
    );
    println!(
        "  final eval accuracy: uninterrupted {}, with kills {}",
        stats(&clean.iter().map(|r| r.eval_accuracy).collect::<Vec<_>>()),
        stats(&killed.iter().map(|r| r.eval_accuracy).collect::<Vec<_>>())
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem::train::metrics::EpochMetrics;

    fn epoch(n: u64, at: f64) -> MetricsRecord {
        MetricsRecord::Epoch(EpochMetrics {
            epoch: n,
            step: 10 * n,
            train_loss: 1.0,
            eval_loss: None,
            eval_accuracy: None,
            verification: Vec::new(),
            samples_per_s: 1.0,
            lr: 0.1,
            loss_scale: None,
            skipped_steps: 0,
            at_unix_s: Some(at),
        })
    }

    #[test]
    fn the_epochs_a_kill_touched_are_measured_against_the_untouched_ones() {
        // Epochs of 4 s, but the two with a kill (at 9.5 s and 18.2 s) took 4.3 and 4.2 s; epoch
        // 3 repeated by a later rank 0 counts once.
        let ends = [0.0, 4.0, 8.0, 12.3, 16.3, 20.5, 24.5, 28.5];
        let mut records: Vec<MetricsRecord> =
            ends.iter().enumerate().map(|(i, &t)| epoch(i as u64 + 1, t)).collect();
        records.push(epoch(3, 8.0));
        let lost = lost_in_epochs(&records, &[9.5, 18.2]).unwrap();
        assert!((lost - 0.5).abs() < 1e-9, "{lost}");
        // A kill up to a second before an epoch's start counts against that epoch.
        let lost = lost_in_epochs(&records, &[7.5]).unwrap();
        assert!((lost - 0.3).abs() < 1e-9, "{lost}");
        // Too few untouched epochs to tell.
        assert_eq!(lost_in_epochs(&records[..3], &[5.0]), None);
    }
}
