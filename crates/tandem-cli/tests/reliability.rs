//! Reliability suite (issue #9): SIGKILLed ranks, restarts to bitwise-identical weights, kills
//! during checkpoint writes, a full disk, misconfigured ranks and bad checkpoint files. Every
//! scenario counts its trials and prints `reliability: <scenario> trials=N passed=M ...`;
//! random kill moments come from a seeded RNG (`RELIABILITY_SEED`) named in every failure.
//! Run it all with scripts/reliability.sh. Built with `harness = false`: `main` is also the entry
//! point of the checkpoint-saving child, and a scenario that cannot run here (the tmpfs one
//! without mount rights) is reported as skipped, never as passed.
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::*;
use tandem_testutil::harness::{self, Test};
use tandem_testutil::tmpfs::{free_bytes, Tmpfs};

fn main() -> std::process::ExitCode {
    if let Some(dir) = std::env::var_os(SAVER_DIR_VAR) {
        save_checkpoints_until_killed(PathBuf::from(dir));
        return std::process::ExitCode::SUCCESS;
    }
    let mut tests = tandem_testutil::tests![
        kill_one_rank_ends_the_job_fast_and_names_it,
        lone_survivor_fails_fast_when_its_peer_dies_or_stalls,
        killed_rank_restarts_from_checkpoint_to_identical_weights,
        kill_during_checkpoint_writes_never_exposes_a_partial_file,
        kill_during_async_checkpoint_writes_never_exposes_a_partial_file,
        write_error_fails_the_save_cleanly_and_keeps_the_previous_checkpoint,
        write_error_in_a_background_save_fails_the_run_and_keeps_the_previous_checkpoint,
        misconfigured_ranks_fail_with_a_clear_error_never_a_hang,
        bad_checkpoint_files_are_one_clear_error_line,
        resume_skips_a_corrupt_or_truncated_newest_checkpoint,
        inspect_reports_a_bit_flip_in_tensor_data,
    ];
    let tmpfs = Test::new(
        "full_tmpfs_fails_the_save_cleanly_and_keeps_the_previous_checkpoint",
        full_tmpfs_fails_the_save_cleanly_and_keeps_the_previous_checkpoint,
    );
    let tmpfs_async = Test::new(
        "full_tmpfs_fails_a_background_save_cleanly_and_keeps_the_previous_checkpoint",
        full_tmpfs_fails_a_background_save_cleanly_and_keeps_the_previous_checkpoint,
    );
    let metrics = Test::new(
        "a_full_disk_never_leaves_half_a_metrics_record",
        a_full_disk_never_leaves_half_a_metrics_record,
    );
    let no_tmpfs = (!Tmpfs::can_mount()).then(|| {
        let reason = "mounting a tmpfs needs root and mount(8) (write-error-efbig covers the \
                      write error without it)";
        Tally::skipped("full-disk-tmpfs", reason);
        Tally::skipped("full-disk-tmpfs-async-save", reason);
        reason.to_string()
    });
    tests.push(tmpfs.skip_if(no_tmpfs.clone()));
    tests.push(tmpfs_async.skip_if(no_tmpfs.clone()));
    tests.push(metrics.skip_if(no_tmpfs));
    harness::main(tests)
}

/// Collective timeout for the ranks under test: a survivor stuck in a collective gives up after it.
const COLLECTIVE_TIMEOUT_S: &str = "3";
/// Bound on any single process run in this suite (a hang fails the trial instead of CI).
const HARD_LIMIT: Duration = Duration::from_secs(60);

/// The tiny training job: 16 hidden units, batch 4, ~190 steps per epoch on 2 ranks.
const TINY: [&str; 6] = ["--hidden", "16", "--batch-size", "4", "--data", "digits"];

fn marker(scenario: &str, trial: usize) -> String {
    format!("{scenario}-{}-{trial}", std::process::id())
}

// ---------------------------------------------------------------------------------------------
// 1. kill -9 one rank at a random moment: the job ends fast, non-zero, naming the dead rank.

fn kill_one_rank_ends_the_job_fast_and_names_it() {
    let mut tally = Tally::new("kill-rank");
    let (mut worst, mut misattributed) = (Duration::ZERO, 0usize);
    let base = base_seed();
    for trial in 0..trials(20) {
        let seed = base.wrapping_add(trial as u64);
        let id = marker("kill-rank", trial);
        let result = kill_rank_trial(seed, &id).map(|(exit_after, root_is_victim)| {
            worst = worst.max(exit_after);
            misattributed += usize::from(!root_is_victim);
        });
        tally.record(
            result
                .map_err(|e| format!("seed {seed} (RELIABILITY_SEED={base}, trial {trial}): {e}")),
        );
    }
    tally.note("max_exit_after_kill", format!("{:.2}s", worst.as_secs_f64()));
    tally.note("root_cause_other_rank", misattributed);
    tally.finish();
}

