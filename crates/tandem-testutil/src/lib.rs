//! Test support shared by tandem's crates (dev-dependency only): finding a Python with PyTorch
//! for interop tests, reserving loopback ports, and running child processes with a deadline.
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

/// The workspace root (the directory holding the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().and_then(Path::parent).expect("crates/<name> layout").to_path_buf()
}

fn python_has_torch(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// A Python interpreter that can `import torch`: `$TANDEM_PYTHON`, else
/// `<workspace>/.venv-torch/bin/python`, else `python3`. Returns `None` when there is none,
/// so the caller skips — unless `TANDEM_REQUIRE_TORCH=1`, where a missing torch panics with an
/// explanation (CI sets it so interop tests can never silently skip).
pub fn torch_python() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("TANDEM_PYTHON") {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(workspace_root().join(".venv-torch/bin/python"));
    candidates.push(PathBuf::from("python3"));
    for c in &candidates {
        if python_has_torch(c) {
            return Some(c.clone());
        }
    }
    if std::env::var("TANDEM_REQUIRE_TORCH").as_deref() == Ok("1") {
        panic!(
            "TANDEM_REQUIRE_TORCH=1 but no Python with torch was found (tried {candidates:?}); \
             set TANDEM_PYTHON or create .venv-torch (see README)"
        );
    }
    eprintln!("skipping: no Python with torch found (set TANDEM_PYTHON or create .venv-torch)");
    None
}

/// A loopback port that was free a moment ago. The OS hands out ephemeral ports round-robin, so
/// reuse within a test run is unlikely; servers under test should still retry on AddrInUse.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

/// Waits for `child` at most `limit`; kills it (and reports failure) past that, so a test can
/// never hang the run.
pub fn wait_with_deadline(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `cmd` to completion with captured output, killing it past `limit` (then panics with
/// what it printed so far is not available; the message names the command).
pub fn output_with_deadline(cmd: &mut Command, limit: Duration) -> Output {
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn child");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut stdout, &mut b).ok();
        b
    });
    let err_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut stderr, &mut b).ok();
        b
    });
    let status = wait_with_deadline(&mut child, limit);
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    match status {
        Some(status) => Output { status, stdout, stderr },
        None => panic!(
            "{cmd:?} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Running means: a /proc entry exists and is not a zombie (`Z`) or dead (`X`) process waiting to
/// be reaped. The command name in /proc/PID/stat may hold spaces or parentheses, so the state is
/// read after the last `)`.
pub fn is_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next());
            !matches!(state, Some("Z") | Some("X"))
        }
        Err(_) => false,
    }
}

/// Every pid written into `*.pid` files under `dir` (test workers record themselves and their
/// children there).
pub fn recorded_pids(dir: &Path) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten() {
        if e.path().extension().is_some_and(|x| x == "pid") {
            let s = std::fs::read_to_string(e.path())
                .unwrap_or_else(|err| panic!("{}: {err}", e.path().display()));
            pids.extend(
                s.split_whitespace()
                    .map(|p| p.parse::<i32>().unwrap_or_else(|_| panic!("bad pid {p:?}"))),
            );
        }
    }
    pids
}

/// Fails the test if any of `pids` still runs after a short grace (orphaned grandchildren are
/// reaped by init asynchronously); kills the survivors first so a failed run leaves nothing.
pub fn assert_no_survivors(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while pids.iter().any(|&p| is_running(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive: Vec<i32> = pids.iter().copied().filter(|&p| is_running(p)).collect();
    for &p in &alive {
        let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
    }
    assert!(alive.is_empty(), "processes outlived the launch: {alive:?}");
}
