//! `--rdzv-backend etcd` across simulated hosts (network namespaces, each with its own hostname
//! and its own etcd member): the launchers meet on the cluster, so losing node 0 whole — its
//! launcher, its workers and its etcd member SIGKILLed — leaves an elastic job running on the
//! other nodes, where with node 0's own store it would end. This test binary (`harness =
//! false`) re-executes itself as each node's launcher (`TANDEM_NODES_TEST_ROLE`), in-process
//! `tandem_launch::launch` with `/bin/sh` workers. Skipped, with the reason, without the `etcd`
//! feature, an `etcd` binary or root's network namespaces, unless TANDEM_REQUIRE_ETCD=1 (CI).
use std::process::ExitCode;

use tandem_testutil::harness;

const ROLE: &str = "TANDEM_NODES_TEST_ROLE";

fn main() -> ExitCode {
    if std::env::var_os(ROLE).is_some() {
        return launcher();
    }
    let why = unavailable();
    let why = harness::skip_unless_required(why, "TANDEM_REQUIRE_ETCD");
    let tests = tandem_testutil::tests![an_elastic_job_goes_on_when_node_0_is_lost_whole];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

fn unavailable() -> Option<String> {
    if !cfg!(feature = "etcd") {
        return Some(
            "built without the `etcd` feature (cargo test -p tandem-launch --features etcd)".into(),
        );
    }
    tandem_testutil::etcd::etcd_missing().or_else(tandem_testutil::netns::Hosts::unavailable)
}

/// One node's launcher: `--nnodes 2:3 --nproc-per-node 1 --max-restarts 2 --rdzv-backend etcd`,
/// the worker script in `TANDEM_NODES_TEST_WORKER`. Exits with the launch's exit code.
fn launcher() -> ExitCode {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let mut cfg =
        tandem_launch::LaunchConfig::new("/bin/sh", ["-c", &var("TANDEM_NODES_TEST_WORKER")]);
    cfg.nnodes = 3;
    cfg.min_nnodes = Some(2);
    cfg.node_rank = var("TANDEM_NODES_TEST_NODE_RANK").parse().unwrap();
    cfg.nproc_per_node = tandem_launch::NprocPerNode::Count(1);
    cfg.max_restarts = 2;
    cfg.run_id = var("TANDEM_NODES_TEST_RUN_ID");
    cfg.rdzv_etcd = Some(var("TANDEM_NODES_TEST_ENDPOINTS").split(',').map(String::from).collect());
    cfg.rdzv_timeout = std::time::Duration::from_secs(30);
    cfg.monitor_interval = std::time::Duration::from_millis(50);
    cfg.stop_grace = std::time::Duration::from_secs(2);
    cfg.secret = tandem_comm::JobSecret::from_env().unwrap();
    cfg.on_event = tandem_launch::EventSink::new(|e| eprintln!("[launcher] {e}"));
    match tandem_launch::launch(&cfg) {
        Ok(out) => {
            eprintln!("[launcher] exit {}", out.exit_code);
            ExitCode::from(out.exit_code.clamp(0, 255) as u8)
        }
        Err(e) => {
            eprintln!("[launcher] error: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(feature = "etcd")]
fn an_elastic_job_goes_on_when_node_0_is_lost_whole() {
    use std::time::{Duration, Instant};
    use tandem_testutil::etcd::EtcdCluster;
    use tandem_testutil::netns::Hosts;
    use tandem_testutil::Running;

    let hosts = Hosts::new(3, None);
    let mut cluster = EtcdCluster::start(
        3,
        |i| (hosts.addr(i), 2379, 2380),
        |i, args| hosts.command(i, "etcd", args),
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    // Attempt 0 waits (the kill comes then); attempt 1 records what it was started with.
    let worker = format!(
        "echo \"$WORLD_SIZE $GROUP_RANK $TANDEM_RDZV_BACKEND $TANDEM_RDZV_ID\" > \
         {out}/$(hostname).$TORCHELASTIC_RESTART_COUNT; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi"
    );
    let run_id = format!("nodes-etcd-{}", std::process::id());
    let exe = std::env::current_exe().unwrap();
    let mut launchers: Vec<Option<Running>> = (0..3)
        .map(|i| {
            let mut cmd = hosts.command(i, exe.to_str().unwrap(), &[]);
            cmd.env(ROLE, "launcher")
                .env("TANDEM_NODES_TEST_NODE_RANK", i.to_string())
                .env("TANDEM_NODES_TEST_RUN_ID", &run_id)
                .env("TANDEM_NODES_TEST_ENDPOINTS", cluster.joined())
                .env("TANDEM_NODES_TEST_WORKER", &worker);
            Some(Running::spawn(&mut cmd))
        })
        .collect();
    let attempt = |host: usize, k: u32| dir.path().join(format!("{}.{k}", hosts.hostname(host)));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(0..3).all(|h| attempt(h, 0).exists()) {
        assert!(Instant::now() < deadline, "the 3 nodes never started attempt 0");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Every node's workers of attempt 0 met on etcd, under the attempt's own id.
    let mut node0 = None;
    for h in 0..3 {
        let seen = std::fs::read_to_string(attempt(h, 0)).unwrap();
        assert!(
            seen.starts_with("3 ") && seen.contains(&format!(" etcd {run_id}.attempt0")),
            "{seen}"
        );
        if seen.split(' ').nth(1) == Some("0") {
            node0 = Some(h);
        }
    }
    // Node 0 of the running round (the launcher that closed it; under the static backend, the
    // one that hosts the store) lost whole: its launcher (its watchdog takes the workers) and
    // its etcd member.
    let lost = node0.expect("one host is node 0");
    let killed_at = Instant::now();
    let host0 = launchers[lost].take().unwrap();
    // SAFETY: SIGKILL to the launcher this test started.
    unsafe { libc::kill(host0.pid(), libc::SIGKILL) };
    cluster.kill(lost);
    let host0 = host0.wait(Duration::from_secs(10));
    assert!(!host0.status.is_some_and(|s| s.success()));

    let rest: Vec<_> =
        launchers.into_iter().flatten().map(|r| r.wait(Duration::from_secs(90))).collect();
    let took = killed_at.elapsed();
    let others: Vec<usize> = (0..3).filter(|&h| h != lost).collect();
    for (f, &h) in rest.iter().zip(&others) {
        assert!(
            f.status.is_some_and(|s| s.success()),
            "host {h} did not finish: {}\n{}",
            f.stderr,
            cluster.log_tail(h, 5)
        );
        assert!(
            f.stderr.contains(&format!("node 0 ({}): its launcher is gone", hosts.hostname(lost))),
            "host {h} does not name the lost node: {}",
            f.stderr
        );
        // Attempt 1: a world of the two nodes left, still on etcd, under a new id.
        let seen = std::fs::read_to_string(attempt(h, 1)).unwrap();
        assert!(
            seen.starts_with("2 ") && seen.contains(&format!(" etcd {run_id}.attempt1")),
            "{seen}"
        );
    }
    let ranks: Vec<String> = others
        .iter()
        .map(|&h| {
            std::fs::read_to_string(attempt(h, 1)).unwrap().split(' ').nth(1).unwrap().to_string()
        })
        .collect();
    assert!(ranks.contains(&"0".to_string()) && ranks.contains(&"1".to_string()), "{ranks:?}");
    println!(
        "node 0 ({}) lost whole: the 2 other nodes finished as a world of 2, {took:?} after the \
         kill",
        hosts.hostname(lost)
    );
}

#[cfg(not(feature = "etcd"))]
fn an_elastic_job_goes_on_when_node_0_is_lost_whole() {}