/// One trial: returns (kill → launcher exit, whether the summary's root cause is the victim).
fn kill_rank_trial(seed: u64, id: &str) -> Result<(Duration, bool), String> {
    let mut rng = Rng::new(seed);
    let victim = rng.below(2) as u32;
    let delay = rng.duration(Duration::ZERO, Duration::from_millis(1500));
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let run_dir = dir.path().join("run");
    let mut cmd = tandem();
    cmd.args(["train", "--nproc-per-node", "2", "--epochs", "50", "--out", s(&run_dir)])
        .args(TINY)
        .env(MARKER_VAR, id)
        .env("TANDEM_TIMEOUT", COLLECTIVE_TIMEOUT_S);
    let job = Running::spawn(&mut cmd);
    let ranks = wait_for_ranks(job.pid(), 2, Duration::from_secs(20));
    let Some(ranks) = ranks else {
        let f = job.wait(Duration::from_secs(5));
        let _ = leftovers(id, Duration::from_secs(2));
        return Err(format!("the launcher never had 2 rank children\n{}", f.describe()));
    };
    std::thread::sleep(delay);
    let pid =
        ranks.iter().find(|(r, _)| *r == victim).map(|(_, p)| *p).ok_or("victim rank not found")?;
    let landed = sigkill(pid);
    let killed_at = Instant::now();
    let f = job.wait(HARD_LIMIT);
    let exit_after = f.at.saturating_duration_since(killed_at);
    let left = leftovers(id, Duration::from_secs(2));
    let ctx = || {
        format!(
            "victim rank {victim} (pid {pid}) killed {:.3}s after both ranks were up\n{}",
            delay.as_secs_f64(),
            f.describe()
        )
    };
    if !landed {
        return Err(format!("rank {victim} was already gone when the kill came: {}", ctx()));
    }
    let Some(status) = f.status else {
        return Err(format!("launcher still running {HARD_LIMIT:?} after the kill: {}", ctx()));
    };
    if status.success() {
        return Err(format!("job exited 0 after a rank was killed: {}", ctx()));
    }
    if exit_after > Duration::from_secs(10) {
        return Err(format!(
            "launcher exited {:.2}s after the kill (limit 10 s): {}",
            exit_after.as_secs_f64(),
            ctx()
        ));
    }
    // The summary must name the dead rank and how it died.
    let names_victim =
        f.stderr.lines().any(|l| l.contains(&format!("rank {victim} ")) && l.contains("SIGKILL"));
    if !names_victim {
        return Err(format!("no summary line names rank {victim} and SIGKILL: {}", ctx()));
    }
    if !left.is_empty() {
        return Err(format!("processes left behind: {left:?}: {}", ctx()));
    }
    let root_is_victim = f.stderr.contains(&format!("root cause: rank {victim} "));
    Ok((exit_after, root_is_victim))
}

/// Without a launcher to clean up, the surviving rank itself must notice: a SIGKILLed peer
/// (connection closed) or a SIGSTOPped one (alive but silent: the collective timeout).
fn lone_survivor_trial(
    seed: u64,
    id: &str,
    signal: i32,
    bound: Duration,
) -> Result<Duration, String> {
    let mut rng = Rng::new(seed);
    let victim = rng.below(2) as u32;
    let delay = rng.duration(Duration::from_millis(100), Duration::from_millis(1500));
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = dir.path().join("run");
    let port = tandem_testutil::free_port();
    // Longer than any delay drawn on any host: 50 epochs of digits end in under a second on a
    // fast one, and a signal that lands on a finished (zombie) rank tests nothing.
    let args =
        ["train", "--epochs", "5000", "--hidden", "16", "--batch-size", "4", "--out", s(&out)];
    let mut ranks: Vec<Option<Running>> =
        (0..2).map(|r| Some(rank(id, r, 2, "127.0.0.1", port, &[], &args))).collect();
    std::thread::sleep(delay);
    let victim_proc = ranks[victim as usize].take().ok_or("no victim")?;
    let victim_pid = victim_proc.pid();
    // SAFETY: kill(2) on our own child.
    let landed = unsafe { libc::kill(victim_pid, signal) } == 0;
    let sent_at = Instant::now();
    // Reap the victim at once, as a shell or launcher would: the shm transport tells a dead peer
    // by kill(pid, 0) failing, which an unreaped zombie does not do.
    let reaper = std::thread::spawn(move || victim_proc.wait(HARD_LIMIT));
    let survivor = ranks[1 - victim as usize].take().ok_or("no survivor")?.wait(HARD_LIMIT);
    let after = survivor.at.saturating_duration_since(sent_at);
    sigkill(victim_pid);
    let v = reaper.join().map_err(|_| "reaper thread panicked")?;
    let left = leftovers(id, Duration::from_secs(2));
    let ctx = || {
        format!(
            "rank {victim} got signal {signal} {:.3}s after start\n[survivor] {}\n[victim] {}",
            delay.as_secs_f64(),
            survivor.describe(),
            v.describe()
        )
    };
    if !landed {
        return Err(format!("rank {victim} was gone before the signal: {}", ctx()));
    }
    match survivor.status {
        None => return Err(format!("the surviving rank hung: {}", ctx())),
        Some(st) if st.success() => return Err(format!("the surviving rank exited 0: {}", ctx())),
        Some(_) => {}
    }
    if after > bound {
        return Err(format!(
            "the survivor took {:.2}s (bound {bound:?}): {}",
            after.as_secs_f64(),
            ctx()
        ));
    }
    if !survivor.stderr.contains(&format!("rank {victim}")) {
        return Err(format!("the survivor's error does not name rank {victim}: {}", ctx()));
    }
    if !left.is_empty() {
        return Err(format!("processes left behind: {left:?}"));
    }
    Ok(after)
}

fn lone_survivor_fails_fast_when_its_peer_dies_or_stalls() {
    let base = base_seed();
    for (scenario, signal, n, bound) in [
        ("kill-rank-no-launcher", libc::SIGKILL, trials(20), Duration::from_secs(10)),
        // The collective timeout (TANDEM_TIMEOUT=3) plus slack.
        ("stop-rank-no-launcher", libc::SIGSTOP, trials(20).min(5), Duration::from_secs(6)),
    ] {
        let mut tally = Tally::new(scenario);
        let mut worst = Duration::ZERO;
        for trial in 0..n {
            let seed = base.wrapping_add(3000 + (signal as u64) * 100 + trial as u64);
            let r = lone_survivor_trial(seed, &marker(scenario, trial), signal, bound)
                .map(|d| worst = worst.max(d));
            tally.record(
                r.map_err(|e| format!("seed {seed} (RELIABILITY_SEED={base}, trial {trial}): {e}")),
            );
        }
        tally.note("max_survivor_exit", format!("{:.2}s", worst.as_secs_f64()));
        tally.finish();
    }
}

