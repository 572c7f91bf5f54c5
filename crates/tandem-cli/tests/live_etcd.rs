//! `tandem run --live-recovery --rdzv-backend etcd` across three simulated hosts (network
//! namespaces, each with its own hostname and its own etcd member): the live job keeps its
//! membership on the cluster, so losing host 0 whole — its launcher, its workers and its etcd
//! member SIGKILLed — costs the job that host's ranks and nothing else, where with node 0's
//! own store it would end. The launcher started again on that host finds the job running and
//! its ranks join it. The face recipe run so finishes with the verification of an uninterrupted
//! run (within the 0.02 docs/live_recovery.md allows), and prints the samples/s it kept.
//! Skipped, with the reason, without the `etcd` feature (cargo test -p
//! tandem-cli --features etcd), an `etcd` binary or root's network namespaces, unless
//! TANDEM_REQUIRE_ETCD=1 (CI).
mod support;

use std::process::ExitCode;

use tandem_testutil::harness;

fn main() -> ExitCode {
    let why = unavailable();
    let why = harness::skip_unless_required(why, "TANDEM_REQUIRE_ETCD");
    let tests = tandem_testutil::tests![
        host_0_lost_whole_and_started_again_rejoins_the_running_job,
        the_face_recipe_loses_host_0_whole_and_verifies_as_an_uninterrupted_run,
        a_member_alone_lost_costs_nothing_and_a_lost_quorum_ends_the_job_naming_the_cluster,
    ];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

fn unavailable() -> Option<String> {
    if !cfg!(feature = "etcd") {
        return Some(
            "built without the `etcd` feature (cargo test -p tandem-cli --features etcd)".into(),
        );
    }
    tandem_testutil::etcd::etcd_missing().or_else(tandem_testutil::netns::Hosts::unavailable)
}

#[cfg(feature = "etcd")]
mod job {
    pub use std::time::{Duration, Instant};

    pub(crate) use super::support::{self, s, Finished, Running};
    use super::support::{leftovers, marked_processes_with, MARKER_VAR};
    use tandem_testutil::etcd::EtcdCluster;
    use tandem_testutil::netns::Hosts;
    use tandem_testutil::without_world;

    pub const LIMIT: Duration = Duration::from_secs(300);

    /// Polls until exactly one process of the trial matches, for up to `limit`.
    pub fn wait_for_one(marker: &str, also: &[&str], arg: &str, limit: Duration) -> i32 {
        let start = Instant::now();
        loop {
            if let [pid] = marked_processes_with(marker, also, arg)[..] {
                return pid;
            }
            assert!(start.elapsed() < limit, "no single {also:?} `{arg}` process within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Three simulated hosts, each with an etcd member: the cluster a live job keeps its
    /// membership on.
    pub struct Site {
        pub hosts: Hosts,
        pub cluster: EtcdCluster,
    }

    impl Site {
        pub fn new() -> Site {
            let hosts = Hosts::new(3, None);
            let cluster = EtcdCluster::start(
                3,
                |i| (hosts.addr(i), 2379, 2380),
                |i, args| hosts.command(i, "etcd", args),
            );
            Site { hosts, cluster }
        }

        /// `tandem run --nnodes 3 --node-rank i --nproc-per-node 2 --live-recovery
        /// --rdzv-backend etcd -- tandem WORKER` on host `i`, marked `run_id` (its run id too).
        pub fn launch(&self, i: usize, run_id: &str, worker: &[&str]) -> Running {
            self.launch_with(i, run_id, worker, &[])
        }

        /// [`Site::launch`] with more variables for the launcher and its workers.
        pub fn launch_with(
            &self,
            i: usize,
            run_id: &str,
            worker: &[&str],
            env: &[(&str, &str)],
        ) -> Running {
            let node_rank = i.to_string();
            let endpoints = self.cluster.joined();
            let mut args = vec![
                "run",
                "--nnodes",
                "3",
                "--node-rank",
                &node_rank,
                "--nproc-per-node",
                "2",
                "--live-recovery",
                "--max-restarts",
                "0",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoints",
                &endpoints,
                "--run-id",
                run_id,
                "--monitor-interval",
                "0.05",
                "--",
                support::tandem_exe(),
            ];
            args.extend(worker);
            let mut cmd = self.hosts.command(i, support::tandem_exe(), &args);
            without_world(&mut cmd);
            cmd.env(MARKER_VAR, run_id)
                .env("TANDEM_TIMEOUT", "3")
                .env("TANDEM_INIT_TIMEOUT", "60")
                .env("TANDEM_LIVE_ARRIVAL_TIMEOUT", "5")
                .envs(env.iter().copied());
            Running::spawn(&mut cmd)
        }

        /// The job on all three hosts, once its first and last ranks train.
        pub fn start_job(
            &self,
            marker: &str,
            worker: &[&str],
            env: &[(&str, &str)],
        ) -> Vec<Option<Running>> {
            let running = (0..3).map(|i| Some(self.launch_with(i, marker, worker, env))).collect();
            for rank in ["RANK=0", "RANK=5"] {
                wait_for_one(marker, &[rank], "train", Duration::from_secs(30));
            }
            running
        }

        /// Host 0 lost whole: its launcher SIGKILLed (its watchdog takes the workers) and its
        /// etcd member too. Returns when.
        pub fn lose_host_0(&mut self, launcher: Running) -> Instant {
            if !support::sigkill(launcher.pid()) {
                let f = launcher.wait(Duration::from_secs(1));
                panic!("host 0's launcher had already exited: {}", f.describe());
            }
            self.cluster.kill(0);
            let at = Instant::now();
            let lost = launcher.wait(Duration::from_secs(10));
            assert!(!lost.status.is_some_and(|s| s.success()), "{}", lost.describe());
            at
        }
    }

    /// Every launcher's output, one after the other.
    pub fn all_output(finished: &[&Finished]) -> String {
        finished.iter().map(|f| format!("{}\n{}\n", f.stdout, f.stderr)).collect()
    }

    pub fn assert_finished(h: usize, f: &Finished) {
        assert!(f.status.is_some_and(|s| s.success()), "host {h} did not finish: {}", f.describe());
    }

    pub fn assert_no_leftovers(marker: &str) {
        let left = leftovers(marker, Duration::from_secs(3));
        assert!(left.is_empty(), "processes of the job outlived it: {left:?}");
    }
}

/// Host 0 of a 3-host x 2-rank live job lost whole mid-training: hosts 1 and 2 regroup as a
/// world of 4 and train on; host 0's launcher, started again (its etcd member stays down:
/// quorum is 2 of 3), starts ranks 0 and 1 as joiners; they receive the training state from the
/// running ranks, and all three launchers finish the job.
#[cfg(feature = "etcd")]
fn host_0_lost_whole_and_started_again_rejoins_the_running_job() {
    use job::*;
    let mut site = Site::new();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let marker = format!("live-etcd-{}", std::process::id());
    let worker =
        ["train", "--epochs", "400", "--hidden", "16", "--batch-size", "4", "--out", s(&out)];
    let mut running = site.start_job(&marker, &worker, &[]);
    // Let the world form and train a little, then lose host 0 whole.
    std::thread::sleep(Duration::from_secs(3));
    let killed_at = site.lose_host_0(running[0].take().unwrap());
    // Host 0 comes back while the others train on: its ranks join the running job.
    std::thread::sleep(Duration::from_secs(4));
    let again = site.launch(0, &marker, &worker).wait(LIMIT);
    let rest: Vec<Finished> = running.into_iter().flatten().map(|r| r.wait(LIMIT)).collect();
    let took = killed_at.elapsed();

    assert!(
        again.status.is_some_and(|s| s.success()),
        "host 0 started again did not finish: {}\n{}",
        again.describe(),
        site.cluster.log_tail(1, 5)
    );
    assert!(
        again.stderr.contains("the job is running without node 0")
            && again.stderr.contains("starting ranks [0, 1] to join it"),
        "host 0's launcher did not join the running job:\n{}",
        again.stderr
    );
    for (h, f) in [1, 2].into_iter().zip(&rest) {
        assert_finished(h, f);
    }
    let text = all_output(&[&rest[0], &rest[1], &again]);
    let lost_line = text
        .lines()
        .find(|l| l.contains("live: regrouped") && l.contains("lost [0, 1]"))
        .unwrap_or_else(|| panic!("no regroup without host 0's ranks:\n{text}"));
    eprintln!("{lost_line}");
    assert!(
        text.contains("live: member 0 joined the running job")
            && text.contains("live: member 1 joined the running job"),
        "host 0's ranks did not join:\n{text}"
    );
    assert!(text.contains("final: "), "{text}");
    assert_no_leftovers(&marker);
    println!(
        "host 0 lost whole and started again 4 s later: the job finished {took:?} after the kill"
    );
}

/// The face recipe (IResNet-18 width 8 + PartialFC, 64 synthetic identities) on 3 hosts x 2
/// ranks, run uninterrupted and then with host 0 lost whole a third of the way in (not started
/// again): the 4 ranks left finish it, their verification accuracy within 0.02 of the
/// uninterrupted run's (the tolerance docs/live_recovery.md holds kills to). Prints the wall
/// time of both and the samples/s kept (the same epochs, so the same samples). Epochs:
/// `TANDEM_LIVE_ETCD_FACE_EPOCHS` (default 4).
#[cfg(feature = "etcd")]
fn the_face_recipe_loses_host_0_whole_and_verifies_as_an_uninterrupted_run() {
    use job::*;
    let epochs = std::env::var("TANDEM_LIVE_ETCD_FACE_EPOCHS").unwrap_or_else(|_| "4".into());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("faces");
    let made = support::tandem()
        .args(["data", "synth-faces", s(&data), "--classes", "64", "--per-class", "8"])
        .args(["--format", "jpeg", "--pairs", "200"])
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let rec = format!("rec:{}", data.display());
    let pairs = data.join("pairs.bin");
    let run = |name: &str, lose_after: Option<f64>| -> (f64, f64, String) {
        let mut site = Site::new();
        let out = dir.path().join(name);
        let marker = format!("live-etcd-face-{name}-{}", std::process::id());
        #[rustfmt::skip]
        let worker = [
            "train", "--model", "iresnet18", "--width", "8", "--embedding-size", "32",
            "--num-classes", "64", "--data", &rec, "--val", s(&pairs), "--batch-size", "4",
            "--seed", "7", "--epochs", &epochs, "--out", s(&out),
        ];
        let start = Instant::now();
        let mut running: Vec<Option<Running>> =
            (0..3).map(|i| Some(site.launch(i, &marker, &worker))).collect();
        if let Some(after) = lose_after {
            std::thread::sleep(Duration::from_secs_f64(after));
            site.lose_host_0(running[0].take().unwrap());
        }
        let finished: Vec<Finished> =
            running.into_iter().flatten().map(|r| r.wait(LIMIT)).collect();
        let wall = start.elapsed().as_secs_f64();
        let first = if lose_after.is_some() { 1 } else { 0 };
        for (h, f) in (first..3).zip(&finished) {
            assert_finished(h, f);
        }
        let text = all_output(&finished.iter().collect::<Vec<_>>());
        let verification = text
            .lines()
            .filter(|l| l.contains("final: "))
            .find_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("verification_accuracy="))
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .unwrap_or_else(|| panic!("{name}: no verification accuracy in the output:\n{text}"));
        assert_no_leftovers(&marker);
        (wall, verification, text)
    };
    let (whole_s, whole_acc, _) = run("uninterrupted", None);
    let (lost_s, lost_acc, text) = run("host0-lost", Some(whole_s / 3.0));
    let regroup = text
        .lines()
        .find(|l| l.contains("live: regrouped") && l.contains("lost [0, 1]"))
        .unwrap_or_else(|| panic!("no regroup without host 0's ranks:\n{text}"));
    eprintln!("{regroup}");
    println!(
        "face recipe, {epochs} epochs on 3 hosts x 2 ranks: uninterrupted {whole_s:.1} s, \
         verification {whole_acc:.4}; host 0 lost whole at {:.1} s: {lost_s:.1} s, verification \
         {lost_acc:.4}; samples/s retained {:.3}",
        whole_s / 3.0,
        whole_s / lost_s
    );
    assert!(
        (whole_acc - lost_acc).abs() <= 0.02,
        "verification {lost_acc} after losing host 0, {whole_acc} uninterrupted"
    );
}

/// An etcd member alone SIGKILLed (host 2's; the cluster keeps its quorum with 2 of 3): the job
/// trains on, no rank regroups. Then a second member killed (quorum lost): every launcher ends
/// in bounded time, the workers' error names the cluster, and the last checkpoint written
/// before is intact (`tandem ckpt inspect RUN/checkpoints/latest` reads it).
#[cfg(feature = "etcd")]
fn a_member_alone_lost_costs_nothing_and_a_lost_quorum_ends_the_job_naming_the_cluster() {
    use job::*;
    let mut site = Site::new();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let marker = format!("live-etcd-quorum-{}", std::process::id());
    #[rustfmt::skip]
    let worker = [
        "train", "--epochs", "2000", "--hidden", "16", "--batch-size", "4", "--save-every", "200",
        "--out", s(&out),
    ];
    // Store operations give up after 8 s (the workers' init timeout bounds them).
    let env = [("TANDEM_INIT_TIMEOUT", "8")];
    let running = site.start_job(&marker, &worker, &env);
    std::thread::sleep(Duration::from_secs(2));
    site.cluster.kill(2);
    // Long enough for every rank to have read the store many times (rank 0 between steps).
    std::thread::sleep(Duration::from_secs(4));
    let latest = out.join("checkpoints").join("latest");
    assert!(latest.is_file(), "no checkpoint written in 6 s of training");
    site.cluster.kill(1);
    let lost_at = Instant::now();
    let finished: Vec<Finished> = running.into_iter().flatten().map(|r| r.wait(LIMIT)).collect();
    let text = all_output(&finished.iter().collect::<Vec<_>>());
    // (No regroup can complete without the quorum, so any would have been a needless one.)
    assert!(!text.contains("live: regrouped"), "a rank regrouped after one member's loss:\n{text}");
    for (h, f) in finished.iter().enumerate() {
        assert!(!f.status.is_some_and(|s| s.success()), "host {h} finished without a quorum");
        eprintln!(
            "host {h} ended {:.1}s after the quorum was lost",
            (f.at - lost_at).as_secs_f64()
        );
        assert!(f.at - lost_at < Duration::from_secs(60), "host {h} took too long to end");
    }
    let named = text
        .lines()
        .find(|l| l.contains("etcd cluster at") && l.contains("quorum"))
        .unwrap_or_else(|| panic!("no error names the cluster:\n{text}"));
    eprintln!("{}", named.trim());
    assert!(named.contains(&site.cluster.endpoints()[0]), "{named}");
    let inspect = support::tandem().args(["ckpt", "inspect", s(&latest)]).output().unwrap();
    assert!(
        inspect.status.success(),
        "the last checkpoint is not readable: {}",
        String::from_utf8_lossy(&inspect.stderr)
    );
    assert_no_leftovers(&marker);
}

#[cfg(not(feature = "etcd"))]
fn a_member_alone_lost_costs_nothing_and_a_lost_quorum_ends_the_job_naming_the_cluster() {}

#[cfg(not(feature = "etcd"))]
fn host_0_lost_whole_and_started_again_rejoins_the_running_job() {}

#[cfg(not(feature = "etcd"))]
fn the_face_recipe_loses_host_0_whole_and_verifies_as_an_uninterrupted_run() {}
