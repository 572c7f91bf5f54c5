//! Live recovery end to end: `tandem run --live-recovery -- tandem train` with workers killed
//! (SIGKILL, self-inflicted at an exact point through the test-only `TANDEM_TEST_FAULT`, or
//! from outside) in the forward pass, inside the gradient all-reduce, in the optimizer step,
//! during a checkpoint save, two at once, and the rank that sends the state to a re-formed
//! world while it sends; without restarts left the job goes on with fewer ranks, or stops at
//! `--min-nproc` naming the reason. Every run must finish training (final line, every
//! checkpoint readable) with no process left. One test at a time (each starts 4 ranks).
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};
use std::time::Duration;

use tandem_testutil::harness;
use tandem_testutil::{output_with_deadline, without_world};

fn main() -> ExitCode {
    harness::main_serial(tandem_testutil::tests![
        killed_in_forward_the_others_go_on_and_a_replacement_joins,
        killed_inside_the_all_reduce,
        killed_in_the_optimizer_step_no_step_is_redone,
        killed_during_a_checkpoint_save_leaves_only_whole_checkpoints,
        two_killed_at_once,
        the_source_killed_while_sending_its_state,
        without_restarts_the_job_goes_on_with_fewer_ranks,
        below_min_nproc_the_job_stops_naming_the_reason,
        what_live_recovery_cannot_carry_is_refused_by_name,
        background_saves_go_on_through_a_regroup,
    ])
}

const LIMIT: Duration = Duration::from_secs(240);
const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

/// A job long enough for a replacement to start and join (≈ 1 s of steps per rank).
const JOB: [&str; 10] =
    ["--model", "mlp", "--hidden", "256", "--epochs", "40", "--batch-size", "16", "--seed", "3"];

struct Run {
    out: Output,
    text: String,
    dir: tempfile::TempDir,
}

impl Run {
    fn final_line(&self) -> &str {
        self.text
            .lines()
            .find(|l| l.contains("final: "))
            .unwrap_or_else(|| panic!("no final line:\n{}", self.text))
    }
    fn regroups(&self) -> Vec<&str> {
        self.text.lines().filter(|l| l.contains("live: regrouped")).collect()
    }
    fn checkpoints(&self) -> PathBuf {
        self.dir.path().join("runs/live/checkpoints")
    }
}

/// `tandem run --nproc-per-node 4 --live-recovery [launcher] -- tandem train JOB [train]`, with
/// the fault variables `env`.
fn live_job(launcher: &[&str], train: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(TANDEM);
    without_world(&mut cmd);
    cmd.current_dir(dir.path())
        .args(["run", "--nproc-per-node", "4", "--live-recovery"])
        .args(launcher)
        .args(["--", TANDEM, "train", "--out", "runs/live"])
        .args(JOB)
        .args(train)
        // A peer that stops answering without closing its sockets is given up on quickly.
        .env("TANDEM_TIMEOUT", "10")
        .env("TANDEM_LIVE_ARRIVAL_TIMEOUT", "5");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = output_with_deadline(&mut cmd, LIMIT);
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Run { out, text, dir }
}