// ---------------------------------------------------------------------------------------------
// 2. The same under `tandem run --max-restarts 3`: completes, weights bitwise equal.

fn restartable_train(run: &[&str], out: &Path, fin: &Path) -> Command {
    let mut c = tandem();
    c.arg("run").args(run).args([
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.05",
        "--",
        tandem_exe(),
        "train",
    ]);
    c.args([
        "--epochs",
        "3",
        "--save-every",
        "10",
        "--resume",
        "--out",
        s(out),
        "--save-final",
        s(fin),
    ])
    .args(TINY);
    c.env("TANDEM_TIMEOUT", COLLECTIVE_TIMEOUT_S);
    c
}

fn killed_rank_restarts_from_checkpoint_to_identical_weights() {
    let dir = tempfile::tempdir().unwrap();
    // The uninterrupted reference, through the same launcher and flags.
    let ref_final = dir.path().join("reference.pt");
    let started = Instant::now();
    let f = Running::spawn(&mut restartable_train(&[], &dir.path().join("reference"), &ref_final))
        .wait(HARD_LIMIT);
    assert!(f.status.is_some_and(|s| s.success()), "reference run failed:\n{}", f.describe());
    let ref_time = started.elapsed();

    let mut tally = Tally::new("kill-rank-restart");
    let (mut landed_n, mut restarts_n) = (0usize, 0usize);
    let base = base_seed();
    for trial in 0..trials(20) {
        let seed = base.wrapping_add(1000 + trial as u64);
        let id = marker("restart", trial);
        let r = restart_trial(seed, &id, ref_time, &ref_final).map(|(landed, restarted)| {
            landed_n += usize::from(landed);
            restarts_n += usize::from(restarted);
        });
        tally.record(
            r.map_err(|e| format!("seed {seed} (RELIABILITY_SEED={base}, trial {trial}): {e}")),
        );
    }
    tally.note("kills_landed", landed_n);
    tally.note("restarted", restarts_n);
    tally.note("reference_run", format!("{:.2}s", ref_time.as_secs_f64()));
    tally.finish();
}

/// One trial: returns (the kill hit a live rank, the launcher restarted the workers).
fn restart_trial(
    seed: u64,
    id: &str,
    ref_time: Duration,
    ref_final: &Path,
) -> Result<(bool, bool), String> {
    let mut rng = Rng::new(seed);
    let victim = rng.below(2) as u32;
    // Anywhere in the run (the ranks come up a little after the launcher starts).
    let delay = ref_time.mul_f64(0.7 * rng.unit());
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let fin = dir.path().join("final.pt");
    let mut cmd = restartable_train(&["--max-restarts", "3"], &dir.path().join("run"), &fin);
    cmd.env(MARKER_VAR, id);
    let job = Running::spawn(&mut cmd);
    let Some(ranks) = wait_for_ranks(job.pid(), 2, Duration::from_secs(20)) else {
        let f = job.wait(Duration::from_secs(5));
        let _ = leftovers(id, Duration::from_secs(2));
        return Err(format!("the launcher never had 2 rank children\n{}", f.describe()));
    };
    std::thread::sleep(delay);
    let pid =
        ranks.iter().find(|(r, _)| *r == victim).map(|(_, p)| *p).ok_or("victim rank not found")?;
    let landed = sigkill(pid);
    let f = job.wait(HARD_LIMIT);
    let left = leftovers(id, Duration::from_secs(2));
    let ctx = || {
        format!(
            "victim rank {victim} killed {:.3}s after start (landed: {landed})\n{}",
            delay.as_secs_f64(),
            f.describe()
        )
    };
    match f.status {
        Some(s) if s.success() => {}
        _ => return Err(format!("job did not complete with --max-restarts 3: {}", ctx())),
    }
    let restarted = f.stderr.contains("restarting all 2 worker(s)");
    if landed && !restarted && !f.stderr.contains("SIGKILL") {
        // A kill that landed on a rank which had not yet exited must have been noticed.
        return Err(format!("a live rank was killed but the launcher did not restart: {}", ctx()));
    }
    if restarted
        && !f.stdout.contains("resumed from")
        && !f.stderr.contains("resumed from")
        && !f.stderr.contains("starting fresh")
    {
        return Err(format!("restarted workers did not report where they resumed: {}", ctx()));
    }
    same_weights(ref_final, &fin).map_err(|e| format!("{e}: {}", ctx()))?;
    if !left.is_empty() {
        return Err(format!("processes left behind: {left:?}: {}", ctx()));
    }
    Ok((landed, restarted))
}

// ---------------------------------------------------------------------------------------------
// 3. kill -9 the saving process during checkpoint writes (library level, re-exec'd helper).

const SAVER_DIR_VAR: &str = "RELIABILITY_SAVER_DIR";
/// Set (to anything) for the saver to write in the background (`Checkpointer::background`).
const SAVER_ASYNC_VAR: &str = "RELIABILITY_SAVER_ASYNC";
/// Elements of the tensor in each saved checkpoint (1 MiB of f32: writes take a while).
const SAVER_LEN: usize = 256 * 1024;

/// Deterministic checkpoint contents for `step`, so a loaded one can be checked value by value.
fn saver_value(step: i64) -> tandem::ckpt::Value {
    use tandem::ckpt::{TensorData, Value};
    let data: Vec<f32> =
        (0..SAVER_LEN).map(|i| (step as f32) * 1000.0 + (i % 997) as f32).collect();
    Value::dict_from([
        ("global_step", Value::Int(step)),
        (
            "model",
            Value::dict_from([("w", Value::Tensor(TensorData::from_f32(&[SAVER_LEN], &data)))]),
        ),
    ])
}

