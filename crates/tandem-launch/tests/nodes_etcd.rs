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
    match std::env::var(ROLE).as_deref() {
        Ok("launcher") => return launcher(),
        #[cfg(feature = "etcd")]
        Ok("get") => return get_key(),
        Ok(role) => panic!("unknown role {role}"),
        Err(_) => {}
    }
    let why = unavailable();
    let why = harness::skip_unless_required(why, "TANDEM_REQUIRE_ETCD");
    let tests = tandem_testutil::tests![
        an_elastic_job_goes_on_when_node_0_is_lost_whole,
        a_launcher_closing_the_round_that_dies_is_replaced_and_left_out,
        a_lost_node_started_again_is_admitted_into_the_running_job,
        a_spare_replaces_a_lost_node_and_another_ends_with_the_job,
    ];
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
    let rdzv_timeout =
        std::env::var("TANDEM_NODES_TEST_RDZV_TIMEOUT").map_or(30, |v| v.parse().unwrap());
    cfg.rdzv_timeout = std::time::Duration::from_secs(rdzv_timeout);
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

/// Prints the value of `TANDEM_NODES_TEST_KEY` on the cluster once it is set (up to 30 s):
/// the test reads the cluster from inside a simulated host, where its members are reachable.
#[cfg(feature = "etcd")]
fn get_key() -> ExitCode {
    use std::time::{Duration, Instant};
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let endpoints: Vec<String> =
        var("TANDEM_NODES_TEST_ENDPOINTS").split(',').map(String::from).collect();
    let store = tandem_comm::Store::connect_etcd(&endpoints, None, Duration::from_secs(10), "test")
        .unwrap();
    let key = var("TANDEM_NODES_TEST_KEY");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = store.get_now(&key).unwrap() {
            println!("{}", String::from_utf8_lossy(&v));
            return ExitCode::SUCCESS;
        }
        if Instant::now() > deadline {
            return ExitCode::FAILURE;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Three simulated hosts, each with an etcd member, for one job's launchers.
#[cfg(feature = "etcd")]
struct Site {
    hosts: tandem_testutil::netns::Hosts,
    cluster: tandem_testutil::etcd::EtcdCluster,
    endpoints: String,
    run_id: String,
    exe: String,
}

#[cfg(feature = "etcd")]
impl Site {
    fn new(run_id: &str) -> Site {
        let hosts = tandem_testutil::netns::Hosts::new(3, None);
        let cluster = tandem_testutil::etcd::EtcdCluster::start(
            3,
            |i| (hosts.addr(i), 2379, 2380),
            |i, args| hosts.command(i, "etcd", args),
        );
        let endpoints = cluster.joined();
        let exe = std::env::current_exe().unwrap().to_str().unwrap().to_string();
        let run_id = format!("{run_id}-{}", std::process::id());
        Site { hosts, cluster, endpoints, run_id, exe }
    }

    /// This binary in `role` on host `i`, with the job's settings.
    fn command(&self, i: usize, role: &str) -> std::process::Command {
        let mut cmd = self.hosts.command(i, &self.exe, &[]);
        cmd.env(ROLE, role)
            .env("TANDEM_NODES_TEST_NODE_RANK", i.to_string())
            .env("TANDEM_NODES_TEST_RUN_ID", &self.run_id)
            .env("TANDEM_NODES_TEST_ENDPOINTS", &self.endpoints);
        cmd
    }

    /// Host `i`'s launcher, running `worker` (a shell script).
    fn launch(&self, i: usize, worker: &str) -> tandem_testutil::Running {
        tandem_testutil::Running::spawn(
            self.command(i, "launcher").env("TANDEM_NODES_TEST_WORKER", worker),
        )
    }
}

#[cfg(feature = "etcd")]
fn an_elastic_job_goes_on_when_node_0_is_lost_whole() {
    use std::time::{Duration, Instant};
    use tandem_testutil::Running;

    let mut site = Site::new("nodes-etcd");
    let (hosts, run_id) = (&site.hosts, site.run_id.clone());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    // Attempt 0 waits (the kill comes then); attempt 1 records what it was started with.
    let worker = format!(
        "echo \"$WORLD_SIZE $GROUP_RANK $TANDEM_RDZV_BACKEND $TANDEM_RDZV_ID\" > \
         {out}/$(hostname).$TORCHELASTIC_RESTART_COUNT; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 60; fi"
    );
    let mut launchers: Vec<Option<Running>> =
        (0..3).map(|i| Some(site.launch(i, &worker))).collect();
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
    site.cluster.kill(lost);
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
            site.cluster.log_tail(h, 5)
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

/// The first launcher of an elastic job (`--nnodes 2:3`) claims closing round 0 and waits for a
/// second node; it is SIGKILLed there. Two launchers started after it find the closer gone
/// (its lease ran out), one of them takes its place, and the round closes with the two of
/// them alone: the dead launcher's join is left out, and both run their worker as a world of 2.
#[cfg(feature = "etcd")]
fn a_launcher_closing_the_round_that_dies_is_replaced_and_left_out() {
    use std::time::{Duration, Instant};

    let site = Site::new("nodes-etcd-closer");
    let (hosts, run_id) = (&site.hosts, &site.run_id);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let worker = format!("echo \"$WORLD_SIZE $GROUP_RANK\" > {out}/$(hostname)");
    let start = |i: usize| site.launch(i, &worker);
    // A key of the launchers' rendezvous, read from inside host 1 once it is set.
    let get = |key: &str| {
        let mut cmd = site.command(1, "get");
        cmd.env("TANDEM_NODES_TEST_KEY", format!("tandem/{run_id}/nodes/{key}"));
        let out = tandem_testutil::output_with_deadline(&mut cmd, Duration::from_secs(45));
        assert!(out.status.success(), "{key} never set: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let first = start(0);
    let closer = get("r0/closer");
    let pid: i32 = closer.rsplit('/').next().unwrap().parse().unwrap();
    assert_eq!(pid, first.pid(), "round 0's closer is not the only launcher: {closer}");
    // SAFETY: SIGKILL to the launcher this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed_at = Instant::now();
    let dead = first.wait(Duration::from_secs(10));
    assert!(!dead.status.is_some_and(|s| s.success()));
    let rest: Vec<_> =
        [1, 2].map(start).into_iter().map(|r| r.wait(Duration::from_secs(60))).collect();
    for (f, h) in rest.iter().zip([1, 2]) {
        assert!(f.status.is_some_and(|s| s.success()), "host {h}: {}", f.describe());
        let seen = std::fs::read_to_string(dir.path().join(hosts.hostname(h))).unwrap();
        assert!(seen.starts_with("2 "), "host {h} ran in a world of {seen}");
    }
    let took = killed_at.elapsed();
    let closed = get("r0/closed");
    assert!(closed.starts_with("ok 2 ") && closed.ends_with(" 2,3"), "round 0 closed as {closed}");
    assert!(!std::path::Path::new(&format!("{out}/{}", hosts.hostname(0))).exists());
    println!(
        "round 0's closer SIGKILLed before closing: replaced, round closed as `{closed}`, both \
         nodes done {took:?} after the kill"
    );
}

/// Elastic scale-up: node 0 of a `--nnodes 2:3` job lost whole (launcher and etcd member), the
/// other two go on as a world of 2 (round 1); its launcher started again waits in round 2, the
/// running nodes see it waiting, stop their workers without spending a restart, and all three
/// start round 2 as a world of 3.
#[cfg(feature = "etcd")]
fn a_lost_node_started_again_is_admitted_into_the_running_job() {
    use std::time::{Duration, Instant};
    use tandem_testutil::Running;

    let mut site = Site::new("nodes-etcd-admit");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    // Every round records how it started; rounds 0 and 1 then wait, round 2 finishes.
    let worker = format!(
        "echo \"$WORLD_SIZE $GROUP_RANK $TORCHELASTIC_RESTART_COUNT\" > \
         {out}/$(hostname).${{TANDEM_RDZV_ID##*.attempt}}; \
         case \"$TANDEM_RDZV_ID\" in *.attempt2) ;; *) sleep 60 ;; esac"
    );
    let hosts = &site.hosts;
    let round = |host: usize, k: u32| dir.path().join(format!("{}.{k}", hosts.hostname(host)));
    let wait_for = |what: &str, files: &[std::path::PathBuf]| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !files.iter().all(|f| f.exists()) {
            assert!(Instant::now() < deadline, "{what} never started");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let mut launchers: Vec<Option<Running>> =
        (0..3).map(|i| Some(site.launch(i, &worker))).collect();
    wait_for("round 0", &(0..3).map(|h| round(h, 0)).collect::<Vec<_>>());
    let lost = (0..3)
        .find(|&h| std::fs::read_to_string(round(h, 0)).unwrap().split(' ').nth(1) == Some("0"))
        .expect("one host is node 0");
    let host0 = launchers[lost].take().unwrap();
    // SAFETY: SIGKILL to the launcher this test started.
    unsafe { libc::kill(host0.pid(), libc::SIGKILL) };
    site.cluster.kill(lost);
    host0.wait(Duration::from_secs(10));
    let others: Vec<usize> = (0..3).filter(|&h| h != lost).collect();
    wait_for("round 1", &others.iter().map(|&h| round(h, 1)).collect::<Vec<_>>());
    let back_at = Instant::now();
    launchers[lost] = Some(site.launch(lost, &worker));
    let finished: Vec<_> =
        launchers.into_iter().flatten().map(|r| r.wait(Duration::from_secs(90))).collect();
    for (h, f) in (0..3).zip(&finished) {
        assert!(f.status.is_some_and(|s| s.success()), "host {h}: {}", f.describe());
        let seen = std::fs::read_to_string(round(h, 2)).unwrap();
        assert!(seen.starts_with("3 "), "host {h} ran round 2 as {seen}");
    }
    for &h in &others {
        let f = &finished[h];
        assert!(
            f.stderr.contains(&format!("a node ({}) is waiting to join", hosts.hostname(lost))),
            "host {h} did not admit the node: {}",
            f.stderr
        );
        // One restart for the loss; the admission spends none.
        let seen = std::fs::read_to_string(round(h, 2)).unwrap();
        assert!(seen.trim_end().ends_with(" 1"), "host {h}: round 2 with restart count {seen}");
    }
    println!(
        "node 0 lost whole and started again: admitted, the 3 nodes finished round 2 {:?} after \
         its launcher started",
        back_at.elapsed()
    );
}

/// Spares: a job running on its `--nnodes` maximum (3) gets a fourth launcher; it waits in the
/// next round without a deadline. One node's launcher SIGKILLed: the two left and the spare
/// start round 1 as a world of 3. A fifth launcher, come while round 1 runs full, waits too and
/// ends successfully, starting nothing, when the job finishes.
#[cfg(feature = "etcd")]
fn a_spare_replaces_a_lost_node_and_another_ends_with_the_job() {
    use std::time::{Duration, Instant};

    let site = Site::new("nodes-etcd-spare");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    // Round 0 waits (the kill comes then); later rounds finish after a moment.
    let worker = format!(
        "echo \"$WORLD_SIZE\" > {out}/$TANDEM_NODES_TEST_TAG.${{TANDEM_RDZV_ID##*.attempt}}; \
         case \"$TANDEM_RDZV_ID\" in *.attempt0) sleep 60 ;; *) sleep 4 ;; esac"
    );
    // A round's deadline of 3 s: a spare waits longer than that, for as long as the round
    // before it runs full.
    let launch = |host: usize, tag: &str| {
        tandem_testutil::Running::spawn(
            site.command(host, "launcher")
                .env("TANDEM_NODES_TEST_WORKER", &worker)
                .env("TANDEM_NODES_TEST_TAG", tag)
                .env("TANDEM_NODES_TEST_RDZV_TIMEOUT", "3"),
        )
    };
    let file = |tag: &str, k: u32| dir.path().join(format!("{tag}.{k}"));
    let wait_for = |what: &str, files: &[std::path::PathBuf]| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !files.iter().all(|f| f.exists()) {
            assert!(Instant::now() < deadline, "{what} never started");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let nodes: Vec<_> = (0..3).map(|h| launch(h, &format!("n{h}"))).collect();
    wait_for("round 0", &(0..3).map(|h| file(&format!("n{h}"), 0)).collect::<Vec<_>>());
    let spare = launch(0, "spare");
    // The spare waits past its round's 3 s deadline before a node is lost (then 3 s more,
    // the lost launcher's lease).
    std::thread::sleep(Duration::from_secs(4));
    let mut nodes = nodes.into_iter();
    let (n0, n1, n2) = (nodes.next().unwrap(), nodes.next().unwrap(), nodes.next().unwrap());
    // SAFETY: SIGKILL to a launcher this test started.
    unsafe { libc::kill(n2.pid(), libc::SIGKILL) };
    n2.wait(Duration::from_secs(10));
    wait_for("round 1", &["n0", "n1", "spare"].map(|t| file(t, 1)));
    let late = launch(1, "late");
    let finished: Vec<_> =
        [n0, n1, spare, late].into_iter().map(|r| r.wait(Duration::from_secs(90))).collect();
    for (f, tag) in finished.iter().zip(["n0", "n1", "spare", "late"]) {
        assert!(f.status.is_some_and(|s| s.success()), "{tag}: {}", f.describe());
    }
    for tag in ["n0", "n1", "spare"] {
        let seen = std::fs::read_to_string(file(tag, 1)).unwrap();
        assert_eq!(seen.trim(), "3", "{tag} ran round 1 in a world of {seen}");
    }
    assert!(!file("spare", 0).exists(), "the spare ran in the full round 0");
    assert!(!file("late", 1).exists() && !file("late", 2).exists(), "the late spare ran");
    assert!(
        finished[3].stderr.contains("while this node waited as a spare"),
        "{}",
        finished[3].stderr
    );
    println!("a spare took the lost node's place in round 1; a second spare ended with the job");
}

#[cfg(not(feature = "etcd"))]
fn a_spare_replaces_a_lost_node_and_another_ends_with_the_job() {}

#[cfg(not(feature = "etcd"))]
fn a_lost_node_started_again_is_admitted_into_the_running_job() {}

#[cfg(not(feature = "etcd"))]
fn an_elastic_job_goes_on_when_node_0_is_lost_whole() {}

#[cfg(not(feature = "etcd"))]
fn a_launcher_closing_the_round_that_dies_is_replaced_and_left_out() {}
