//! Live recovery end to end: `tandem run --live-recovery -- tandem train` with workers killed
//! (SIGKILL, self-inflicted at an exact point through the test-only `TANDEM_TEST_FAULT`, or
//! from outside) in the forward pass, inside the gradient all-reduce, in the optimizer step,
//! during a checkpoint save, two at once, all at once (the job starts again from its newest
//! checkpoint), and the rank that sends the state to a re-formed world while it sends; without restarts left the job goes on with fewer ranks, or stops at
//! `--min-nproc` naming the reason. Every run must finish training (final line, every
//! checkpoint readable) with no process left. One test at a time (each starts 4 ranks).
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};
use std::time::Duration;

use tandem::recipes::face::HEAD_ROWS;
use tandem::train::metrics::MetricsRecord;
use tandem_testutil::harness;
use tandem_testutil::{output_with_deadline, without_world};

fn main() -> ExitCode {
    harness::main_serial(tandem_testutil::tests![
        killed_in_forward_the_others_go_on_and_a_replacement_joins,
        killed_inside_the_all_reduce,
        killed_in_the_optimizer_step_no_step_is_redone,
        killed_during_a_checkpoint_save_leaves_only_whole_checkpoints,
        two_killed_at_once,
        every_rank_killed_at_once_the_job_starts_again_from_its_newest_checkpoint,
        killed_after_the_last_step_the_others_still_conclude,
        killed_after_the_last_step_a_waiting_replacement_joins_the_same_regroup,
        the_source_killed_while_sending_its_state,
        without_restarts_the_job_goes_on_with_fewer_ranks,
        below_min_nproc_the_job_stops_naming_the_reason,
        what_live_recovery_cannot_carry_is_refused_by_name,
        background_saves_go_on_through_a_regroup,
        face_recipe_keeps_a_dead_ranks_centres_from_its_mirror,
        face_recipe_two_neighbours_lost_reload_rows_from_the_checkpoint,
        face_recipe_background_saves_through_a_regroup_resume_on_three_ranks,
        zero_shards_come_back_from_the_mirror,
        fsdp_shards_come_back_from_the_mirror_and_reshard_over_the_survivors,
        hsdp_shards_come_back_from_the_replica_and_the_mesh_re_forms,
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
        // Single files, and directories of sharded ones (`--zero`) that were committed.
        .filter(|p| p.extension().is_some_and(|e| e == "pt") || p.join("manifest.json").is_file())
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

/// Every member killed in the same step (as when all fail in one collective before the first
/// step, or every host is lost): no rank holds the state any more, so the replacements form a
/// restart generation together and its source starts the job again from the newest checkpoint
/// (`--save-every 40`), as a restart without live recovery would; the job finishes.
fn every_rank_killed_at_once_the_job_starts_again_from_its_newest_checkpoint() {
    let f = fault("forward@100", "0,1,2,3");
    let run = live_job(&["--max-restarts", "4"], &["--save-every", "40"], &env_refs(&f));
    assert_finished(&run);
    let restart = run
        .regroups()
        .into_iter()
        .find(|l| l.contains("restarted from"))
        .unwrap_or_else(|| panic!("no restart regroup:\n{}", run.text));
    // The newest checkpoint when the ranks died (before step 100), and the step it holds.
    let step: u64 = restart
        .split("checkpoint-step-")
        .nth(1)
        .and_then(|rest| rest.get(..8))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint named: {restart}"));
    assert!((40..100).contains(&step), "{restart}");
    assert!(
        restart.contains("every member of the world before died")
            && restart.contains("lost [0, 1, 2, 3]")
            && restart.contains(&format!("state of member 0 at step {step} ")),
        "{restart}"
    );
    // Steps 81..99 are taken again; nothing before the checkpoint is.
    assert!(run.text.contains("[launcher] rank 3 failed (signal 9 (SIGKILL))"), "{}", run.text);
}

fn killed_after_the_last_step_the_others_still_conclude() {
    // Member 2 dies after the last step, before the final collectives (verification, the
    // recipe's outputs, the world agreeing the run is over): the others regroup and conclude;
    // nothing is redone. The launcher sees the death at once, so member 2's replacement is
    // often ready in time to join that regroup (the next test makes sure of it); otherwise the
    // others regroup without it, and whatever fails after they finished is not started again
    // (restarts were left: it would fail the same way each time): member 2 itself (SIGKILL)
    // when its death and the others' exit come together, or else its replacement, which
    // finds no running job to join (exit code 1).
    let f = fault("conclude", "2");
    let run = live_job(&["--max-restarts", "5"], &[], &env_refs(&f));
    let after_the_end = ["(exit code 1)", "(signal 9 (SIGKILL))"].iter().any(|exit| {
        run.text.contains(&format!("failed {exit} after the job finished on the other ranks"))
    });
    let joined_in_time = run.text.contains("live: member 2 joined the running job");
    assert!(after_the_end || joined_in_time, "{}", run.text);
    assert!(!run.text.contains("restart 2 of 5"), "{}", run.text);
    assert_finished(&run);
    assert!(run.text.contains("member 2 dies at Conclude"), "{}", run.text);
    assert_eq!(run.regroups().len(), 1, "{}", run.text);
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(
        first.contains("peer rank 2") && first.contains("0 step(s) redone"),
        "{first}\n{}",
        run.text
    );
}

fn killed_after_the_last_step_a_waiting_replacement_joins_the_same_regroup() {
    // As above, but the survivors notice late (they wait 3 s before regrouping, as ranks deep
    // in a long step would): member 2's replacement is waiting by then and joins the same
    // regroup. The others had verified, evaluated and perhaps saved at this step; the
    // replacement takes that record with the state, or it runs collectives the others do not
    // and the world regroups again and again.
    let mut f = fault("conclude", "2");
    f.push(("TANDEM_TEST_FAULT_HOLD", "3".into()));
    let run = live_job(&["--max-restarts", "5"], &[], &env_refs(&f));
    assert_finished(&run);
    assert!(run.text.contains("member 2 dies at Conclude"), "{}", run.text);
    assert!(run.text.contains("live: member 2 joined the running job"), "{}", run.text);
    let regroups = run.regroups();
    assert_eq!(regroups.len(), 1, "{regroups:#?}\n{}", run.text);
    assert!(regroups[0].contains("peer rank 2"), "{}", run.text);
    // Member 0 survived and reports it: member 2's slot lost its process and took a new one.
    assert!(regroups[0].contains("lost [2], joined [2]"), "{}", run.text);
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
    let mut cmd = Command::new(TANDEM);
    without_world(&mut cmd);
    let out = output_with_deadline(
        cmd.args(["train", "--live-recovery", "--nproc-per-node", "2", "--backend", "mpi"]),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("--live-recovery")
            && err.contains("--backend mpi: its communicator cannot re-form"),
        "{err}"
    );
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

/// The face recipe's job at test size, as the acceptance command runs it: `tandem run
/// --nproc-per-node 4 --max-restarts 3 --live-recovery -- tandem train --model iresnet18
/// --width 8 --embedding-size 32 --data rec:DIR --val DIR/pairs.bin --batch-size 4 --epochs 6
/// --out OUT`, with the fault variables `env` and `extra` training flags.
fn face_job(env: &[(&str, &str)], extra: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("faces");
    let synth = Command::new(TANDEM)
        .args(["data", "synth-faces"])
        .arg(&data)
        .args(["--classes", "16", "--per-class", "12", "--format", "jpeg", "--pairs", "100"])
        .output()
        .unwrap();
    assert!(synth.status.success(), "{}", String::from_utf8_lossy(&synth.stderr));
    let mut cmd = Command::new(TANDEM);
    without_world(&mut cmd);
    let rec = format!("rec:{}", data.display());
    let val = data.join("pairs.bin");
    cmd.current_dir(dir.path())
        .args(["run", "--nproc-per-node", "4", "--max-restarts", "3", "--live-recovery"])
        .args(["--", TANDEM, "train", "--model", "iresnet18", "--width", "8"])
        .args(["--embedding-size", "32", "--data", &rec, "--val"])
        .arg(&val)
        .args(["--batch-size", "4", "--epochs", "6", "--out", "runs/live"])
        .args(extra)
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

/// Exit 0, a verification accuracy in the final line (returned), every face checkpoint
/// directory complete and readable.
fn face_finished(run: &Run) -> f64 {
    assert!(run.out.status.success(), "the job failed ({:?}):\n{}", run.out.status, run.text);
    let line = run.final_line();
    let acc: f64 = line
        .split(' ')
        .find_map(|kv| kv.strip_prefix("verification_accuracy="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no verification_accuracy in {line}"));
    let dirs: Vec<PathBuf> = std::fs::read_dir(run.checkpoints())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    assert!(!dirs.is_empty(), "no complete checkpoint:\n{}", run.text);
    for d in dirs {
        let out = Command::new(TANDEM).args(["ckpt", "inspect"]).arg(&d).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && text.contains("classes"), "{}: {text}", d.display());
    }
    acc
}

/// The line reporting how the head was re-split at the first regroup.
fn head_line(run: &Run) -> &str {
    run.text
        .lines()
        .find(|l| l.contains("live: head rows:"))
        .unwrap_or_else(|| panic!("no head line:\n{}", run.text))
}

/// Member 2 is SIGKILLed in step 20: the survivors go on (no restart of the job), old rank 2's
/// four centres come back from the mirror rank 3 took at step 10 (4 rows x 9 steps of their
/// training lost), its replacement joins and gets its rows from the others, and the run ends
/// within 0.02 of an uninterrupted run's verification accuracy.
fn face_recipe_keeps_a_dead_ranks_centres_from_its_mirror() {
    let whole = face_job(&[], &[]);
    let baseline = face_finished(&whole);
    let f = fault("forward@20", "2");
    let run = face_job(&env_refs(&f), &[]);
    let acc = face_finished(&run);
    assert!(run.text.contains("member 2 dies at Forward of step 20"), "{}", run.text);
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(first.contains("lost [2]") && first.contains("1 step(s) redone"), "{first}");
    let head = head_line(&run);
    assert!(
        head.contains("4 restored from mirrors, 0 reloaded, 0 started afresh; 36 row-steps of head training lost"),
        "{head}"
    );
    // The same regroup as a typed record in the metrics file (what `tandem bench live` reads),
    // and the mirror's cost at the end.
    let records =
        tandem::train::metrics::read_metrics(&run.dir.path().join("runs/live/metrics.jsonl"))
            .unwrap();
    let regroups: Vec<_> = records
        .iter()
        .filter_map(|r| match r {
            MetricsRecord::Regrouped(g) => Some(g),
            _ => None,
        })
        .collect();
    let first = regroups.first().expect("no regroup record");
    assert_eq!((first.change.lost.as_slice(), first.redone), (&[2][..], 1), "{first:?}");
    let rows = match &first.resplit {
        Some(r) if r.part == HEAD_ROWS => r.counts,
        _ => panic!("{first:?}"),
    };
    assert_eq!((rows.from_mirror, rows.reloaded, rows.stale_steps), (4, 0, 36), "{rows:?}");
    assert!(regroups.iter().any(|g| g.has_joiner() && g.change.joined == [2]), "{regroups:?}");
    assert!(records.iter().any(|r| matches!(r, MetricsRecord::MirrorCost(m) if m.taken > 0)));
    assert!(run.text.contains("member 2 joined the running job"), "{}", run.text);
    assert!(!run.text.contains("starting fresh"), "nothing restarted:\n{}", run.text);
    assert!((acc - baseline).abs() <= 0.02, "{acc} against {baseline} uninterrupted");
}

/// Members 1 and 2 die together (in step 25's optimizer step, after the others updated): old
/// rank 1's centres were mirrored only on rank 2, so they are reloaded from the checkpoint of
/// step 24 (the epoch end); old rank 2's come from rank 3's mirror. AdamW: its per-row state
/// (`exp_avg`, `exp_avg_sq`) and its step travel with the rows.
fn face_recipe_two_neighbours_lost_reload_rows_from_the_checkpoint() {
    let f = fault("optimizer@25", "1,2");
    let train = ["--save-every", "10", "--optimizer", "adamw", "--lr", "0.001"];
    let run = face_job(&env_refs(&f), &train);
    face_finished(&run);
    let first = run.regroups().first().copied().unwrap_or_default().to_string();
    assert!(first.contains("lost [1, 2]") && first.contains("0 step(s) redone"), "{first}");
    let head = head_line(&run);
    assert!(head.contains("8 kept, 0 moved, 4 restored from mirrors, 4 reloaded"), "{head}");
    // Mirror of step 20 (4 rows x 5 steps) and the checkpoint of step 24 (4 rows x 1 step).
    assert!(head.contains("24 row-steps of head training lost"), "{head}");
    for m in [1, 2] {
        let joined = format!("member {m} joined the running job");
        assert!(run.text.contains(&joined), "{m}:\n{}", run.text);
    }
}

/// `--async-save --save-every 5` under live recovery: member 0 (rank 0, which writes the
/// replicated file and the manifests) dies in step 27 with a background save in flight; the
/// survivors go on (a save the broken world cannot commit stays without a manifest), later saves
/// complete, and the last checkpoint resumes on 3 ranks with the head re-split.
fn face_recipe_background_saves_through_a_regroup_resume_on_three_ranks() {
    let f = fault("forward@27", "0");
    let run = face_job(&env_refs(&f), &["--save-every", "5", "--async-save"]);
    face_finished(&run);
    assert!(run.text.contains("lost [0]"), "{}", run.text);
    let last = run.checkpoints().join("step-00000072");
    assert!(last.join("manifest.json").is_file(), "{}", run.text);
    let mut cmd = Command::new(TANDEM);
    without_world(&mut cmd);
    let data = run.dir.path().join("faces");
    let rec = format!("rec:{}", data.display());
    let out = output_with_deadline(
        cmd.current_dir(run.dir.path())
            .args(["train", "--model", "iresnet18", "--width", "8", "--embedding-size", "32"])
            .args(["--data", &rec, "--batch-size", "4", "--epochs", "7", "--out", "runs/live"])
            .args(["--resume", "--nproc-per-node", "3"]),
        LIMIT,
    );
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("resumed from runs/live/checkpoints/step-00000072"), "{text}");
    assert!(text.contains("written by 4 ranks, this run has 3"), "{text}");
}

/// `--zero` under live recovery: member 2 dies in step 100; its optimizer shard (fc1.bias's
/// momentum in the 4-rank partition) comes back from the mirror member 3 took at step 90, the
/// others keep theirs, and the job ends as well as the uninterrupted run does.
fn zero_shards_come_back_from_the_mirror() {
    let f = fault("forward@100", "2");
    let run = live_job(&["--max-restarts", "1"], &["--zero"], &env_refs(&f));
    assert_finished(&run);
    let line = run
        .text
        .lines()
        .find(|l| l.contains("live: optimizer shards:"))
        .unwrap_or_else(|| panic!("no shard line:\n{}", run.text));
    // The world goes on from step 99 (step 100 is redone): the mirror of step 90 is 9 old.
    assert!(
        line.contains("1 restored from mirrors, 0 reloaded, 0 started afresh; 9 parameter-steps"),
        "{line}\n{}",
        run.text
    );
}

/// `--fsdp` under live recovery: member 2 is SIGKILLed in step 100's forward. Its shards of
/// every parameter (4,931 of the MLP's 19,210 elements, with their AdamW state) come back from
/// the mirror member 3 took at step 90 (9 steps older than the world's step 99). Without a
/// restart the three survivors re-shard the model over themselves (each its `ceil(rows / 3)`-row
/// chunk: rows move between them); with one, the replacement receives the dead rank's shards.
/// Either way the job ends as well as an uninterrupted one, every checkpoint reads back. When
/// members 1 and 2 die together (in step 65's optimizer step), old rank 1's shards, mirrored
/// only on rank 2, are read from the checkpoint of step 60 instead.
fn fsdp_shards_come_back_from_the_mirror_and_reshard_over_the_survivors() {
    let f = fault("forward@100", "2");
    let train = ["--fsdp", "--optimizer", "adamw", "--lr", "0.002", "--save-every", "60"];
    for restarts in ["0", "1"] {
        let run = live_job(&["--max-restarts", restarts], &train, &env_refs(&f));
        assert_finished(&run);
        assert!(run.text.contains("member 2 dies at Forward of step 100"), "{}", run.text);
        let first = run.regroups().first().copied().unwrap_or_default().to_string();
        assert!(first.contains("lost [2]") && first.contains("1 step(s) redone"), "{first}");
        let records = regroup_records(&run);
        let first = records.first().expect("no regroup record");
        let resplit = first.resplit.clone().unwrap_or_else(|| panic!("no re-split: {first:?}"));
        assert_eq!(resplit.part, "fsdp shards", "{resplit:?}");
        let c = resplit.counts;
        assert_eq!(c.kept + c.moved + c.from_mirror, 19_210, "{c:?}");
        assert_eq!((c.from_mirror, c.reloaded, c.fresh), (4_931, 0, 0), "{c:?}");
        assert_eq!(c.stale_steps, 9 * 4_931, "{c:?}");
        match restarts {
            "0" => {
                assert_eq!(first.change.members.len(), 3, "{first:?}");
                assert!(c.moved > 0, "the survivors' rows re-laid over 3: {c:?}");
                assert!(
                    run.text.contains("fsdp: 4 parameters sharded over 4 ranks"),
                    "{}",
                    run.text
                );
            }
            _ => assert!(run.text.contains("member 2 joined the running job"), "{}", run.text),
        }
    }
    let f = fault("optimizer@65", "1,2");
    let run = live_job(&["--max-restarts", "2"], &train, &env_refs(&f));
    assert_finished(&run);
    let line = run
        .text
        .lines()
        .find(|l| l.contains("live: fsdp shards:"))
        .unwrap_or_else(|| panic!("no shard line:\n{}", run.text));
    // Step 65 stands (0 redone): the mirror of step 60 and the checkpoint of step 60 are 5 old.
    assert!(
        line.contains(
            "4931 restored from mirrors, 4931 reloaded, 0 started afresh; 49310 element-steps"
        ),
        "{line}"
    );
}

/// The regroup records of a run's metrics, in order.
fn regroup_records(run: &Run) -> Vec<tandem::live::Regroup> {
    let path = run.dir.path().join("runs/live/metrics.jsonl");
    let records = tandem::train::metrics::read_metrics(&path).unwrap();
    records
        .into_iter()
        .filter_map(|r| match r {
            MetricsRecord::Regrouped(g) => Some(g),
            _ => None,
        })
        .collect()
}

/// HSDP (`--hsdp-rows 2`: 2 rows of 2 ranks, each row a whole copy of the shards): member 2
/// SIGKILLed in step 100's forward. Its shards come from its replica in the other row, as new as
/// the step (nothing from a mirror, no training lost); the 3 survivors make no rows of 2 at
/// least 2 wide, so they re-shard as plain FSDP over 3 ranks; with a restart the replacement
/// joins and the mesh is 2x2 again (every element wanted twice: once a row). Both copies of a
/// shard lost at once: it comes from the mirror, as under plain FSDP.
fn hsdp_shards_come_back_from_the_replica_and_the_mesh_re_forms() {
    let f = fault("forward@100", "2");
    let train = ["--fsdp", "--hsdp-rows", "2", "--optimizer", "adamw", "--lr", "0.002"];
    for restarts in ["0", "1"] {
        let run = live_job(&["--max-restarts", restarts], &train, &env_refs(&f));
        assert_finished(&run);
        assert!(run.text.contains("in each of 2 HSDP rows"), "{}", run.text);
        let records = regroup_records(&run);
        let first = records.first().unwrap_or_else(|| panic!("no regroup:\n{}", run.text));
        let resplit = first.resplit.clone().unwrap_or_else(|| panic!("no re-split: {first:?}"));
        assert_eq!(resplit.part, "fsdp shards", "{resplit:?}");
        let c = resplit.counts;
        let (copies, mesh) = match first.change.members.len() {
            3 => (1, "HSDP mesh now 1x3 (built 2x2)"),
            _ => (2, "HSDP mesh now 2x2 (built 2x2)"),
        };
        assert_eq!(c.kept + c.moved, copies * 19_210, "{c:?}");
        assert_eq!((c.from_mirror, c.reloaded, c.fresh, c.stale_steps), (0, 0, 0, 0), "{c:?}");
        assert_eq!(resplit.layout.as_deref(), Some(mesh), "{resplit:?}");
        if restarts == "1" {
            assert!(run.text.contains("member 2 joined the running job"), "{}", run.text);
            // The replacement says nothing of the world of one it builds on before it joins.
            assert!(!run.text.contains("sharded over 1 ranks"), "{}", run.text);
            let last = records.last().and_then(|r| r.resplit.clone());
            let last = last.unwrap_or_else(|| panic!("no re-split at the join: {records:?}"));
            assert_eq!(last.layout.as_deref(), Some("HSDP mesh now 2x2 (built 2x2)"), "{last:?}");
        }
    }
    // Members 0 and 2 die together: both copies of the first half of every parameter. That
    // half comes from member 1's mirror of step 90 (9 steps old); the two survivors hold one
    // row of 2.
    let f = fault("forward@100", "0,2");
    let run = live_job(&["--max-restarts", "0"], &train, &env_refs(&f));
    assert_finished(&run);
    let records = regroup_records(&run);
    let resplit = records.first().and_then(|r| r.resplit.clone());
    let resplit = resplit.unwrap_or_else(|| panic!("no re-split:\n{}", run.text));
    let c = resplit.counts;
    assert_eq!((c.kept, c.from_mirror, c.stale_steps), (9_605, 9_605, 9 * 9_605), "{c:?}");
    assert_eq!(resplit.layout.as_deref(), Some("HSDP mesh now 1x2 (built 2x2)"), "{resplit:?}");
}