/// Err unless `v` is exactly what `saver_value` wrote for its `global_step`.
fn check_saver_value(v: &tandem::ckpt::Value) -> Result<i64, String> {
    let step = v.get("global_step").and_then(|s| s.as_int()).ok_or("no global_step")?;
    let want = saver_value(step);
    let got =
        v.get("model").and_then(|m| m.get("w")).and_then(|t| t.as_tensor()).ok_or("no model.w")?;
    let exp = want
        .get("model")
        .and_then(|m| m.get("w"))
        .and_then(|t| t.as_tensor())
        .ok_or("no model.w")?;
    if got.contiguous_bytes() != exp.contiguous_bytes() {
        return Err(format!("step {step}: model.w does not hold what was saved"));
    }
    Ok(step)
}

/// The child process of `kill_during_checkpoint_writes` (this binary re-run with
/// RELIABILITY_SAVER_DIR set): saves checkpoints in a loop until it is killed.
/// With RELIABILITY_SAVER_ASYNC the saves go through the background writer, the loop going on
/// (building the next value, as training would) while the previous one is written.
fn save_checkpoints_until_killed(dir: PathBuf) {
    use tandem::train::checkpoint::{Checkpointer, TrainingStateDict};
    let group = tandem::comm::init_from(&tandem::comm::InitMethod::Single).expect("a world of one");
    let mut ckpt =
        Checkpointer::new(dir, 3).background(std::env::var_os(SAVER_ASYNC_VAR).is_some());
    let start = Instant::now();
    let mut step = 1;
    // Self-limit: never outlive a parent that failed to kill us.
    while start.elapsed() < Duration::from_secs(20) {
        let name = format!("step-{step:08}");
        let state = TrainingStateDict::new(step as u64, 0, saver_value(step));
        ckpt.save(&group, &name, state).expect("save");
        println!("saved {step}");
        step += 1;
    }
}

fn kill_during_checkpoint_writes_never_exposes_a_partial_file() {
    kill_during_writes("kill-during-save", false);
}

fn kill_during_async_checkpoint_writes_never_exposes_a_partial_file() {
    kill_during_writes("kill-during-async-save", true);
}

fn kill_during_writes(scenario: &str, background: bool) {
    let mut tally = Tally::new(scenario);
    let (mut with_tmp, mut older, mut none) = (0usize, 0usize, 0usize);
    let base = base_seed();
    let exe = std::env::current_exe().unwrap();
    for trial in 0..trials(50) {
        let seed = base.wrapping_add(2000 + trial as u64);
        let r = save_kill_trial(seed, &exe, background).map(|o| {
            with_tmp += usize::from(o.torn_tmp_left);
            older += usize::from(o.resumed_older);
            none += usize::from(o.no_checkpoint);
        });
        tally.record(
            r.map_err(|e| format!("seed {seed} (RELIABILITY_SEED={base}, trial {trial}): {e}")),
        );
    }
    tally.note("killed_mid_write", with_tmp);
    tally.note("resume_picked_older_than_newest", older);
    tally.note("killed_before_first_save", none);
    tally.finish();
}

struct SaveKillOutcome {
    torn_tmp_left: bool,
    resumed_older: bool,
    no_checkpoint: bool,
}

fn save_kill_trial(seed: u64, exe: &Path, background: bool) -> Result<SaveKillOutcome, String> {
    let mut rng = Rng::new(seed);
    let delay = rng.duration(Duration::from_millis(20), Duration::from_millis(400));
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let ck = dir.path().join("ckpt");
    let mut cmd = Command::new(exe);
    cmd.env(SAVER_DIR_VAR, &ck);
    if background {
        cmd.env(SAVER_ASYNC_VAR, "1");
    }
    let job = Running::spawn(&mut cmd);
    std::thread::sleep(delay);
    let landed = sigkill(job.pid());
    let f = job.wait(Duration::from_secs(10));
    let ctx = || format!("killed {:.3}s after start\n{}", delay.as_secs_f64(), f.describe());
    if !landed || f.status.is_none() {
        return Err(format!("the saver was not running at the kill: {}", ctx()));
    }
    let names: Vec<String> = match std::fs::read_dir(&ck) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    let torn_tmp_left = names.iter().any(|n| n.ends_with(".tmp"));
    // Every file under a checkpoint name must be complete and hold what was saved.
    let mut newest_complete: Option<i64> = None;
    for n in names.iter().filter(|n| n.starts_with("checkpoint-") && n.ends_with(".pt")) {
        let p = ck.join(n);
        let opts = tandem::ckpt::LoadOptions { verify_checksums: true, ..Default::default() };
        let v = tandem::ckpt::load_with(&p, &opts)
            .map_err(|e| format!("{n} is visible but does not load: {e}: {}", ctx()))?;
        let step = check_saver_value(&v).map_err(|e| format!("{n}: {e}: {}", ctx()))?;
        newest_complete = newest_complete.max(Some(step));
    }
    // The `latest` pointer, when present, names a complete file.
    if let Ok(name) = std::fs::read_to_string(ck.join("latest")) {
        let name = name.trim();
        if !names.iter().any(|n| n == name) {
            return Err(format!("`latest` names {name}, which does not exist: {}", ctx()));
        }
    }
    let picked = tandem::train::checkpoint::Checkpointer::new(&ck, 3)
        .latest()
        .map_err(|e| format!("latest failed: {e}: {}", ctx()))?
        .map(|saved| (saved.path().to_path_buf(), saved.replicated()));
    let resumed_older = match (&picked, newest_complete) {
        (None, None) => false,
        (None, Some(s)) => {
            return Err(format!("resume found nothing although step {s} is complete: {}", ctx()))
        }
        (Some((p, _)), None) => {
            return Err(format!(
                "resume picked {} although no file is complete: {}",
                p.display(),
                ctx()
            ))
        }
        (Some((p, v)), Some(newest)) => {
            let v = v.as_ref().map_err(|e| format!("{e}: {}", ctx()))?;
            let step = check_saver_value(v)
                .map_err(|e| format!("resume picked {}: {e}: {}", p.display(), ctx()))?;
            step < newest
        }
    };
    Ok(SaveKillOutcome { torn_tmp_left, resumed_older, no_checkpoint: newest_complete.is_none() })
}