/// Exit 0, a final line, every checkpoint readable, no worker left behind.
fn assert_finished(run: &Run) {
    assert!(run.out.status.success(), "the job failed ({:?}):\n{}", run.out.status, run.text);
    let line = run.final_line();
    let acc: f64 = line
        .split(' ')
        .find_map(|kv| kv.strip_prefix("eval_accuracy="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no eval_accuracy in {line}"));
    assert!(acc > 0.9, "the job did not learn: {line}");
    assert_checkpoints_whole(&run.checkpoints());
    let left =
        Command::new("pgrep").args(["-f", &format!("{TANDEM} train --out runs/live")]).output();
    if let Ok(left) = left {
        let pids = String::from_utf8_lossy(&left.stdout).trim().to_string();
        // Another test's job cannot be running (serial); any match is ours.
        assert!(pids.is_empty(), "workers outlived the job: {pids}");
    }
}

fn assert_checkpoints_whole(dir: &Path) {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "pt"))
        .collect();
    assert!(!files.is_empty(), "no checkpoint in {}", dir.display());
    for f in files {
        let out = Command::new(TANDEM).args(["ckpt", "inspect"]).arg(&f).output().unwrap();
        assert!(
            out.status.success(),
            "{} does not read back:\n{}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn fault(phase: &str, members: &str) -> Vec<(&'static str, String)> {
    vec![
        ("TANDEM_TEST_FAULT", phase.to_string()),
        ("TANDEM_TEST_FAULT_MEMBER", members.to_string()),
    ]
}

fn env_refs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn killed_in_forward_the_others_go_on_and_a_replacement_joins() {
    let f = fault("forward@100", "2");
    let run = live_job(&["--max-restarts", "1"], &[], &env_refs(&f));
    assert_finished(&run);
    assert!(run.text.contains("member 2 dies at Forward of step 100"), "{}", run.text);
    assert!(
        run.text.contains("[launcher] rank 2 failed (signal 9 (SIGKILL)); starting it again"),
        "{}",
        run.text
    );
    let regroups = run.regroups();
    // The survivors' regroup (without 2, or with its replacement already there) redoes step 100.
    let first = regroups.first().unwrap_or_else(|| panic!("no regroup:\n{}", run.text));
    assert!(first.contains("peer rank 2") && first.contains("1 step(s) redone"), "{first}");
    assert!(first.contains("at step 99"), "the world goes on from step 99: {first}");
    // The replacement is back in by the end.
    assert!(run.text.contains("member 2 joined the running job"), "{}", run.text);
}

fn killed_inside_the_all_reduce() {
    let f = fault("allreduce@100", "1");
    let run = live_job(&["--max-restarts", "1"], &[], &env_refs(&f));
    assert_finished(&run);
    assert!(run.text.contains("member 1 dies at AllReduce of step 100"), "{}", run.text);
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(
        first.contains("1 step(s) redone") && first.contains("at step 99"),
        "{first}\n{}",
        run.text
    );
}

fn killed_in_the_optimizer_step_no_step_is_redone() {
    // The others finished step 100's all-reduce and updated; the world goes on from step 100.
    let f = fault("optimizer@100", "3");
    let run = live_job(&["--max-restarts", "1"], &[], &env_refs(&f));
    assert_finished(&run);
    assert!(run.text.contains("member 3 dies at Optimizer of step 100"), "{}", run.text);
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(
        first.contains("at step 100") && first.contains("0 step(s) redone"),
        "{first}\n{}",
        run.text
    );
}

fn killed_during_a_checkpoint_save_leaves_only_whole_checkpoints() {
    // Member 0 writes the checkpoints: it dies inside the save of step 100.
    let f = fault("save@100", "0");
    let run = live_job(&["--max-restarts", "1"], &["--save-every", "50"], &env_refs(&f));
    assert_finished(&run);
    assert!(run.text.contains("member 0 dies at Save of step 100"), "{}", run.text);
    assert!(!run.regroups().is_empty(), "{}", run.text);
}

fn two_killed_at_once() {
    let f = fault("forward@100", "1,3");
    let run = live_job(&["--max-restarts", "2"], &[], &env_refs(&f));
    assert_finished(&run);
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(first.contains("1 step(s) redone"), "{first}\n{}", run.text);
    for m in [1, 3] {
        assert!(
            run.text.contains(&format!("member {m} joined the running job")),
            "{m}:\n{}",
            run.text
        );
    }
}

fn the_source_killed_while_sending_its_state() {
    // Member 2 dies in step 100; member 0, the lowest of the furthest-along survivors, is the
    // source of the re-formed world and dies while sending; the world forms again and takes
    // member 1's state.
    let f = vec![
        ("TANDEM_TEST_FAULT", "forward@100".to_string()),
        ("TANDEM_TEST_FAULT_MEMBER", "2".to_string()),
    ];
    let mut env = env_refs(&f);
    // A second fault variable pair would be read by every process; the send fault is keyed to
    // member 0 through its own variable.
    env.push(("TANDEM_TEST_FAULT_SEND_MEMBER", "0"));
    let run = live_job(&["--max-restarts", "2"], &[], &env);
    assert_finished(&run);
    assert!(run.text.contains("member 0 dies at Send"), "{}", run.text);
    assert!(run.text.contains("state of member 1"), "member 1's state was taken:\n{}", run.text);
}

fn without_restarts_the_job_goes_on_with_fewer_ranks() {
    let f = fault("forward@100", "3");
    let run = live_job(&["--max-restarts", "0"], &[], &env_refs(&f));
    assert_finished(&run);
    assert!(
        run.text.contains("no restarts left (--max-restarts 0): the job goes on without it"),
        "{}",
        run.text
    );
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(first.contains("3 rank(s) [0, 1, 2], lost [3]"), "{first}\n{}", run.text);
    assert!(run.text.contains("rank(s) [3] lost for good"), "{}", run.text);
}

fn below_min_nproc_the_job_stops_naming_the_reason() {
    let f = fault("forward@100", "3");
    let run = live_job(&["--max-restarts", "0", "--min-nproc", "4"], &[], &env_refs(&f));
    assert!(!run.out.status.success(), "{}", run.text);
    assert!(
        run.text.contains("only 3 rank(s) are left") && run.text.contains("at least 4"),
        "{}",
        run.text
    );
}

fn what_live_recovery_cannot_carry_is_refused_by_name() {
    for (extra, expect) in [
        (vec!["--zero"], "--zero"),
        (vec!["--model", "iresnet18", "--data", "rec:/nonexistent"], "PartialFC head"),
    ] {
        let mut cmd = Command::new(TANDEM);
        without_world(&mut cmd);
        let out = output_with_deadline(
            cmd.args(["train", "--live-recovery", "--nproc-per-node", "2"]).args(&extra),
            Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--live-recovery") && err.contains(expect),
            "{extra:?}: {err}"
        );
    }
}

/// `--async-save` under live recovery: member 0 (the world's rank 0, which hands the saves to
/// its writer thread) dies a few steps after a background save began; the survivors regroup (a
/// new rank 0 writes the later saves) and every checkpoint on disk reads back whole.
fn background_saves_go_on_through_a_regroup() {
    let f = fault("forward@105", "0");
    let train = ["--save-every", "50", "--async-save"];
    let run = live_job(&["--max-restarts", "1"], &train, &env_refs(&f));
    assert_finished(&run);
    assert!(!run.regroups().is_empty(), "{}", run.text);
    let steps: Vec<u64> = std::fs::read_dir(run.checkpoints())
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.split("step-").nth(1)?.trim_end_matches(".pt").parse().ok()
        })
        .collect();
    assert!(steps.iter().any(|&s| s > 105), "no save after the regroup: {steps:?}");
}
