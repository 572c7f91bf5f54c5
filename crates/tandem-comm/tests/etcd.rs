//! The store on a real 3-member etcd cluster (feature `etcd`; Debian's `etcd-server`), each
//! member a process on loopback with ports of its own: every store operation, keys owned by a
//! process that go with it, a world of ranks formed with `TANDEM_RDZV_BACKEND=etcd` (no rank
//! hosts anything), the same with one member SIGKILLed (quorum kept), and a clear error naming
//! the endpoints once the quorum is lost. This test binary (`harness = false`) re-executes
//! itself as each rank and as an owning process (`TANDEM_ETCD_TEST_ROLE`). Skipped, with the
//! reason, without the feature or without an `etcd` binary, unless TANDEM_REQUIRE_ETCD=1 (CI).
use std::process::ExitCode;

use tandem_testutil::harness;

const ROLE: &str = "TANDEM_ETCD_TEST_ROLE";

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        #[cfg(feature = "etcd")]
        cluster_tests::role(&role);
        #[cfg(not(feature = "etcd"))]
        panic!("role {role} needs the etcd feature");
        #[allow(unreachable_code)]
        return ExitCode::SUCCESS;
    }
    let why = harness::skip_unless_required(unavailable(), "TANDEM_REQUIRE_ETCD");
    #[cfg(feature = "etcd")]
    let tests = {
        use cluster_tests::*;
        tandem_testutil::tests![
            every_store_operation_works_across_the_members,
            owned_keys_live_with_their_process_and_go_when_it_is_killed,
            a_world_forms_over_etcd_and_again_with_a_member_lost,
            a_member_down_does_not_slow_the_requests,
            a_silent_member_costs_neither_the_owned_keys_nor_the_requests,
            a_cluster_without_quorum_is_a_clear_error_naming_the_endpoints,
        ]
    };
    #[cfg(not(feature = "etcd"))]
    let tests = tandem_testutil::tests![etcd_store];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

#[cfg(not(feature = "etcd"))]
fn etcd_store() {}

fn unavailable() -> Option<String> {
    if !cfg!(feature = "etcd") {
        return Some(
            "built without the `etcd` feature (cargo test -p tandem-comm --features etcd)".into(),
        );
    }
    tandem_testutil::etcd::etcd_missing()
}

#[cfg(feature = "etcd")]
mod cluster_tests {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use tandem_comm::{CommError, ReduceOp, Store};
    use tandem_testutil::etcd::EtcdCluster;
    use tandem_testutil::{tail, wait_with_deadline};

    use super::ROLE;

    /// The etcd store's lease TTL (store/etcd.rs): an owned key outlives its process this long.
    const LEASE_TTL: Duration = Duration::from_secs(3);

    /// Three etcd members on loopback.
    fn cluster() -> EtcdCluster {
        EtcdCluster::on_loopback(3)
    }

    fn store_on(endpoints: &[String]) -> Store {
        Store::connect_etcd(endpoints, None, Duration::from_secs(30), "test endpoints").unwrap()
    }

    fn unique(what: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!("{what}-{}-{nanos}", std::process::id())
    }