// ---------------------------------------------------------------------------------------------
// 4. A full disk (tmpfs, root only) and an injected write error (RLIMIT_FSIZE, anyone).

/// `tandem train` on 2 ranks, tiny model, a checkpoint every 5 steps, stopping at `steps`.
fn disk_train<'c>(c: &'c mut Command, out: &Path, steps: u32) -> &'c mut Command {
    c.args([
        "train",
        "--nproc-per-node",
        "2",
        "--epochs",
        "3",
        "--save-every",
        "5",
        "--keep-last",
        "2",
        "--out",
        s(out),
    ])
    .args(["--steps", &steps.to_string()])
    .args(TINY)
    .env("TANDEM_TIMEOUT", COLLECTIVE_TIMEOUT_S)
}

fn run_ok(c: &mut Command, what: &str) -> Result<Finished, String> {
    let f = Running::spawn(c).wait(HARD_LIMIT);
    match f.status {
        Some(s) if s.success() => Ok(f),
        _ => Err(format!("{what} failed:\n{}", f.describe())),
    }
}

enum Squeeze<'a> {
    /// Fill the tmpfs until only this many bytes are free.
    Fill(&'a Path, u64),
    /// `ulimit -f` (512-byte blocks) with SIGXFSZ ignored: large writes fail with EFBIG.
    Fsize(u32),
}

/// Trains 10 steps, squeezes the disk, resumes towards 20 (must fail cleanly at the step-15
/// save with the previous checkpoint untouched), then resumes with room to spare and must end
/// bitwise equal to an uninterrupted 20-step run.
/// `extra` flags go to every run (`--async-save`).
fn disk_trial(root: &Path, squeeze: Squeeze, expect: &str, extra: &[&str]) -> Result<(), String> {
    let reference = root.join("reference.pt");
    run_ok(
        disk_train(&mut tandem(), &root.join("ref-run"), 20)
            .args(extra)
            .arg("--save-final")
            .arg(&reference),
        "reference run",
    )?;
    let run = match &squeeze {
        Squeeze::Fill(mnt, _) => mnt.join("run"),
        Squeeze::Fsize(_) => root.join("run"),
    };
    run_ok(disk_train(&mut tandem(), &run, 10).args(extra), "first 10 steps")?;
    let ck = run.join("checkpoints");
    let newest = ck.join("checkpoint-step-00000010.pt");
    let before = std::fs::read(&newest).map_err(|e| format!("{}: {e}", newest.display()))?;
    let pointer = std::fs::read_to_string(ck.join("latest")).map_err(|e| e.to_string())?;

    let mut squeezed = match &squeeze {
        Squeeze::Fill(mnt, leave) => {
            let free = free_bytes(mnt).ok_or("statvfs failed")?;
            let filler = mnt.join("filler");
            std::fs::write(&filler, vec![0u8; free.saturating_sub(*leave) as usize])
                .map_err(|e| format!("filling the tmpfs: {e}"))?;
            tandem()
        }
        Squeeze::Fsize(blocks) => {
            let mut c = Command::new("sh");
            clean_env(&mut c);
            c.args([
                "-c",
                &format!("trap '' XFSZ; ulimit -f {blocks} && exec \"$0\" \"$@\""),
                tandem_exe(),
            ]);
            c
        }
    };
    disk_train(&mut squeezed, &run, 20).args(extra);
    squeezed.arg("--resume").env(MARKER_VAR, marker("disk", 0));
    let f = Running::spawn(&mut squeezed).wait(HARD_LIMIT);
    let left = leftovers(&marker("disk", 0), Duration::from_secs(2));
    let ctx = || f.describe();
    match f.status {
        None => return Err(format!("the squeezed run hung: {}", ctx())),
        Some(s) if s.success() => return Err(format!("the squeezed run exited 0: {}", ctx())),
        Some(_) => {}
    }
    if !f.stderr.contains(expect) || !f.stderr.contains("checkpoint-step-00000015") {
        return Err(format!(
            "the error names neither `{expect}` nor the checkpoint file: {}",
            ctx()
        ));
    }
    if f.stderr.contains("panicked") {
        return Err(format!("a rank panicked: {}", ctx()));
    }
    if !left.is_empty() {
        return Err(format!("processes left behind: {left:?}"));
    }
    // The previous checkpoint, the pointer and the directory are as they were.
    if std::fs::read(&newest).ok().as_deref() != Some(&before[..]) {
        return Err(format!("{} changed", newest.display()));
    }
    if std::fs::read_to_string(ck.join("latest")).ok().as_deref() != Some(pointer.as_str()) {
        return Err("the `latest` pointer moved".into());
    }
    let names: Vec<String> = std::fs::read_dir(&ck)
        .map_err(|e| e.to_string())?
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect();
    if let Some(t) = names.iter().find(|n| n.ends_with(".tmp") || n.contains("00000015")) {
        return Err(format!("the failed save left {t} in {}", ck.display()));
    }
    match tandem::train::checkpoint::Checkpointer::new(&ck, 2).latest() {
        Ok(Some(saved)) if saved.path() == newest && saved.global_step() == 10 => {}
        other => {
            return Err(format!(
                "resume would not pick step 10: {:?}",
                other.map(|o| o.map(|s| s.path().to_path_buf()))
            ))
        }
    }
    if let Squeeze::Fill(mnt, _) = &squeeze {
        std::fs::remove_file(mnt.join("filler")).map_err(|e| e.to_string())?;
    }
    // With room again the job resumes from step 10 and ends exactly where an uninterrupted run does.
    let fin = root.join("resumed.pt");
    run_ok(
        disk_train(&mut tandem(), &run, 20)
            .args(extra)
            .arg("--resume")
            .arg("--save-final")
            .arg(&fin),
        "resume after freeing space",
    )?;
    same_weights(&reference, &fin)
}

