//! `tandem run` end to end, with `tandem check` (or /bin/sh) as the worker: collectives across
//! the launched world, failure exit codes, restarts, two launchers forming one world, signals,
//! and that no process (grandchildren included) outlives the launcher.
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tandem_testutil::{
    assert_no_survivors, children_of, free_port, is_running, output_with_deadline, recorded_pids,
    wait_with_deadline,
};

mod support;

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");
const LIMIT: Duration = Duration::from_secs(60);

/// Kubeflow's trainer sets these for torchrun; `tandem run` takes them as flag defaults.
const PET_VARS: [&str; 7] = [
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_MAX_RESTARTS",
    "PET_RDZV_ID",
];

fn tandem_run(args: &[&str]) -> Command {
    let mut c = Command::new(TANDEM);
    c.arg("run").args(args);
    c.env_remove("OMP_NUM_THREADS").env_remove("RAYON_NUM_THREADS");
    for v in PET_VARS {
        c.env_remove(v);
    }
    c
}

#[test]
fn kubeflow_pet_variables_are_flag_defaults_and_flags_win() {
    let port = free_port().to_string();
    let pet = |c: &mut Command| {
        c.env("PET_NNODES", "1")
            .env("PET_NPROC_PER_NODE", "3")
            .env("PET_NODE_RANK", "0")
            .env("PET_MASTER_ADDR", "127.0.0.1")
            .env("PET_MASTER_PORT", &port)
            .env("PET_MAX_RESTARTS", "2")
            .env("PET_RDZV_ID", "k8s-job");
    };
    let mut cmd = tandem_run(&["--", TANDEM, "check", "--print-env"]);
    pet(&mut cmd);
    let out = output_with_deadline(&mut cmd, LIMIT);
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = text(&out.stdout);
    for r in 0..3u32 {
        let lines = rank_lines(&stdout, r);
        let json: serde_json::Value = serde_json::from_str(&lines[0]).expect("environment line");
        assert_eq!(json["WORLD_SIZE"].as_str(), Some("3"), "{json}");
        assert_eq!(json["MASTER_PORT"].as_str(), Some(port.as_str()), "{json}");
        assert_eq!(json["TORCHELASTIC_MAX_RESTARTS"].as_str(), Some("2"), "{json}");
        assert_eq!(json["TORCHELASTIC_RUN_ID"].as_str(), Some("k8s-job"), "{json}");
    }
    // A flag on the command line wins over its PET_ variable.
    let mut cmd = tandem_run(&["--nproc-per-node", "2", "--", TANDEM, "check"]);
    pet(&mut cmd);
    let out = output_with_deadline(&mut cmd, LIMIT);
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(
        rank_lines(&text(&out.stdout), 1),
        vec!["rank 1/2 local 1/2 sum=1 allreduce=flat ok"]
    );
    assert!(rank_lines(&text(&out.stdout), 2).is_empty());
    // A bad value names the flag.
    let mut cmd = tandem_run(&["--", "true"]);
    cmd.env("PET_NNODES", "zero");
    let out = output_with_deadline(&mut cmd, LIMIT);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(text(&out.stderr).contains("--nnodes"), "{}", describe(&out));
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn describe(o: &Output) -> String {
    format!("status {:?}\nstdout:\n{}\nstderr:\n{}", o.status, text(&o.stdout), text(&o.stderr))
}

/// Lines `[rank N] ...` of the launcher's stdout, without the prefix, for rank N.
fn rank_lines(stdout: &str, rank: u32) -> Vec<String> {
    let prefix = format!("[rank {rank}] ");
    stdout.lines().filter_map(|l| l.strip_prefix(&prefix)).map(str::to_string).collect()
}

fn wait_for_files(dir: &Path, ext: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let count = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| {
                e.path().extension().is_some_and(|x| x == ext)
                    && e.metadata().is_ok_and(|m| m.len() > 0)
            })
            .count();
        if count >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {count} of {n} .{ext} files appeared in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn help_explains_every_flag() {
    let out = output_with_deadline(Command::new(TANDEM).args(["run", "--help"]), LIMIT);
    assert!(out.status.success(), "{}", describe(&out));
    let help = text(&out.stdout);
    for flag in [
        "--nnodes",
        "--nproc-per-node",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--standalone",
        "--max-restarts",
        "--monitor-interval",
        "--run-id",
        "--log-dir",
        "--redirects",
        "--tee",
        "--local-ranks-filter",
    ] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(flag) || l.contains(&format!(", {flag}")));
        let line = line.unwrap_or_else(|| panic!("{flag} missing from help:\n{help}"));
        assert!(
            line.split_once("  ").is_some_and(|(_, d)| d.trim().len() > 10),
            "{flag} has no explanation: {line}"
        );
    }
}