    pub fn every_store_operation_works_across_the_members() {
        let cluster = cluster();
        // Two clients, each on a different member: what one writes, the other reads.
        let scope = unique("ops");
        let a = store_on(&cluster.endpoints()[..1]).with_prefix(&scope);
        let b = store_on(&cluster.endpoints()[1..2]).with_prefix(&scope);
        a.set("k", b"v1").unwrap();
        assert_eq!(b.get("k").unwrap(), b"v1");
        assert_eq!(b.get_now("nothing").unwrap(), None);
        assert_eq!(a.missing(&["k", "m1", "m2"]).unwrap(), vec!["m1", "m2"]);

        // get waits for a key another client sets later.
        let setter = {
            let b = b.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                b.set("later", b"here").unwrap();
            })
        };
        let start = Instant::now();
        assert_eq!(a.get("later").unwrap(), b"here");
        assert!(start.elapsed() >= Duration::from_millis(250), "{:?}", start.elapsed());
        setter.join().unwrap();

        // A wait that times out names the keys still missing, as the caller spelled them.
        match a.wait_timeout(&["k", "never"], Duration::from_millis(300)) {
            Err(CommError::StoreTimeout { key, .. }) => assert_eq!(key, "never"),
            other => panic!("expected a timeout naming `never`, got {other:?}"),
        }

        // add from two clients on two members at once: no increment lost.
        let adders: Vec<_> = [a.clone(), b.clone()]
            .into_iter()
            .map(|s| {
                std::thread::spawn(move || {
                    for _ in 0..40 {
                        s.add("n", 1).unwrap();
                    }
                })
            })
            .collect();
        adders.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(a.add("n", 0).unwrap(), 80);
        assert_eq!(b.get("n").unwrap(), b"80");

        // compare_set: PyTorch's semantics.
        assert_eq!(
            a.compare_set("c", b"", b"first").unwrap(),
            b"first",
            "missing key, empty expected"
        );
        assert_eq!(b.compare_set("c", b"wrong", b"second").unwrap(), b"first", "mismatch");
        assert_eq!(b.compare_set("c", b"first", b"second").unwrap(), b"second", "match");
        assert_eq!(a.compare_set("none", b"x", b"y").unwrap(), b"", "missing key, expected x");
        assert_eq!(a.get_now("none").unwrap(), None);

        assert!(a.delete("k").unwrap());
        assert!(!a.delete("k").unwrap());
        assert_eq!(b.get_now("k").unwrap(), None);
    }

    pub fn owned_keys_live_with_their_process_and_go_when_it_is_killed() {
        let cluster = cluster();
        let store = store_on(cluster.endpoints());
        // Dropping the client revokes its lease: the key goes at once.
        let scope = unique("owned");
        {
            let owner = store_on(cluster.endpoints()).with_prefix(&scope);
            owner.set_owned("mine", b"1").unwrap();
            assert_eq!(store.with_prefix(&scope).get_now("mine").unwrap(), Some(b"1".to_vec()));
        }
        assert_eq!(store.with_prefix(&scope).get_now("mine").unwrap(), None, "not revoked on drop");

        // A process that owns a key keeps it past the lease's TTL (kept alive), and loses it
        // within the TTL (and a second) of its SIGKILL.
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(ROLE, "own")
            .env("TANDEM_ETCD_TEST_ENDPOINTS", cluster.joined())
            .env("TANDEM_ETCD_TEST_SCOPE", &scope)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "OWNED", "{line}");
        let scoped = store.with_prefix(&scope);
        std::thread::sleep(Duration::from_secs(5));
        assert_eq!(scoped.get_now("alive").unwrap(), Some(b"yes".to_vec()), "lease not kept alive");
        let _ = child.kill();
        let _ = child.wait();
        let killed = Instant::now();
        while scoped.get_now("alive").unwrap().is_some() {
            assert!(killed.elapsed() < Duration::from_secs(5), "owned key outlived its process");
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("owned key gone {:?} after its process was killed", killed.elapsed());
    }

    /// Starts `n` ranks (this binary, role `rank`) on the cluster; returns their outputs.
    fn world(endpoints: &str, run_id: &str, n: usize) -> Vec<String> {
        let ended = world_with(endpoints, run_id, n, |_| SECRET, 30);
        let failed = ended.iter().any(|(status, ..)| !status.is_some_and(|s| s.success()));
        let report: Vec<String> = ended
            .iter()
            .enumerate()
            .map(|(r, (status, out, err))| format!("rank {r}: {status:?}\n{out}{}", tail(err, 6)))
            .collect();
        assert!(!failed, "{}", report.join("\n"));
        ended.into_iter().map(|(_, out, _)| out).collect()
    }

    /// The job's secret every rank of [`world`] holds (the mesh checks it; etcd cannot).
    const SECRET: &str = "5a1e6d9c0b7f4e2a8c3d1f6b9e0a4c7d2f5b8e1a3c6d9f0b2e4a7c1d3f6b8e0a";

    /// Starts `n` ranks; rank `r` holds `secret(r)`. Each one's exit, stdout and stderr.
    fn world_with(
        endpoints: &str,
        run_id: &str,
        n: usize,
        secret: impl Fn(usize) -> &'static str,
        init_timeout_s: u32,
    ) -> Vec<(Option<std::process::ExitStatus>, String, String)> {
        let ranks: Vec<Child> = (0..n)
            .map(|r| {
                Command::new(std::env::current_exe().unwrap())
                    .env(ROLE, "rank")
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("LOCAL_WORLD_SIZE", n.to_string())
                    .env_remove("MASTER_ADDR")
                    .env_remove("MASTER_PORT")
                    .env("TANDEM_RDZV_BACKEND", "etcd")
                    .env("TANDEM_RDZV_ENDPOINTS", endpoints)
                    .env("TANDEM_RUN_ID", run_id)
                    .env("TANDEM_INIT_TIMEOUT", init_timeout_s.to_string())
                    .env("TANDEM_SECRET", secret(r))
                    .env_remove("TANDEM_SECRET_FILE")
                    .env("TANDEM_TRANSPORT", "tcp")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        ranks
            .into_iter()
            .map(|mut c| {
                let status = wait_with_deadline(&mut c, Duration::from_secs(60));
                let mut out = String::new();
                std::io::Read::read_to_string(&mut c.stdout.take().unwrap(), &mut out).unwrap();
                let mut err = String::new();
                std::io::Read::read_to_string(&mut c.stderr.take().unwrap(), &mut err).unwrap();
                (status, out, err)
            })
            .collect()
    }

    pub fn a_world_forms_over_etcd_and_again_with_a_member_lost() {
        let mut cluster = cluster();
        let run_id = unique("world");
        let check = |outs: &[String], generation: &str| {
            for (r, out) in outs.iter().enumerate() {
                assert!(out.contains(&format!("OK rank={r} size=3 sum=6")), "rank {r}: {out}");
                assert!(out.contains(generation), "rank {r} not in {generation}: {out}");
            }
        };
        check(&world(&cluster.joined(), &run_id, 3), "/g0/");
        // The same run id again (a restart): the next generation, never the first's keys.
        check(&world(&cluster.joined(), &run_id, 3), "/g1/");
        // One member SIGKILLed: the other two keep the quorum and the store.
        cluster.kill(0);
        check(&world(&cluster.joined(), &run_id, 3), "/g2/");
        // A rank with another secret finds the store open (etcd cannot check it) but not the
        // mesh: it is refused, and the others never run a collective with it.
        let other = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let ended =
            world_with(&cluster.joined(), &run_id, 3, |r| if r == 2 { other } else { SECRET }, 5);
        for (r, (status, out, err)) in ended.iter().enumerate() {
            assert!(!status.is_some_and(|s| s.success()), "rank {r} succeeded: {out}");
            assert!(!out.contains("OK rank="), "rank {r} ran a collective: {out}");
            if r == 2 {
                assert!(err.contains("secret"), "rank 2 does not say why: {}", tail(err, 8));
                let why = err.lines().find(|l| l.contains("secret")).unwrap_or_default();
                println!("rank 2 with another secret: {why}");
            }
        }
    }

    /// A client whose first endpoint is a member SIGKILLed (a lost host's) goes to the others:
    /// no request waits on the dead member. (Live recovery's rank 0 reads the store between
    /// steps: a request held up there holds up every rank.)
    pub fn a_member_down_does_not_slow_the_requests() {
        let mut cluster = cluster();
        let store = Store::connect_etcd(cluster.endpoints(), None, Duration::from_secs(10), "test")
            .unwrap()
            .with_prefix(&unique("down"));
        store.set("k", b"1").unwrap();
        let times = |n: usize| -> Vec<f64> {
            let mut t: Vec<f64> = (0..n)
                .map(|_| {
                    let start = Instant::now();
                    store.get_now("k").unwrap();
                    start.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            t.sort_by(f64::total_cmp);
            t
        };
        let up = times(200);
        cluster.kill(0);
        // Let the client's channel see the member gone.
        let _ = times(20);
        let down = times(200);
        println!(
            "get with 3 members: median {:.2} ms, max {:.2} ms; with member 0 down: median {:.2} \
             ms, max {:.2} ms",
            up[100], up[199], down[100], down[199]
        );
        // (Bounds far above a request's cost: a retry after a failed try pauses 50 ms.)
        assert!(
            down[100] < 20.0 && down[190] < 40.0,
            "requests wait on the dead member: median {:.2} ms, 95th percentile {:.2} ms",
            down[100],
            down[190]
        );
    }

    /// A member that is there but answers nothing — SIGSTOPped, as one behind a cut link (its
    /// connections stay open, no error comes) — for twice the lease's TTL: the client's owned
    /// key stays (its keep-alive moved to another member), and no request waits for the
    /// silent member much longer than one try.
    pub fn a_silent_member_costs_neither_the_owned_keys_nor_the_requests() {
        let cluster = cluster();
        let prefix = unique("silent");
        let open = || {
            Store::connect_etcd(cluster.endpoints(), None, Duration::from_secs(10), "test")
                .unwrap()
                .with_prefix(&prefix)
        };
        // (Both clients talk to member 0 first: the one to be silenced.)
        let (owner, reader) = (open(), open());
        owner.set_owned("alive", b"1").unwrap();
        assert!(cluster.signal(0, libc::SIGSTOP));
        let start = Instant::now();
        let mut slowest = Duration::ZERO;
        while start.elapsed() < LEASE_TTL * 2 {
            let t = Instant::now();
            let seen = reader.get_now("alive");
            slowest = slowest.max(t.elapsed());
            assert!(
                seen.as_ref().is_ok_and(|v| v.is_some()),
                "the owned key went {:?} after member 0 fell silent: {seen:?}",
                start.elapsed()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(cluster.signal(0, libc::SIGCONT));
        println!(
            "member 0 silent for {:?}: the owned key stayed; slowest get {slowest:?}",
            LEASE_TTL * 2
        );
        assert!(slowest < Duration::from_secs(4), "a get waited {slowest:?} on the silent member");
    }

    pub fn a_cluster_without_quorum_is_a_clear_error_naming_the_endpoints() {
        let mut cluster = cluster();
        // An operation waits out its timeout for a leader (a member may be restarting), then
        // fails naming the cluster.
        let timeout = Duration::from_secs(4);
        let store = Store::connect_etcd(cluster.endpoints(), None, timeout, "test endpoints")
            .unwrap()
            .with_prefix(&unique("quorum"));
        store.set("before", b"1").unwrap();
        cluster.kill(0);
        cluster.kill(1);
        let start = Instant::now();
        let err = store.set("after", b"1").unwrap_err().to_string();
        let took = start.elapsed();
        assert!(err.contains(&cluster.joined()), "the error does not name the endpoints: {err}");
        assert!(err.contains("quorum"), "{err}");
        assert!(took < timeout + Duration::from_secs(3), "took {took:?}: {err}");
        println!("without quorum, after {took:?}: {err}");
        // Nothing answers at all: connecting fails within its timeout, naming them too.
        cluster.kill(2);
        let start = Instant::now();
        let err = Store::connect_etcd(
            cluster.endpoints(),
            None,
            Duration::from_secs(3),
            "TANDEM_RDZV_ENDPOINTS",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(&cluster.joined()) && err.contains("TANDEM_RDZV_ENDPOINTS"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    }

    /// The child side.
    pub fn role(role: &str) {
        match role {
            "own" => {
                let endpoints: Vec<String> = std::env::var("TANDEM_ETCD_TEST_ENDPOINTS")
                    .unwrap()
                    .split(',')
                    .map(str::to_string)
                    .collect();
                let scope = std::env::var("TANDEM_ETCD_TEST_SCOPE").unwrap();
                let store = Store::connect_etcd(&endpoints, None, Duration::from_secs(30), "test")
                    .unwrap()
                    .with_prefix(&scope);
                store.set_owned("alive", b"yes").unwrap();
                println!("OWNED");
                std::thread::sleep(Duration::from_secs(60));
            }
            "rank" => {
                let pg = tandem_comm::init().unwrap_or_else(|e| panic!("init: {e}"));
                let mut v = [pg.rank() as i64 + 1];
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                pg.barrier().unwrap();
                println!(
                    "OK rank={} size={} sum={} store={:?}",
                    pg.rank(),
                    pg.size(),
                    v[0],
                    pg.store()
                );
            }
            other => panic!("unknown role {other}"),
        }
    }
}
