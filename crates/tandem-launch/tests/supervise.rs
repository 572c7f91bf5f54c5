//! The supervisor driven in-process with `/bin/sh` workers: environment, failure propagation,
//! restarts, port retry, log files, and that no process (grandchildren included) survives.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tandem_testutil::{assert_no_survivors, recorded_pids};

use tandem_launch::{launch, LaunchConfig, NprocPerNode, StreamSpec, Streams};

fn sh(script: &str, nproc: u32, dir: &Path) -> LaunchConfig {
    let mut cfg = LaunchConfig::new("/bin/sh", ["-c", script]);
    cfg.nproc_per_node = NprocPerNode::Count(nproc);
    cfg.forward_signals = false; // tests share one process: leave its signal handling alone
    cfg.stop_grace = Duration::from_secs(2);
    cfg.monitor_interval = Duration::from_millis(20);
    cfg.extra_env.push(("OUT".into(), dir.as_os_str().to_owned()));
    cfg
}

fn read(path: PathBuf) -> String {
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn each_worker_sees_the_launcher_environment() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = sh(r#"env > "$OUT/env.$RANK""#, 3, dir.path());
    cfg.master_port = Some(23456);
    cfg.master_addr = "127.0.0.1".into();
    cfg.run_id = "envtest".into();
    cfg.max_restarts = 2;
    cfg.extra_env.push(("EXTRA_FOR_WORKERS".into(), "yes".into()));
    let out = launch(&cfg).unwrap();
    assert_eq!(out.exit_code, 0);
    let threads =
        tandem_launch::threads_per_worker(tandem_launch::available_cores(), 3).to_string();
    for rank in 0..3 {
        let env = read(dir.path().join(format!("env.{rank}")));
        let get = |k: &str| {
            env.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).map(str::to_string)
        };
        assert_eq!(get("RANK").as_deref(), Some(rank.to_string().as_str()));
        assert_eq!(get("LOCAL_RANK").as_deref(), Some(rank.to_string().as_str()));
        assert_eq!(get("WORLD_SIZE").as_deref(), Some("3"));
        assert_eq!(get("LOCAL_WORLD_SIZE").as_deref(), Some("3"));
        assert_eq!(get("GROUP_RANK").as_deref(), Some("0"));
        assert_eq!(get("MASTER_ADDR").as_deref(), Some("127.0.0.1"));
        assert_eq!(get("MASTER_PORT").as_deref(), Some("23456"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT").as_deref(), Some("0"));
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS").as_deref(), Some("2"));
        assert_eq!(get("TORCHELASTIC_RUN_ID").as_deref(), Some("envtest"));
        assert_eq!(get("EXTRA_FOR_WORKERS").as_deref(), Some("yes"));
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            assert_eq!(get("OMP_NUM_THREADS"), Some(threads.clone()));
        }
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            assert_eq!(get("RAYON_NUM_THREADS"), Some(threads.clone()));
        }
    }
}

#[test]
fn failing_rank_stops_the_others_and_sets_the_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    // Every worker leaves a grandchild behind; rank 1 fails after writing to stderr, the
    // others would run for a minute.
    let script = r#"
        sleep 60 & echo $! > "$OUT/grandchild.$RANK.pid"
        echo $$ > "$OUT/worker.$RANK.pid"
        if [ "$RANK" = 1 ]; then sleep 0.3; echo "something broke on rank 1" >&2; exit 3; fi
        sleep 60
    "#;
    let cfg = sh(script, 4, dir.path());
    let start = Instant::now();
    let out = launch(&cfg).unwrap();
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    assert_eq!(out.exit_code, 3);
    assert_eq!(out.failures.len(), 1, "{:?}", out.failures);
    assert_eq!(out.failures[0].rank, 1);
    assert_eq!(out.failures[0].stderr_tail, vec!["something broke on rank 1".to_string()]);
    let pids = recorded_pids(dir.path());
    assert_eq!(pids.len(), 8, "every worker and grandchild recorded its pid");
    assert_no_survivors(&pids);
}

#[test]
fn a_job_past_its_deadline_is_stopped_with_124_and_no_restart() {
    let dir = tempfile::tempdir().unwrap();
    // A stuck world: every worker (and a grandchild) would run for a minute.
    let script = r#"
        sleep 60 & echo $! > "$OUT/grandchild.$RANK.pid"
        echo $$ > "$OUT/worker.$RANK.pid"
        sleep 60
    "#;
    let mut cfg = sh(script, 2, dir.path());
    cfg.deadline = Some(Duration::from_millis(800));
    cfg.max_restarts = 3;
    let start = Instant::now();
    let out = launch(&cfg).unwrap();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(800) && took < Duration::from_secs(8), "{took:?}");
    assert_eq!((out.exit_code, out.restarts), (124, 0));
    assert!(out.failures.is_empty(), "{:?}", out.failures);
    let pids = recorded_pids(dir.path());
    assert_eq!(pids.len(), 4, "every worker and grandchild recorded its pid");
    assert_no_survivors(&pids);
    // A deadline and live recovery are refused together, naming the flag.
    cfg.live_recovery = true;
    let e = launch(&cfg).unwrap_err().to_string();
    assert!(e.contains("--live-recovery") && e.contains("deadline"), "{e}");
}

