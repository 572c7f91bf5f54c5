//! Real processes: this test binary (`harness = false`) re-executes itself as each rank, with
//! `TANDEM_TEST_ROLE` and the launcher variables of that rank; `main` starts the role before
//! any test runs. Covers env:// (torchrun), Slurm and OpenMPI detection and a
//! rank killed with SIGKILL in the middle of all_reduce. Every child is bounded in time.
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tandem_comm::ReduceOp;

const ROLE: &str = "TANDEM_TEST_ROLE";

fn main() -> std::process::ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        worker(&role);
        return std::process::ExitCode::SUCCESS;
    }
    tandem_testutil::harness::main(tandem_testutil::tests![
        torchrun_env_world_of_three,
        slurm_and_openmpi_variables,
        a_job_with_another_run_id_is_refused,
        a_plain_init_under_the_live_launcher_is_refused_at_once,
        killed_rank_fails_survivors_tcp,
        killed_rank_fails_survivors_shm,
        shm_creation_failure_falls_back_to_tcp_and_leaves_no_file,
        torch_distributed_debug_info_logs_set_up_and_detail_checks_every_call,
    ])
}

/// The child side: one rank of a world the test started.
fn worker(role: &str) {
    let pg = match tandem_comm::init() {
        Ok(pg) => pg,
        Err(e) => {
            println!("INIT-ERROR {e}");
            std::process::exit(3);
        }
    };
    let (r, n) = (pg.rank(), pg.size());
    match role {
        "sum" => {
            let mut v: Vec<f64> = (0..1001).map(|i| (i * (r + 1)) as f64).collect();
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            let f: usize = (1..=n).sum();
            assert!(v.iter().enumerate().all(|(i, x)| *x == (i * f) as f64));
            let names = pg.all_gather_bytes(format!("rank{r}").as_bytes()).unwrap();
            pg.barrier().unwrap();
            println!(
                "OK rank={r} size={n} local={}/{} transport={:?} names={}",
                pg.local_rank(),
                pg.local_size(),
                pg.transport(),
                names
                    .iter()
                    .map(|b| String::from_utf8_lossy(b).to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        "loop" => {
            let mut v = vec![1.0f32; 1 << 20];
            let mut i = 0u64;
            loop {
                if let Err(e) = pg.all_reduce(&mut v, ReduceOp::Sum) {
                    println!("COMM-ERROR {e}");
                    std::process::exit(4);
                }
                v.iter_mut().for_each(|x| *x = 1.0);
                i += 1;
                if i == 3 {
                    println!("READY");
                }
            }
        }
        "desync" => {
            // Rank 0 reduces while rank 1 runs an all_to_all: only a desync check tells.
            let r = if r == 0 {
                pg.reduce(&mut [1i64; 4], ReduceOp::Sum, 1)
            } else {
                pg.all_to_all_single(&[1i64; 2], &mut [0; 2], None, None)
            };
            match r {
                Ok(()) => println!("NO-ERROR"),
                Err(e) => println!("COMM-ERROR {e}"),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, vars: &[(String, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    tandem_testutil::without_world(&mut cmd).env(ROLE, role);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.env("TANDEM_INIT_TIMEOUT", "20").stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.spawn().expect("spawn worker")
}

fn finish(children: Vec<Child>, limit: Duration) -> Vec<(Option<i32>, String)> {
    children
        .into_iter()
        .map(|c| {
            let mut c = c;
            let status = tandem_testutil::wait_with_deadline(&mut c, limit);
            let out = c
                .wait_with_output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            (status.and_then(|s| s.code()), out)
        })
        .collect()
}

fn vars(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

fn torchrun_env_world_of_three() {
    let port = tandem_testutil::free_port().to_string();
    let kids: Vec<Child> = (0..3)
        .map(|r| {
            spawn(
                "sum",
                &vars(&[
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", "3".into()),
                    ("LOCAL_RANK", r.to_string()),
                    ("LOCAL_WORLD_SIZE", "3".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("TORCHELASTIC_RUN_ID", "envtest".into()),
                ]),
            )
        })
        .collect();
    for (r, (code, out)) in finish(kids, Duration::from_secs(60)).into_iter().enumerate() {
        assert_eq!(code, Some(0), "rank {r}: {out}");
        assert!(
            out.contains(&format!(
                "OK rank={r} size=3 local={r}/3 transport=Some(Shm) names=rank0,rank1,rank2"
            )),
            "rank {r}: {out}"
        );
    }
}

fn slurm_and_openmpi_variables() {
    let port = tandem_testutil::free_port().to_string();
    let slurm: Vec<Child> = (0..2)
        .map(|r| {
            spawn(
                "sum",
                &vars(&[
                    ("SLURM_PROCID", r.to_string()),
                    ("SLURM_NTASKS", "2".into()),
                    ("SLURM_LOCALID", r.to_string()),
                    ("SLURM_JOB_NODELIST", "localhost".into()),
                    ("MASTER_PORT", port.clone()),
                    ("TANDEM_TRANSPORT", "tcp".into()),
                ]),
            )
        })
        .collect();
    for (r, (code, out)) in finish(slurm, Duration::from_secs(60)).into_iter().enumerate() {
        assert_eq!(code, Some(0), "slurm rank {r}: {out}");
        assert!(
            out.contains(&format!("OK rank={r} size=2 local={r}/2 transport=Some(Tcp)")),
            "{out}"
        );
    }
    let port = tandem_testutil::free_port().to_string();
    let mpi: Vec<Child> = (0..2)
        .map(|r| {
            spawn(
                "sum",
                &vars(&[
                    ("OMPI_COMM_WORLD_RANK", r.to_string()),
                    ("OMPI_COMM_WORLD_SIZE", "2".into()),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
                    ("MASTER_PORT", port.clone()),
                ]),
            )
        })
        .collect();
    for (r, (code, out)) in finish(mpi, Duration::from_secs(60)).into_iter().enumerate() {
        assert_eq!(code, Some(0), "openmpi rank {r}: {out}");
        assert!(out.contains(&format!("OK rank={r} size=2")), "{out}");
    }
}

fn a_job_with_another_run_id_is_refused() {
    let port = tandem_testutil::free_port().to_string();
    let base = |r: usize, id: &str| {
        vars(&[
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TANDEM_RUN_ID", id.into()),
        ])
    };
    let mut rank0 = spawn("sum", &base(0, "job-a"));
    let intruder = spawn("sum", &base(1, "job-b"));
    let (code, out) = finish(vec![intruder], Duration::from_secs(30)).remove(0);
    let _ = rank0.kill();
    let _ = rank0.wait();
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.contains("INIT-ERROR") && !out.contains("\"job-a\"") && out.contains("\"job-b\""),
        "{out}"
    );
}

/// A program that calls `init()` under `tandem run --live-recovery` would wait for a fixed
/// world the launcher never forms; it fails at once, naming the variable and what to use.
fn a_plain_init_under_the_live_launcher_is_refused_at_once() {
    let port = tandem_testutil::free_port().to_string();
    let child = spawn(
        "sum",
        &vars(&[
            ("RANK", "0".into()),
            ("WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TANDEM_LIVE_STORE", format!("127.0.0.1:{port}")),
        ]),
    );
    let started = Instant::now();
    let (code, out) = finish(vec![child], Duration::from_secs(15)).remove(0);
    assert_eq!(code, Some(3), "{out}");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert!(out.contains("TANDEM_LIVE_STORE") && out.contains("LiveTraining"), "{out}");
}

/// SIGKILL one rank in the middle of a stream of 4 MiB all_reduces: every survivor's collective
/// fails (no hang) within the default 10 s, naming the operation, its sequence number and a peer.
fn kill_mid_all_reduce(transport: &str) {
    let port = tandem_testutil::free_port().to_string();
    let n = 3;
    let mut kids: Vec<Child> = (0..n)
        .map(|r| {
            spawn(
                "loop",
                &vars(&[
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", n.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("TANDEM_TRANSPORT", transport.into()),
                ]),
            )
        })
        .collect();
    // Wait until rank 1 has run a few all_reduces, then kill it mid-stream.
    let mut out1 = kids[1].stdout.take().expect("stdout");
    let ready = std::thread::spawn(move || {
        use std::io::BufRead;
        let lines = std::io::BufReader::new(&mut out1).lines();
        for line in lines.map_while(Result::ok) {
            if line.contains("READY") {
                break;
            }
        }
    });
    let t0 = Instant::now();
    while !ready.is_finished() && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(ready.is_finished(), "rank 1 never reported READY");
    std::thread::sleep(Duration::from_millis(30));
    let killed_at = Instant::now();
    kids[1].kill().expect("kill rank 1");
    let _ = kids[1].wait();
    let victim = kids.remove(1);
    drop(victim);
    let results = finish(kids, Duration::from_secs(25));
    let took = killed_at.elapsed();
    eprintln!("{transport}: survivors failed after {took:?}: {results:?}");
    for (code, out) in &results {
        assert_eq!(*code, Some(4), "{transport}: survivor did not fail cleanly: {out}");
        assert!(out.contains("COMM-ERROR all_reduce #"), "{out}");
        assert!(out.contains("peer rank"), "{out}");
    }
    assert!(took < Duration::from_secs(11), "{transport}: survivors took {took:?}");
    // Every survivor's error leads to the dead rank: directly, or through the group's first
    // failure, recorded in the store by the rank that saw it first.
    for (_, out) in &results {
        // libtest may print "test worker ... " on the same line first.
        let line = out.lines().find_map(|l| l.find("COMM-ERROR").map(|i| &l[i..])).unwrap_or("");
        let direct =
            line.contains("COMM-ERROR all_reduce #") && line.contains("peer rank 1 closed");
        let via_first = line.contains("first failure in this group: rank") && line.ends_with("peer rank 1 closed its connection (process exited, crashed, or aborted this collective after its own failure)");
        assert!(direct || via_first, "{transport}: {line}");
    }
}

fn killed_rank_fails_survivors_tcp() {
    kill_mid_all_reduce("tcp");
}

fn killed_rank_fails_survivors_shm() {
    kill_mid_all_reduce("shm");
}

/// Rank 0 cannot create the shared-memory file (RLIMIT_FSIZE = 0, as in a full /dev/shm):
/// every rank falls back to TCP together and no file is left behind.
fn shm_creation_failure_falls_back_to_tcp_and_leaves_no_file() {
    use std::os::unix::process::CommandExt;
    let port = tandem_testutil::free_port().to_string();
    let run_id = format!("fsize{}", std::process::id());
    let kids: Vec<Child> = (0..2)
        .map(|r| {
            let v = vars(&[
                ("RANK", r.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.clone()),
                ("TANDEM_RUN_ID", run_id.clone()),
            ]);
            if r != 0 {
                return spawn("sum", &v);
            }
            let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
            cmd.args(["--exact", "worker", "--nocapture", "--test-threads=1"]).env(ROLE, "sum");
            cmd.env_remove("TANDEM_TRANSPORT").env("TANDEM_INIT_TIMEOUT", "20");
            for (k, val) in &v {
                cmd.env(k, val);
            }
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                    let lim = libc::rlimit { rlim_cur: 0, rlim_max: libc::RLIM_INFINITY };
                    libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
                    Ok(())
                });
            }
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn rank 0")
        })
        .collect();
    for (r, (code, out)) in finish(kids, Duration::from_secs(60)).into_iter().enumerate() {
        assert_eq!(code, Some(0), "rank {r}: {out}");
        assert!(out.contains("transport=Some(Tcp)"), "rank {r}: {out}");
    }
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.contains(&run_id))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// TORCH_DISTRIBUTED_DEBUG as PyTorch documents it: INFO logs how each group was set up on
/// every rank's stderr; DETAIL also checks every collective across ranks first.
fn torch_distributed_debug_info_logs_set_up_and_detail_checks_every_call() {
    let world = |role: &str, level: &str| {
        let port = tandem_testutil::free_port().to_string();
        let kids: Vec<Child> = (0..2)
            .map(|r| {
                spawn(
                    role,
                    &vars(&[
                        ("RANK", r.to_string()),
                        ("WORLD_SIZE", "2".into()),
                        ("MASTER_ADDR", "127.0.0.1".into()),
                        ("MASTER_PORT", port.clone()),
                        ("TORCH_DISTRIBUTED_DEBUG", level.into()),
                    ]),
                )
            })
            .collect();
        kids.into_iter()
            .map(|mut c| {
                tandem_testutil::wait_with_deadline(&mut c, Duration::from_secs(60));
                let o = c.wait_with_output().expect("output");
                let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
                (text(&o.stdout), text(&o.stderr))
            })
            .collect::<Vec<_>>()
    };
    for (r, (out, err)) in world("sum", "INFO").into_iter().enumerate() {
        assert!(out.contains(&format!("OK rank={r}")), "rank {r}: {out}{err}");
        let want =
            format!("[tandem rank {r}] group w: rank {r}/2, local {r}/2, 1 host(s), transport shm");
        assert!(err.contains(&want) && err.contains("desync check off"), "rank {r}: {err}");
    }
    let detail = world("desync", "DETAIL");
    let (out, err) = &detail[0];
    assert!(
        out.contains("collective desync: rank 0 called reduce(#0, i64, 4 elements, sum, root 1) but rank 1 called all_to_all(#0, i64"),
        "{out}{err}"
    );
    assert!(err.contains("desync check on"), "{err}");
}