fn full_tmpfs_fails_the_save_cleanly_and_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = Tmpfs::mount(&dir.path().join("mnt"), "2m").expect("mount a 2 MiB tmpfs");
    let mut tally = Tally::new("full-disk-tmpfs");
    // 8 KiB free: config.toml still fits, a ~13 KB checkpoint does not.
    tally.record(disk_trial(
        dir.path(),
        Squeeze::Fill(&mnt.0, 8192),
        "No space left on device",
        &[],
    ));
    tally.finish();
}

/// The same with `--async-save`: the background write of step 15 runs out of space; the run
/// learns of it at its next save and fails naming the file and the cause; with room again the
/// job resumes from step 10 to the same weights.
fn full_tmpfs_fails_a_background_save_cleanly_and_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = Tmpfs::mount(&dir.path().join("mnt"), "2m").expect("mount a 2 MiB tmpfs");
    let mut tally = Tally::new("full-disk-tmpfs-async-save");
    tally.record(disk_trial(
        dir.path(),
        Squeeze::Fill(&mnt.0, 8192),
        "No space left on device",
        &["--async-save"],
    ));
    tally.finish();
}

/// A metrics record the disk fills up part way through (found by `tandem bench chaos`: a
/// half-written line made every later one unreadable) is cut off again: the file ends with its
/// last whole record, and a record written once there is room follows it and reads back.
fn a_full_disk_never_leaves_half_a_metrics_record() {
    use tandem::train::metrics::{read_metrics, MetricsFile, MetricsRecord};
    use tandem::train::{EpochMetrics, ValidationMetrics};
    let dir = tempfile::tempdir().unwrap();
    let mnt = Tmpfs::mount(&dir.path().join("mnt"), "256k").expect("mount a 256 KiB tmpfs");
    // `sets` verification sets make a line of about 60 bytes each.
    let record = |epoch: u64, sets: usize| {
        let verification = (0..sets)
            .map(|i| ValidationMetrics::new(format!("set{i}"), 0.5, 0.1).with("xnorm", 1.0))
            .collect();
        MetricsRecord::Epoch(EpochMetrics {
            epoch,
            step: epoch * 10,
            train_loss: 1.0,
            eval_loss: None,
            eval_accuracy: Some(0.5),
            verification,
            samples_per_s: 100.0,
            lr: 0.1,
            loss_scale: None,
            skipped_steps: 0,
            at_unix_s: None,
        })
    };
    let path = mnt.0.join("metrics.jsonl");
    let mut file = MetricsFile::append(&path).unwrap();
    file.write(&record(1, 1)).unwrap();
    let whole = std::fs::metadata(&path).unwrap().len();
    // 8 KiB left, a record of about 60 KiB: its write stops part way.
    let filler = mnt.0.join("filler");
    tandem_testutil::tmpfs::fill(&filler, 8192).unwrap();
    let err = file.write(&record(2, 1000)).expect_err("the disk is full").to_string();
    assert!(err.contains("No space left on device") && err.contains("metrics.jsonl"), "{err}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), whole, "half a record was left");
    std::fs::remove_file(&filler).unwrap();
    file.write(&record(3, 1)).unwrap();
    let epochs: Vec<u64> = read_metrics(&path)
        .unwrap()
        .iter()
        .map(|r| match r {
            MetricsRecord::Epoch(m) => m.epoch,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(epochs, vec![1, 3]);
}

fn write_error_fails_the_save_cleanly_and_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut tally = Tally::new("write-error-efbig");
    // 8 blocks of 512 bytes: config.toml still fits, a ~13 KB checkpoint does not.
    tally.record(disk_trial(dir.path(), Squeeze::Fsize(8), "File too large", &[]));
    tally.finish();
}

/// The same with `--async-save`: the step-15 write fails on the background thread; the run
/// learns of it at its next save (the final one) and fails naming the file.
fn write_error_in_a_background_save_fails_the_run_and_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut tally = Tally::new("write-error-efbig-async-save");
    tally.record(disk_trial(dir.path(), Squeeze::Fsize(8), "File too large", &["--async-save"]));
    tally.finish();
}

// ---------------------------------------------------------------------------------------------
// 5. Misconfiguration: a clear error within the (rendezvous) timeout, never a hang.

const INIT_TIMEOUT_S: u64 = 3;
/// Rendezvous timeout plus slack for process start-up and teardown.
const MISCONFIG_BOUND: Duration = Duration::from_secs(INIT_TIMEOUT_S + 3);

/// One hand-launched rank: `args` run with RANK/WORLD_SIZE/MASTER_* as given.
fn rank(
    id: &str,
    rank: u32,
    world: u32,
    addr: &str,
    port: u16,
    env: &[(&str, &str)],
    args: &[&str],
) -> Running {
    let mut c = tandem();
    c.args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", addr)
        .env("MASTER_PORT", port.to_string())
        .env("TANDEM_INIT_TIMEOUT", INIT_TIMEOUT_S.to_string())
        .env("TANDEM_TIMEOUT", COLLECTIVE_TIMEOUT_S)
        .env(MARKER_VAR, id);
    for (k, v) in env {
        c.env(k, v);
    }
    Running::spawn(&mut c)
}

/// Every rank must fail within the bound; together their errors must contain every `expect`.
fn misconfig(
    id: &str,
    started: Instant,
    ranks: Vec<Running>,
    expect: &[&str],
) -> Result<Duration, String> {
    let done: Vec<Finished> = ranks.into_iter().map(|r| r.wait(HARD_LIMIT)).collect();
    let slowest = done.iter().map(|f| f.at.duration_since(started)).max().unwrap_or_default();
    let left = leftovers(id, Duration::from_secs(2));
    let all = done
        .iter()
        .enumerate()
        .map(|(i, f)| format!("[process {i}] {}", f.describe()))
        .collect::<Vec<_>>()
        .join("\n");
    if let Some((i, _)) =
        done.iter().enumerate().find(|(_, f)| !matches!(f.status, Some(s) if !s.success()))
    {
        return Err(format!("process {i} did not fail:\n{all}"));
    }
    if slowest > MISCONFIG_BOUND {
        return Err(format!(
            "took {:.1}s (bound {MISCONFIG_BOUND:?}):\n{all}",
            slowest.as_secs_f64()
        ));
    }
    let stderr: String = done.iter().map(|f| f.stderr.as_str()).collect();
    if let Some(missing) = expect.iter().find(|e| !stderr.contains(*e)) {
        return Err(format!("no error mentions `{missing}`:\n{all}"));
    }
    if stderr.contains("panicked") {
        return Err(format!("a panic instead of an error:\n{all}"));
    }
    if !left.is_empty() {
        return Err(format!("processes left behind: {left:?}"));
    }
    Ok(slowest)
}

fn misconfigured_ranks_fail_with_a_clear_error_never_a_hang() {
    use tandem_testutil::free_port;
    let lo = "127.0.0.1";
    let mut slowest = Duration::ZERO;
    let mut case = |name: &str, f: &dyn Fn(&str) -> Result<Duration, String>| {
        let mut tally = Tally::new(&format!("misconfig-{name}"));
        let r = f(&marker(name, 0)).map(|d| {
            slowest = slowest.max(d);
            tally.note("exit_after", format!("{:.2}s", d.as_secs_f64()));
        });
        tally.record(r);
        tally
    };
    let mut tallies = Vec::new();
    tallies.push(case("port-in-use", &|id| {
        let taken = std::net::TcpListener::bind((lo, 0)).map_err(|e| e.to_string())?;
        let port = taken.local_addr().map_err(|e| e.to_string())?.port();
        let t = Instant::now();
        misconfig(
            id,
            t,
            vec![rank(id, 0, 2, lo, port, &[], &["check"])],
            &["MASTER_PORT", &port.to_string(), "in use"],
        )
    }));
    tallies.push(case("wrong-world-size", &|id| {
        let port = free_port();
        let t = Instant::now();
        let ranks = vec![
            rank(id, 0, 2, lo, port, &[], &["check"]),
            rank(id, 1, 3, lo, port, &[], &["check"]),
        ];
        misconfig(id, t, ranks, &["world size 3", "rank 1"])
    }));
    tallies.push(case("different-model", &|id| {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let out = dir.path().join("run");
        let port = free_port();
        let t = Instant::now();
        let train = |hidden: &'static str| {
            ["train", "--epochs", "1", "--hidden", hidden, "--out", s(&out)].map(String::from)
        };
        let (a, b) = (train("16"), train("24"));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let b: Vec<&str> = b.iter().map(String::as_str).collect();
        let ranks = vec![rank(id, 0, 2, lo, port, &[], &a), rank(id, 1, 2, lo, port, &[], &b)];
        misconfig(id, t, ranks, &["fc1.weight", "[16, 64]", "[24, 64]"])
    }));
    tallies.push(case("foreign-run-id", &|id| {
        let port = free_port();
        let t = Instant::now();
        let ranks = vec![
            rank(id, 0, 2, lo, port, &[("TANDEM_RUN_ID", "job-a")], &["check"]),
            rank(id, 1, 2, lo, port, &[("TANDEM_RUN_ID", "job-b")], &["check"]),
        ];
        misconfig(id, t, ranks, &["job-b", "another job (another run id)"])
    }));
    tallies.push(case("master-unreachable", &|id| {
        // 192.0.2.1 is TEST-NET-1: never routed, so nothing answers there.
        let t = Instant::now();
        misconfig(
            id,
            t,
            vec![rank(id, 1, 2, "192.0.2.1", 29500, &[], &["check"])],
            &["MASTER_ADDR", "192.0.2.1"],
        )
    }));
    for t in tallies {
        t.finish();
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Bad checkpoint files: one clear error line from the CLI; resume skips a corrupt newest one.

/// Two ranks train `steps` steps with a checkpoint every 5; returns the checkpoint directory.
fn small_run(out: &Path, steps: u32, extra: &[&str]) -> Result<Finished, String> {
    run_ok(disk_train(&mut tandem(), out, steps).args(extra), &format!("training {steps} steps"))
}

/// Offset of a byte inside the first tensor's data of a tandem-written `.pt` (its zip entry
/// `data/0` is 64-byte aligned after the local header), so flipping it only breaks the CRC.
fn tensor_data_offset(bytes: &[u8]) -> Option<usize> {
    let i = bytes.windows(6).position(|w| w == b"data/0")? + 6;
    Some((i + 4 + 63) & !63)
}

/// Hostile pickles (a `__reduce__` calling os.system) in both torch.save formats, made by torch.
fn hostile_files(dir: &Path) -> Vec<PathBuf> {
    let Some(py) = tandem_testutil::torch_python() else {
        return Vec::new();
    };
    let script = r#"
import os, sys, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > " + sys.argv[1] + "/pwned",))
torch.save({"model": Evil()}, sys.argv[1] + "/hostile-zip.pt")
torch.save({"model": Evil()}, sys.argv[1] + "/hostile-legacy.pt", _use_new_zipfile_serialization=False)
"#;
    let o = tandem_testutil::output_with_deadline(
        Command::new(py).args(["-c", script, s(dir)]),
        HARD_LIMIT,
    );
    assert!(o.status.success(), "making hostile files: {}", String::from_utf8_lossy(&o.stderr));
    vec![dir.join("hostile-zip.pt"), dir.join("hostile-legacy.pt")]
}

fn bad_checkpoint_files_are_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    small_run(&dir.path().join("run"), 10, &[]).unwrap();
    let good =
        std::fs::read(dir.path().join("run/checkpoints/checkpoint-step-00000010.pt")).unwrap();
    let pkl = good.windows(8).position(|w| w == b"data.pkl").unwrap();
    let mut cases: Vec<(PathBuf, &str)> = Vec::new();
    let mut write = |name: &str, bytes: &[u8], expect: &'static str| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        cases.push((p, expect));
    };
    write("truncated-half.pt", &good[..good.len() / 2], "");
    write("truncated-tail.pt", &good[..good.len() - 30], "");
    write("empty.pt", b"", "empty");
    let mut zeroed_head = good.clone();
    zeroed_head[..64].fill(0);
    write("zeroed-header.pt", &zeroed_head, "");
    // The pickle stream overwritten (past the entry name and its alignment padding).
    let mut bad_pickle = good.clone();
    let start = (pkl + 8 + 4 + 63) & !63;
    bad_pickle[start..start + 24].fill(0xfe);
    write("corrupt-pickle.pt", &bad_pickle, "");
    write(
        "raw-pickle.pt",
        b"\x80\x02cposix\nsystem\nq\x00X\x06\x00\x00\x00whoamiq\x01\x85q\x02Rq\x03.",
        "",
    );
    for p in hostile_files(dir.path()) {
        cases.push((p, "posix.system"));
    }

    let mut tally = Tally::new("bad-ckpt-cli");
    for (path, expect) in &cases {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let f = Running::spawn(tandem().args(["ckpt", "inspect", s(path)])).wait(HARD_LIMIT);
        let lines: Vec<&str> = f.stderr.lines().collect();
        let r = if f.status.and_then(|s| s.code()) != Some(1) {
            Err(format!("{name}: expected exit code 1: {}", f.describe()))
        } else if lines.len() != 1
            || !lines[0].starts_with("error: ")
            || !lines[0].contains(&name)
            || !lines[0].contains(expect)
        {
            Err(format!(
                "{name}: expected one `error:` line naming the file and `{expect}`: {}",
                f.describe()
            ))
        } else {
            Ok(())
        };
        tally.record(r);
    }
    tally.note("files", cases.len());
    assert!(!dir.path().join("pwned").exists(), "a hostile pickle was executed");
    tally.finish();
}

