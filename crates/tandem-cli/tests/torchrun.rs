//! Real torchrun (pip torch) launching tandem workers. torchrun's workers are clients of the
//! agent's PyTorch TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`); tandem speaks its protocol,
//! so `torchrun --no-python tandem ...` forms a world and trains like `tandem run`:
//! - one node: `tandem check` on two workers, training equal to the same job under tandem,
//!   and a worker SIGKILLed under `--max-restarts 1` resuming from tandem's checkpoint to the
//!   weights of an uninterrupted run;
//! - two simulated hosts (network namespaces) with `--rdzv-backend c10d`: one world of four,
//!   training equal to four ranks on one host.
//!
//! Needs a Python with torch (CI: TANDEM_REQUIRE_TORCH=1 makes a missing one fail, not skip);
//! the two-host test also needs root and iproute2. Otherwise the tests are reported as skipped.
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use support::{
    marked_processes_with, restartable_train_args as restartable, sigkill, wait_for_checkpoint,
    weights, Finished, Running, MARKER_VAR,
};
use tandem_testutil::harness;
use tandem_testutil::netns::Hosts;
use tandem_testutil::without_world;

const LIMIT: Duration = Duration::from_secs(240);

fn main() -> ExitCode {
    let no_torch = tandem_testutil::torch_python().is_none().then(|| {
        "no Python with torch for torchrun (set TANDEM_PYTHON or create .venv-torch)".to_string()
    });
    let no_hosts = no_torch.clone().or_else(Hosts::unavailable);
    let mut tests = Vec::new();
    for t in tandem_testutil::tests![
        torchrun_workers_pass_tandem_check,
        torchrun_training_equals_the_same_job_under_tandem,
        a_worker_killed_under_torchrun_resumes_from_tandem_checkpoint,
    ] {
        tests.push(t.skip_if(no_torch.clone()));
    }
    for t in tandem_testutil::tests![
        torchrun_c10d_on_two_hosts_trains_like_one_host,
        a_worker_killed_under_torchrun_c10d_resumes_on_both_hosts,
    ] {
        tests.push(t.skip_if(no_hosts.clone()));
    }
    harness::main_serial(tests)
}

fn tandem() -> &'static str {
    env!("CARGO_BIN_EXE_tandem")
}