#[test]
fn underscore_spellings_are_accepted() {
    let out = output_with_deadline(
        &mut tandem_run(&[
            "--nproc_per_node",
            "2",
            "--max_restarts",
            "0",
            "--monitor_interval",
            "0.05",
            "--run_id",
            "u1",
            "--",
            "sh",
            "-c",
            "echo ws=$WORLD_SIZE id=$TORCHELASTIC_RUN_ID",
        ]),
        LIMIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = text(&out.stdout);
    assert_eq!(rank_lines(&stdout, 0), vec!["ws=2 id=u1"]);
    assert_eq!(rank_lines(&stdout, 1), vec!["ws=2 id=u1"]);
}

#[test]
fn bad_flags_are_named() {
    let out = output_with_deadline(&mut tandem_run(&["--nnodes", "2", "--", "true"]), LIMIT);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(text(&out.stderr).contains("--master-port"), "{}", describe(&out));
    let out = output_with_deadline(&mut tandem_run(&["--nnodes", "3:2", "--", "true"]), LIMIT);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(text(&out.stderr).contains("--nnodes"), "{}", describe(&out));
    let out = output_with_deadline(
        &mut tandem_run(&["--standalone", "--master-port", "1234", "--", "true"]),
        LIMIT,
    );
    assert!(text(&out.stderr).contains("--standalone"), "{}", describe(&out));
    // An unknown flag before the program is named, not started as the program (torchrun says
    // "unrecognized arguments" too).
    let out = output_with_deadline(
        &mut tandem_run(&["--nproc-per-node", "2", "--bogus-flag", "--", "/bin/true"]),
        LIMIT,
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(err.contains("--bogus-flag") && !err.contains("cannot start"), "{err}");
    // The program's own flags after it, with or without `--`, are its own.
    let out = output_with_deadline(&mut tandem_run(&["sh", "-c", "echo ok-$0", "--x"]), LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    assert!(text(&out.stdout).contains("ok---x"), "{}", describe(&out));
    // A program that does not exist: named once with its OS error, which is not repeated.
    let out = output_with_deadline(&mut tandem_run(&["--", "/nonexistent/program"]), LIMIT);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(err.contains("cannot start rank 0 (/nonexistent/program)"), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn local_ranks_filter_limits_the_console() {
    let out = output_with_deadline(
        &mut tandem_run(&[
            "--nproc-per-node",
            "3",
            "--local-ranks-filter",
            "1",
            "--",
            "sh",
            "-c",
            "echo hi $RANK",
        ]),
        LIMIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(text(&out.stdout), "[rank 1] hi 1\n");
}

#[test]
fn four_ranks_all_reduce_their_rank() {
    let out = output_with_deadline(
        &mut tandem_run(&["--nproc-per-node", "4", "--", TANDEM, "check"]),
        LIMIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = text(&out.stdout);
    for r in 0..4 {
        assert_eq!(
            rank_lines(&stdout, r),
            vec![format!("rank {r}/4 local {r}/4 sum=6 allreduce=flat ok")],
            "{}",
            describe(&out)
        );
    }
    let out = output_with_deadline(
        &mut tandem_run(&[
            "--standalone",
            "--nproc-per-node",
            "3",
            "--",
            TANDEM,
            "check",
            "--dtype",
            "f64",
        ]),
        LIMIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    assert_eq!(
        rank_lines(&text(&out.stdout), 2),
        vec!["rank 2/3 local 2/3 sum=3 allreduce=flat ok"]
    );
}

#[test]
fn a_master_port_in_use_is_reported_with_the_bind_error() {
    // A fixed --master-port is the user's choice: no silent retry, but a clear summary.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = output_with_deadline(
        &mut tandem_run(&["--nproc-per-node", "2", "--master-port", &port, "--", TANDEM, "check"]),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("root cause: rank 0"), "{stderr}");
    assert!(stderr.contains("Address already in use"), "{stderr}");
}

#[test]
fn workers_see_the_launcher_environment() {
    let port = free_port().to_string();
    let out = output_with_deadline(
        &mut tandem_run(&[
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--run-id",
            "envjob",
            "--max-restarts",
            "3",
            "--",
            TANDEM,
            "check",
            "--print-env",
        ]),
        LIMIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = text(&out.stdout);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = (cores / 2).max(1).to_string();
    for r in 0..2u32 {
        let lines = rank_lines(&stdout, r);
        let json: serde_json::Value =
            serde_json::from_str(&lines[0]).expect("first line is the environment");
        let expect = [
            ("RANK", r.to_string()),
            ("LOCAL_RANK", r.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("GROUP_RANK", "0".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_RESTART_COUNT", "0".into()),
            ("TORCHELASTIC_MAX_RESTARTS", "3".into()),
            ("TORCHELASTIC_RUN_ID", "envjob".into()),
            ("OMP_NUM_THREADS", threads.clone()),
            ("RAYON_NUM_THREADS", threads.clone()),
        ];
        for (k, v) in expect {
            assert_eq!(json[k].as_str(), Some(v.as_str()), "rank {r} {k} in {json}");
        }
        assert_eq!(lines[1], format!("rank {r}/2 local {r}/2 sum=1 allreduce=flat ok"));
    }
    // An OMP_NUM_THREADS set by the user is left alone.
    let out = output_with_deadline(
        tandem_run(&["--nproc-per-node", "2", "--", TANDEM, "check", "--print-env"])
            .env("OMP_NUM_THREADS", "5"),
        LIMIT,
    );
    let json: serde_json::Value =
        serde_json::from_str(&rank_lines(&text(&out.stdout), 1)[0]).unwrap();
    assert_eq!(json["OMP_NUM_THREADS"].as_str(), Some("5"));
}

#[test]
fn one_rank_exiting_3_stops_the_job_with_code_3_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    // Each worker leaves a grandchild; rank 1 exits 3 right after the check, the others would
    // sleep for a minute.
    let script = format!(
        "sleep 60 & echo $! > {d}/grandchild.$RANK.pid; echo $$ > {d}/worker.$RANK.pid; \
         exec {TANDEM} check --exit-code-on-rank 1:3 --sleep-secs 60"
    );
    let start = Instant::now();
    let out = output_with_deadline(
        &mut tandem_run(&["--nproc-per-node", "4", "--stop-grace", "3", "--", "sh", "-c", &script]),
        LIMIT,
    );
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(3), "{}", describe(&out));
    assert!(took < Duration::from_secs(10), "launcher took {took:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("root cause: rank 1 (local rank 1 on node 0): exit code 3"),
        "{stderr}"
    );
    assert!(
        stderr.contains("| rank 1: exiting with code 3"),
        "summary shows rank 1's stderr:\n{stderr}"
    );
    let pids = recorded_pids(dir.path());
    assert_eq!(pids.len(), 8);
    assert_no_survivors(&pids);
}

#[test]
fn a_worker_failing_on_its_first_attempt_succeeds_with_restarts() {
    let out = output_with_deadline(
        &mut tandem_run(&[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--",
            TANDEM,
            "check",
            "--fail-on-first-attempt",
        ]),
        LIMIT,
    );
    assert!(out.status.success(), "{}", describe(&out));
    let stdout = text(&out.stdout);
    // The check ran (and passed) on both attempts, then the second attempt exited cleanly.
    assert_eq!(
        rank_lines(&stdout, 0),
        vec!["rank 0/2 local 0/2 sum=1 allreduce=flat ok"; 2],
        "{}",
        describe(&out)
    );
    assert!(text(&out.stderr).contains("restart 1 of 2"), "{}", describe(&out));

    let out = output_with_deadline(
        &mut tandem_run(&[
            "--nproc-per-node",
            "2",
            "--",
            TANDEM,
            "check",
            "--fail-on-first-attempt",
        ]),
        LIMIT,
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "without restarts the failure is final: {}",
        describe(&out)
    );
}

#[test]
fn two_launchers_form_one_world() {
    let port = free_port().to_string();
    let launcher = |node: &str| {
        let mut c = tandem_run(&[
            "--nnodes",
            "2",
            "--node-rank",
            node,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--run-id",
            "two",
            "--",
            TANDEM,
            "check",
            "--print-env",
        ]);
        c.env("TANDEM_SECRET_FILE", tandem_testutil::job_secret_file());
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let node1 = std::thread::spawn({
        let mut c = launcher("1");
        move || output_with_deadline(&mut c, LIMIT)
    });
    let out0 = output_with_deadline(&mut launcher("0"), LIMIT);
    let out1 = node1.join().unwrap();
    assert!(out0.status.success(), "node 0: {}", describe(&out0));
    assert!(out1.status.success(), "node 1: {}", describe(&out1));
    for (node, out) in [(0u32, &out0), (1, &out1)] {
        let stdout = text(&out.stdout);
        for local in 0..2u32 {
            let rank = node * 2 + local;
            let lines = rank_lines(&stdout, rank);
            let json: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
            assert_eq!(json["GROUP_RANK"].as_str(), Some(node.to_string().as_str()));
            assert_eq!(json["WORLD_SIZE"].as_str(), Some("4"));
            assert_eq!(
                lines[1],
                format!("rank {rank}/4 local {local}/2 sum=6 allreduce=flat ok"),
                "{}",
                describe(out)
            );
        }
    }
}

/// Starts a launcher whose `n` sh workers record their pids, start a grandchild, and note the
/// signal they get; waits until all are running.
fn start_signal_job(dir: &Path, n: usize) -> std::process::Child {
    let d = dir.display();
    let script = format!(
        "trap 'echo TERM > {d}/term.$RANK; exit 0' TERM; trap 'echo INT > {d}/int.$RANK; exit 0' INT; \
         sleep 60 & echo $! > {d}/grandchild.$RANK.pid; echo $$ > {d}/worker.$RANK.pid; wait"
    );
    let child = tandem_run(&[
        "--nproc-per-node",
        &n.to_string(),
        "--stop-grace",
        "3",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_files(dir, "pid", 2 * n);
    child
}

#[test]
fn sigterm_and_sigint_to_the_launcher_reach_every_worker() {
    for (sig, name, code) in [(libc::SIGTERM, "term", 143), (libc::SIGINT, "int", 130)] {
        let dir = tempfile::tempdir().unwrap();
        let mut child = start_signal_job(dir.path(), 3);
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = wait_with_deadline(&mut child, Duration::from_secs(20))
            .expect("launcher exits after a signal");
        assert_eq!(status.code(), Some(code), "{name}");
        for r in 0..3 {
            let got = std::fs::read_to_string(dir.path().join(format!("{name}.{r}")));
            assert!(got.is_ok(), "rank {r} did not receive SIG{}", name.to_uppercase());
        }
        assert_no_survivors(&recorded_pids(dir.path()));
    }
}

#[test]
fn a_sigkilled_launcher_takes_its_workers_along() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    // Workers die by PR_SET_PDEATHSIG; their grandchildren by the launcher's watchdog.
    let script =
        format!("sleep 60 & echo $! > {d}/grandchild.$RANK.pid; echo $$ > {d}/worker.$RANK.pid; exec sleep 60");
    let mut child = tandem_run(&["--nproc-per-node", "2", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_files(dir.path(), "pid", 4);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_no_survivors(&recorded_pids(dir.path()));
}

#[test]
fn a_killed_watchdog_is_reaped_reported_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let script =
        format!("sleep 60 & echo $! > {d}/grandchild.pid; echo $$ > {d}/worker.pid; exec sleep 60");
    let stderr_path = dir.path().join("launcher.stderr");
    let mut launcher = tandem_run(&["--nproc-per-node", "1", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let launcher_pid = launcher.id() as i32;
    wait_for_files(dir.path(), "pid", 2);
    let worker: i32 =
        std::fs::read_to_string(dir.path().join("worker.pid")).unwrap().trim().parse().unwrap();
    // The launcher's children: its one worker and the forked watchdog.
    let watchdogs = |exclude: i32| -> Vec<i32> {
        children_of(launcher_pid)
            .into_iter()
            .filter(|(pid, _)| *pid != worker && *pid != exclude)
            .map(|(pid, _)| pid)
            .collect()
    };
    let old = watchdogs(0);
    assert_eq!(old.len(), 1, "expected one watchdog beside the worker: {old:?}");
    let old = old[0];
    // SAFETY: SIGKILL to a pid we just found as the launcher's child.
    assert_eq!(unsafe { libc::kill(old, libc::SIGKILL) }, 0);

    // Reaped (no zombie left while the launcher runs) and replaced by a new watchdog.
    let deadline = Instant::now() + Duration::from_secs(5);
    let new = loop {
        let reaped = tandem::comm::procfs::ProcStat::read(old).is_none();
        match watchdogs(old).as_slice() {
            [new] if reaped => break *new,
            _ => assert!(Instant::now() < deadline, "watchdog {old} not reaped and replaced"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(is_running(new));
    // The new watchdog holds the guarantee: SIGKILL the launcher, the grandchild dies too.
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    assert_no_survivors(&recorded_pids(dir.path()));
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(
        stderr.contains(&format!(
            "(pid {old}) was killed by signal 9; reaped it and started a new one (pid {new})"
        )),
        "{stderr}"
    );
}

fn private_file(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// The job secret between launchers: a node with another secret is refused at once (and learns
/// nothing), the job goes on and trains to its end with the node that holds the right one; a
/// multi-node launch without a secret is refused naming --secret-file.
#[test]
fn a_launcher_with_another_secret_is_refused_and_the_job_trains_on() {
    let dir = tempfile::tempdir().unwrap();
    let ours = private_file(dir.path(), "job.secret", "the secret of this training job\n");
    let theirs = private_file(dir.path(), "other.secret", "somebody else's secret, not ours\n");
    let port = free_port().to_string();
    let run_dir = dir.path().join("run");
    let launcher = |node: &str, secret: &Path| {
        let mut c = tandem_run(&[
            "--nnodes",
            "2",
            "--node-rank",
            node,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--nproc-per-node",
            "1",
            "--rdzv-timeout",
            "60",
            "--secret-file",
            secret.to_str().unwrap(),
            "--",
            TANDEM,
            "train",
            "--steps",
            "6",
            "--hidden",
            "16",
            "--out",
            run_dir.to_str().unwrap(),
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let node0 = std::thread::spawn({
        let mut c = launcher("0", &ours);
        move || output_with_deadline(&mut c, LIMIT)
    });
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let intruder = output_with_deadline(&mut launcher("1", &theirs), LIMIT);
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    assert_eq!(intruder.status.code(), Some(1), "{}", describe(&intruder));
    let err = text(&intruder.stderr);
    assert!(err.contains("the job refused this connection"), "{err}");
    assert!(err.contains("did not prove it holds this job's secret"), "{err}");
    let node1 = output_with_deadline(&mut launcher("1", &ours), LIMIT);
    let node0 = node0.join().unwrap();
    assert!(node1.status.success(), "node 1: {}", describe(&node1));
    assert!(node0.status.success(), "node 0: {}", describe(&node0));
    assert!(text(&node0.stdout).contains("final: "), "{}", describe(&node0));
    assert!(
        text(&node0.stderr).contains("refused a connection from 127.0.0.1"),
        "node 0 logs the refused node: {}",
        describe(&node0)
    );

    let open = output_with_deadline(
        tandem_run(&["--nnodes", "2", "--master-port", &port, "--", "true"])
            .env_remove("TANDEM_SECRET_FILE"),
        LIMIT,
    );
    assert_eq!(open.status.code(), Some(1), "{}", describe(&open));
    assert!(text(&open.stderr).contains("--secret-file: is required"), "{}", describe(&open));
}

/// The cause of the flake "processes of the job outlived it" (#69): a launcher SIGKILLed while
/// it was still starting workers. A worker that had started a child of its own before the
/// launcher listed its process group with the watchdog lost that child to init (PDEATHSIG
/// reaches the worker alone). Each worker now lists its own group before it execs, so there is
/// no such window. Many workers on a small machine make the launcher slow to list them; the
/// kill lands at a different moment of the start-up in each trial.
#[test]
fn a_launcher_sigkilled_while_starting_workers_leaves_no_process_behind() {
    let mut left_behind = Vec::new();
    for trial in 0..12u64 {
        let mark = format!("spawn-kill-{}-{trial}", std::process::id());
        let mut launcher =
            tandem_run(&["--nproc-per-node", "16", "--", "sh", "-c", "sleep 60; true"])
                .env(support::MARKER_VAR, &mark)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
        // The kill lands `trial` x 300 us after the first worker has started its child.
        let deadline = Instant::now() + LIMIT;
        while !support::marked_processes(&mark).iter().any(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(b"sleep\0"))
        }) {
            assert!(Instant::now() < deadline, "trial {trial}: no worker started");
        }
        std::thread::sleep(Duration::from_micros(300 * trial));
        launcher.kill().unwrap();
        launcher.wait().unwrap();
        let left = support::leftovers(&mark, Duration::from_secs(3));
        if !left.is_empty() {
            left_behind
                .push(format!("trial {trial}: {} process(es) outlived the launcher", left.len()));
        }
    }
    assert!(left_behind.is_empty(), "{left_behind:?}");
}

#[test]
fn rdzv_backend_flags_are_checked_and_a_build_without_etcd_says_how_to_get_it() {
    let run = |args: &[&str]| output_with_deadline(&mut tandem_run(args), LIMIT);
    let cases: [(&[&str], &[&str]); 3] = [
        (&["--rdzv-backend", "etcd", "--", "true"], &["--rdzv-endpoints", "is required"]),
        (&["--rdzv-backend", "zookeeper", "--", "true"], &["--rdzv-backend", "zookeeper"]),
        (&["--rdzv-endpoints", "e1:2379", "--", "true"], &["--rdzv-endpoints", "etcd"]),
    ];
    for (args, expect) in cases {
        let out = run(args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {}", describe(&out));
        assert!(expect.iter().all(|e| err.contains(e)), "{args:?}: {err}");
    }
    // This binary is the test build, without the `etcd` feature: the launchers cannot meet.
    let out = run(&[
        "--nnodes",
        "2",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        "127.0.0.1:9",
        "--insecure",
        "--",
        "true",
    ]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{}", describe(&out));
    assert!(err.contains("no etcd client") && err.contains("--features etcd"), "{err}");
}