#[test]
fn worker_killed_by_a_signal_gives_128_plus_signal() {
    let dir = tempfile::tempdir().unwrap();
    let out =
        launch(&sh(r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 30"#, 2, dir.path())).unwrap();
    assert_eq!(out.exit_code, 137);
    assert_eq!(out.failures[0].exit, tandem_launch::WorkerExit::Signal(9));
}

#[test]
fn a_worker_that_fails_only_on_its_first_attempt_succeeds_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
        echo "$TORCHELASTIC_RESTART_COUNT" >> "$OUT/attempts.$RANK"
        if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
            # Fail only once rank 0 has recorded its start (at most 5 s): the failure stops
            # rank 0, which on a loaded machine might otherwise not have started yet.
            i=0; while [ ! -s "$OUT/attempts.0" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done
            exit 4
        fi
        sleep 0.2
    "#;
    let mut cfg = sh(script, 2, dir.path());
    cfg.max_restarts = 2;
    let out = launch(&cfg).unwrap();
    assert_eq!(out.exit_code, 0);
    assert_eq!(out.restarts, 1);
    // Rank 0 was started on both attempts (the whole set restarts), rank 1 too.
    assert_eq!(read(dir.path().join("attempts.0")), "0\n1\n");
    assert_eq!(read(dir.path().join("attempts.1")), "0\n1\n");
}

#[test]
fn restarts_run_out_and_the_last_failure_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"echo x >> "$OUT/attempts.$RANK"; echo "attempt $TORCHELASTIC_RESTART_COUNT" >&2; exit 7"#;
    let mut cfg = sh(script, 1, dir.path());
    cfg.max_restarts = 2;
    let out = launch(&cfg).unwrap();
    assert_eq!(out.exit_code, 7);
    assert_eq!(out.restarts, 2);
    assert_eq!(read(dir.path().join("attempts.0")).lines().count(), 3);
    assert_eq!(out.failures[0].stderr_tail, vec!["attempt 2".to_string()]);
    assert!(out.summary(2).contains("exit code 7"));
}

#[test]
fn a_taken_auto_port_is_retried_without_spending_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 reports the bind failure a store would on its first try only.
    let script = r#"
        echo "$MASTER_PORT" >> "$OUT/ports.$RANK"
        if [ "$RANK" = 0 ] && [ ! -e "$OUT/tried" ]; then
            touch "$OUT/tried"; echo "store: cannot bind: Address already in use (os error 98)" >&2; exit 1
        fi
    "#;
    let cfg = sh(script, 2, dir.path());
    let out = launch(&cfg).unwrap();
    assert_eq!(out.exit_code, 0);
    assert_eq!(out.restarts, 0);
    let ports = read(dir.path().join("ports.0"));
    let ports: Vec<&str> = ports.lines().collect();
    assert_eq!(ports.len(), 2);
    assert_ne!(ports[0], ports[1], "second attempt must use a new port");
    assert_eq!(ports[1], out.master_port.to_string());
}

#[test]
fn a_fixed_port_is_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = sh(r#"echo "Address already in use" >&2; exit 1"#, 1, dir.path());
    cfg.master_port = Some(tandem_testutil::free_port());
    let out = launch(&cfg).unwrap();
    assert_eq!(out.exit_code, 1);
}

#[test]
fn log_dir_gets_per_rank_files_per_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    // Rank 1 fails its first attempt only once rank 0 has written both lines (at most 5 s): the
    // failure stops rank 0, which on a loaded machine might not have written them yet.
    let script = r#"echo "out of $RANK try $TORCHELASTIC_RESTART_COUNT"; echo "err of $RANK" >&2
                    touch "$OUT/wrote.$RANK.$TORCHELASTIC_RESTART_COUNT"
                    if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then
                        i=0; while [ ! -e "$OUT/wrote.0.0" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done
                        exit 2
                    fi"#;
    let mut cfg = sh(script, 2, dir.path());
    cfg.log_dir = Some(logs.clone());
    cfg.run_id = "job1".into();
    cfg.max_restarts = 1;
    let out = launch(&cfg).unwrap();
    assert_eq!(out.exit_code, 0);
    assert_eq!(out.log_dir.as_deref(), Some(logs.join("job1").as_path()));
    for attempt in 0..2 {
        for rank in 0..2 {
            let d = logs.join(format!("job1/attempt_{attempt}/{rank}"));
            assert_eq!(read(d.join("stdout.log")), format!("out of {rank} try {attempt}\n"));
            assert_eq!(read(d.join("stderr.log")), format!("err of {rank}\n"));
        }
    }
}

#[test]
fn tee_of_one_rank_only_writes_that_ranks_file() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let mut cfg = sh(r#"echo "hello $RANK""#, 2, dir.path());
    cfg.log_dir = Some(logs.clone());
    cfg.tee = "1:1".parse::<StreamSpec>().unwrap();
    assert_eq!(cfg.tee.for_local_rank(1), Streams { stdout: true, stderr: false });
    assert_eq!(launch(&cfg).unwrap().exit_code, 0);
    assert_eq!(read(logs.join("none/attempt_0/1/stdout.log")), "hello 1\n");
    assert!(!logs.join("none/attempt_0/1/stderr.log").exists());
    assert!(!logs.join("none/attempt_0/0").exists());
}

#[test]
fn a_missing_program_is_an_error_naming_it() {
    let mut cfg = LaunchConfig::new("/nonexistent/trainer", Vec::<String>::new());
    cfg.forward_signals = false;
    let err = launch(&cfg).unwrap_err().to_string();
    assert!(err.contains("/nonexistent/trainer") && err.contains("rank 0"), "{err}");
}