fn python() -> PathBuf {
    tandem_testutil::torch_python().expect("checked in main")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `torchrun ARGS --no-python tandem WORKER...` (torch's `torch.distributed.run`), no outer
/// world inherited.
fn torchrun(args: &[&str], worker: &[&str]) -> Command {
    let mut c = Command::new(python());
    c.args(["-m", "torch.distributed.run"]).args(args).arg("--no-python").arg(tandem());
    c.args(worker);
    without_world(&mut c);
    c
}

fn assert_succeeded(what: &str, f: &Finished) {
    assert!(
        f.status.is_some_and(|s| s.success()),
        "{what}: {}\nstdout:\n{}\nstderr:\n{}",
        f.describe(),
        f.stdout,
        f.stderr
    );
}

/// Same data, model and steps: only the all-reduce's summation order may differ.
fn assert_close(a: &Path, b: &Path, what: &str) {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len(), "{what}: different tensors");
    for ((k, x), (k2, y)) in a.iter().zip(&b) {
        assert_eq!(k, k2, "{what}");
        let gap = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        assert!(gap < 1e-4, "{what}: {k} differs by {gap}");
    }
}

fn torchrun_workers_pass_tandem_check() {
    let port = tandem_testutil::free_port().to_string();
    let f = Running::spawn(&mut torchrun(
        &["--nproc-per-node", "2", "--master-port", &port],
        &["check"],
    ))
    .wait(LIMIT);
    assert_succeeded("torchrun ... tandem check", &f);
    for rank in 0..2 {
        let expect = format!("rank {rank}/2 local {rank}/2 ");
        let line = f
            .stdout
            .lines()
            .find(|l| l.contains(&expect))
            .unwrap_or_else(|| panic!("no `{expect}` line in:\n{}\n{}", f.stdout, f.stderr));
        assert!(line.trim_end().ends_with("ok"), "{line}");
    }
}

const COMMON: [&str; 8] =
    ["--epochs", "2", "--batch-size", "16", "--hidden", "32", "--model", "cnn"];

fn torchrun_training_equals_the_same_job_under_tandem() {
    let dir = tempfile::tempdir().unwrap();
    let (via_torchrun, via_tandem) = (dir.path().join("torchrun.pt"), dir.path().join("tandem.pt"));
    let port = tandem_testutil::free_port().to_string();
    let out = dir.path().join("torchrun-run");
    let mut worker = vec!["train", "--out", s(&out), "--save-final", s(&via_torchrun)];
    worker.extend(COMMON);
    let f =
        Running::spawn(&mut torchrun(&["--nproc-per-node", "2", "--master-port", &port], &worker))
            .wait(LIMIT);
    assert_succeeded("torchrun ... tandem train", &f);
    assert!(f.stdout.contains("final: epochs=2"), "{}", f.stdout);

    let mut cmd = Command::new(tandem());
    cmd.args(["train", "--nproc-per-node", "2", "--out", s(&dir.path().join("tandem-run"))])
        .args(["--save-final", s(&via_tandem)])
        .args(COMMON);
    without_world(&mut cmd);
    assert_succeeded("tandem train", &Running::spawn(&mut cmd).wait(LIMIT));
    assert_close(&via_torchrun, &via_tandem, "torchrun vs tandem run");
}

/// The one live `train` process of trial `marker` with the variables `also` (20 s to appear).
fn one_process(marker: &str, also: &[&str]) -> i32 {
    let start = Instant::now();
    loop {
        let found = marked_processes_with(marker, also, "train");
        if let [pid] = found[..] {
            return pid;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no single {also:?} process: {found:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn a_worker_killed_under_torchrun_resumes_from_tandem_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (ref_out, ref_fin) = (dir.path().join("ref"), dir.path().join("ref.pt"));
    let mut cmd = Command::new(tandem());
    cmd.args(restartable(&ref_out, &ref_fin)).args(["--nproc-per-node", "2"]);
    without_world(&mut cmd);
    assert_succeeded("uninterrupted tandem train", &Running::spawn(&mut cmd).wait(LIMIT));

    let marker = format!("torchrun-restart-{}", std::process::id());
    let (out, fin) = (dir.path().join("run"), dir.path().join("run.pt"));
    let worker = restartable(&out, &fin);
    let worker: Vec<&str> = worker.iter().map(String::as_str).collect();
    let port = tandem_testutil::free_port().to_string();
    let args = ["--nproc-per-node", "2", "--master-port", &port, "--max-restarts", "1"];
    let mut cmd = torchrun(&[&args[..], &["--monitor-interval", "0.1"]].concat(), &worker);
    cmd.env(MARKER_VAR, &marker).env("TANDEM_TIMEOUT", "5");
    let running = Running::spawn(&mut cmd);
    assert!(
        wait_for_checkpoint(&out.join("checkpoints"), LIMIT),
        "no checkpoint was written in {}",
        out.display()
    );
    let victim = one_process(&marker, &["RANK=1", "TORCHELASTIC_RESTART_COUNT=0"]);
    assert!(
        sigkill(victim),
        "rank 1 (pid {victim}) was gone before the kill: the run is too short"
    );
    let f = running.wait(LIMIT);
    assert_succeeded("torchrun --max-restarts 1 with rank 1 killed", &f);
    let all = format!("{}\n{}", f.stdout, f.stderr);
    assert!(all.contains("resumed from"), "the restarted workers did not resume:\n{all}");
    assert_eq!(
        weights(&fin),
        weights(&ref_fin),
        "the restarted run differs from an uninterrupted one"
    );
}

/// torchrun with c10d rendezvous on every host (endpoint on host 0), each running `worker`;
/// every process carries `marker` in its environment.
fn torchrun_on_hosts(hosts: &Hosts, extra: &[&str], worker: &[&str], marker: &str) -> Vec<Running> {
    let endpoint = format!("{}:29411", hosts.addr(0));
    (0..hosts.len())
        .map(|i| {
            let local = hosts.addr(i);
            let nnodes = hosts.len().to_string();
            let mut args: Vec<&str> = vec!["-m", "torch.distributed.run"];
            args.extend(["--nnodes", &nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d"]);
            args.extend(["--rdzv-endpoint", &endpoint, "--rdzv-id", "tandem-two-hosts"]);
            args.extend(["--local-addr", &local]);
            args.extend(extra);
            args.extend(["--no-python", tandem()]);
            args.extend(worker);
            let py = python();
            let mut cmd = hosts.command(i, s(&py), &args);
            without_world(&mut cmd);
            cmd.env(MARKER_VAR, marker).env("TANDEM_TIMEOUT", "5");
            Running::spawn(&mut cmd)
        })
        .collect()
}

fn assert_all_succeeded(what: &str, running: Vec<Running>) -> Vec<Finished> {
    let finished: Vec<Finished> = running.into_iter().map(|r| r.wait(LIMIT)).collect();
    for (i, f) in finished.iter().enumerate() {
        assert_succeeded(&format!("{what}, host {i}"), f);
    }
    finished
}

fn torchrun_c10d_on_two_hosts_trains_like_one_host() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = Hosts::new(2, None);
    let across = dir.path().join("across.pt");
    let out = dir.path().join("across-run");
    let mut worker = vec!["train", "--out", s(&out), "--save-final", s(&across)];
    worker.extend(COMMON);
    let finished =
        assert_all_succeeded("torchrun c10d", torchrun_on_hosts(&hosts, &[], &worker, "none"));
    let all: String = finished.iter().map(|f| f.stdout.clone()).collect();
    assert!(all.contains("final: epochs=2"), "{all}");

    let one = dir.path().join("one.pt");
    let mut cmd = Command::new(tandem());
    cmd.args(["train", "--nproc-per-node", "4", "--out", s(&dir.path().join("one-run"))])
        .args(["--save-final", s(&one)])
        .args(COMMON);
    without_world(&mut cmd);
    assert_succeeded("tandem train on one host", &Running::spawn(&mut cmd).wait(LIMIT));
    assert_close(&across, &one, "two hosts under torchrun vs one host");
}

/// One store serves every round of a c10d rendezvous, so the restarted workers find the keys
/// of the failed attempt there: they must join a new generation, not the stale one.
fn a_worker_killed_under_torchrun_c10d_resumes_on_both_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = Hosts::new(2, None);
    let marker = format!("torchrun-c10d-restart-{}", std::process::id());
    let (ref_out, ref_fin) = (dir.path().join("ref"), dir.path().join("ref.pt"));
    let worker = restartable(&ref_out, &ref_fin);
    let worker: Vec<&str> = worker.iter().map(String::as_str).collect();
    assert_all_succeeded("uninterrupted", torchrun_on_hosts(&hosts, &[], &worker, &marker));

    let (out, fin) = (dir.path().join("run"), dir.path().join("run.pt"));
    let worker = restartable(&out, &fin);
    let worker: Vec<&str> = worker.iter().map(String::as_str).collect();
    let extra = ["--max-restarts", "1", "--monitor-interval", "0.1"];
    let running = torchrun_on_hosts(&hosts, &extra, &worker, &marker);
    assert!(
        wait_for_checkpoint(&out.join("checkpoints"), LIMIT),
        "no checkpoint was written in {}",
        out.display()
    );
    // Global ranks 2 and 3 run on whichever host joined the rendezvous second: kill rank 3.
    let victim = one_process(&marker, &["RANK=3", "TORCHELASTIC_RESTART_COUNT=0"]);
    assert!(
        sigkill(victim),
        "rank 3 (pid {victim}) was gone before the kill: the run is too short"
    );
    let finished = assert_all_succeeded("torchrun c10d --max-restarts 1", running);
    let all: String = finished.iter().map(|f| format!("{}\n{}", f.stdout, f.stderr)).collect();
    assert!(all.contains("resumed from"), "the restarted workers did not resume:\n{all}");
    assert_eq!(
        weights(&fin),
        weights(&ref_fin),
        "the restarted run differs from an uninterrupted one"
    );
}
