//! Several hosts, simulated: network namespaces joined by a switch, each with its own hostname
//! (tandem_testutil::netns). Launchers on two hosts form one world over the switch; training
//! across them equals training on one host. Needs root and iproute2 (CI has both); elsewhere the
//! tests are reported as skipped with the reason. Built with `harness = false` for that.
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::Duration;

use tandem_testutil::harness;
use tandem_testutil::netns::Hosts;
use tandem_testutil::{without_world, Finished, Running};

const LIMIT: Duration = Duration::from_secs(120);
const PORT: &str = "29400";

fn main() -> ExitCode {
    let why = Hosts::unavailable();
    let tests = tandem_testutil::tests![
        two_hosts_of_two_ranks_form_one_world,
        training_across_two_hosts_equals_training_on_one,
    ];
    harness::main(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

fn tandem() -> &'static str {
    env!("CARGO_BIN_EXE_tandem")
}

/// `tandem run` on every host (node rank = host index, master = host 0), each running `worker`.
fn launch_on_all(hosts: &Hosts, nproc: usize, worker: &[&str]) -> Vec<Finished> {
    let master = hosts.addr(0);
    let nnodes = hosts.len().to_string();
    let nproc = nproc.to_string();
    let running: Vec<Running> = (0..hosts.len())
        .map(|i| {
            let node_rank = i.to_string();
            let mut args = vec![
                "run",
                "--nnodes",
                &nnodes,
                "--node-rank",
                &node_rank,
                "--master-addr",
                &master,
                "--master-port",
                PORT,
                "--nproc-per-node",
                &nproc,
                "--",
            ];
            args.extend(worker);
            let mut cmd = hosts.command(i, tandem(), &args);
            without_world(&mut cmd);
            Running::spawn(&mut cmd)
        })
        .collect();
    running.into_iter().map(|r| r.wait(LIMIT)).collect()
}

fn assert_all_succeeded(finished: &[Finished]) {
    for (i, f) in finished.iter().enumerate() {
        assert!(
            f.status.is_some_and(|s| s.success()),
            "host {i}: {}\nstdout:\n{}\nstderr:\n{}",
            f.describe(),
            f.stdout,
            f.stderr
        );
    }
}

fn two_hosts_of_two_ranks_form_one_world() {
    let hosts = Hosts::new(2, None);
    let finished = launch_on_all(&hosts, 2, &[tandem(), "check"]);
    assert_all_succeeded(&finished);
    let all: String = finished.iter().map(|f| f.stdout.clone()).collect();
    // Four ranks, two per host: local rank r % 2 of 2 on its host, and every all-reduce checks out.
    for rank in 0..4 {
        let expect = format!("rank {rank}/4 local {}/2 ", rank % 2);
        let line = all
            .lines()
            .find(|l| l.contains(&expect))
            .unwrap_or_else(|| panic!("no `{expect}` line in:\n{all}"));
        assert!(line.trim_end().ends_with("ok"), "{line}");
    }
    // Host 1's launcher reports host 1's ranks.
    assert!(finished[1].stdout.contains("rank 2/4") && !finished[1].stdout.contains("rank 0/4"));
}

fn weights(path: &Path) -> Vec<(String, Vec<f64>)> {
    let v = tandem_ckpt::load(path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let mut out: Vec<(String, Vec<f64>)> = v
        .as_dict()
        .expect("a state dict")
        .iter()
        .map(|(k, t)| (k.as_str().unwrap().to_string(), t.as_tensor().unwrap().to_f64_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn training_across_two_hosts_equals_training_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["--epochs", "2", "--batch-size", "16", "--hidden", "32", "--model", "cnn"];
    let across = dir.path().join("across.pt");
    let hosts = Hosts::new(2, None);
    let out_dir = dir.path().join("across-run");
    let mut worker = vec![tandem(), "train", "--out", out_dir.to_str().unwrap()];
    worker.extend(["--save-final", across.to_str().unwrap()]);
    worker.extend(common);
    let finished = launch_on_all(&hosts, 2, &worker);
    assert_all_succeeded(&finished);
    assert!(finished[0].stdout.contains("final: epochs=2"), "{}", finished[0].stdout);

    // The same job on one host: 4 local ranks.
    let one = dir.path().join("one.pt");
    let mut cmd = Command::new(tandem());
    cmd.args([
        "train",
        "--nproc-per-node",
        "4",
        "--out",
        dir.path().join("one-run").to_str().unwrap(),
    ])
    .args(["--save-final", one.to_str().unwrap()])
    .args(common);
    without_world(&mut cmd);
    let single = Running::spawn(&mut cmd).wait(LIMIT);
    assert_all_succeeded(std::slice::from_ref(&single));

    let (a, b) = (weights(&across), weights(&one));
    assert_eq!(a.len(), b.len());
    for ((k, x), (_, y)) in a.iter().zip(&b) {
        let gap = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        // Same data, model and steps; only the all-reduce's summation order may differ.
        assert!(gap < 1e-4, "{k}: two hosts and one host differ by {gap}");
    }
}