fn resume_skips_a_corrupt_or_truncated_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference.pt");
    small_run(&dir.path().join("ref"), 15, &["--save-final", s(&reference)]).unwrap();
    let mut tally = Tally::new("resume-skips-bad-newest");
    for damage in ["bit-flip", "truncated"] {
        let r = (|| -> Result<(), String> {
            let run = dir.path().join(damage);
            small_run(&run, 10, &[])?;
            let newest = run.join("checkpoints/checkpoint-step-00000010.pt");
            let mut b = std::fs::read(&newest).map_err(|e| e.to_string())?;
            match damage {
                "bit-flip" => {
                    let at = tensor_data_offset(&b).ok_or("no data/0 entry")?;
                    b[at] ^= 0x40;
                }
                _ => b.truncate(b.len() * 2 / 3),
            }
            std::fs::write(&newest, &b).map_err(|e| e.to_string())?;
            let fin = run.join("final.pt");
            let f = small_run(&run, 15, &["--resume", "--save-final", s(&fin)])?;
            if !(f.stderr.contains("skipping checkpoint")
                && f.stderr.contains("checkpoint-step-00000010"))
            {
                return Err(format!(
                    "{damage}: no warning naming the skipped file:\n{}",
                    f.describe()
                ));
            }
            if !f.stderr.contains("resumed from")
                || !f.stderr.contains("checkpoint-step-00000005.pt (epoch")
            {
                return Err(format!("{damage}: did not resume from step 5:\n{}", f.describe()));
            }
            same_weights(&reference, &fin).map_err(|e| format!("{damage}: {e}"))
        })();
        tally.record(r);
    }
    tally.finish();
}

/// `tandem ckpt inspect` verifies every zip CRC-32: a flipped bit inside tensor data is an error,
/// never printed as if the file were fine.
fn inspect_reports_a_bit_flip_in_tensor_data() {
    let dir = tempfile::tempdir().unwrap();
    small_run(&dir.path().join("run"), 5, &[]).unwrap();
    let mut b =
        std::fs::read(dir.path().join("run/checkpoints/checkpoint-step-00000005.pt")).unwrap();
    let at = tensor_data_offset(&b).unwrap();
    b[at] ^= 0x40;
    let p = dir.path().join("flipped.pt");
    std::fs::write(&p, &b).unwrap();
    let mut tally = Tally::new("bad-ckpt-cli-bitflip");
    let f = Running::spawn(tandem().args(["ckpt", "inspect", s(&p)])).wait(HARD_LIMIT);
    tally.record(if f.status.and_then(|s| s.code()) == Some(1) {
        Ok(())
    } else {
        Err(format!("bit flip not reported: {}", f.describe()))
    });
    tally.finish();
}
