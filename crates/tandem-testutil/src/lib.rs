//! Test support shared by tandem's crates (their tests' dev-dependency, and the chaos soak's in
//! tandem-bench), one copy of each helper:
//! - [`world`]: a world of N ranks as threads over real sockets / shared memory, bounded in time;
//! - [`child`]: child processes with drained output and a deadline;
//! - [`procs`]: process checks through /proc (running, children, survivors);
//! - [`etcd`]: a real etcd cluster, on loopback or across simulated hosts;
//! - [`Rng`]: a seeded generator for fault schedules (the seed replays a trial);
//! - [`tmpfs`]: a disk that can be made full;
//! - here: the workspace root, a Python with PyTorch for interop tests, loopback ports.
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

pub mod child;
pub mod etcd;
pub mod harness;
pub mod netns;
pub mod procs;
mod rng;
pub mod row_fixture;
pub mod tmpfs;
pub mod world;

pub use child::{
    output_with_deadline, tail, wait_with_deadline, without_world, Finished, Running, WORLD_VARS,
};
pub use procs::{assert_no_survivors, children_of, is_running, recorded_pids};
pub use rng::Rng;
pub use world::{run_tcp_world, run_world, test_options};

/// The workspace root (the directory holding the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().and_then(Path::parent).expect("crates/<name> layout").to_path_buf()
}

/// Every text file under `dir` (at any depth) with its text, for tests that read the sources
/// (binary files, such as a bundled font, are left out).
pub fn files_with_text(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let bytes =
                    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                if let Ok(text) = String::from_utf8(bytes) {
                    files.push((path, text));
                }
            }
        }
    }
    files
}

fn python_has_torch(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Interop tests that found no torch in this test binary (reported once, at exit).
static TORCH_SKIPS: AtomicUsize = AtomicUsize::new(0);

/// A Python interpreter that can `import torch`: `$TANDEM_PYTHON`, else
/// `<workspace>/.venv-torch/bin/python`, else `python3`. Returns `None` when there is none,
/// so the caller skips — unless `TANDEM_REQUIRE_TORCH=1`, where a missing torch panics with an
/// explanation (CI sets it so interop tests can never silently skip). Skips are counted and
/// the test binary prints one line with the count when it exits, past the test harness's
/// output capture, so a run without torch says so.
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
    if TORCH_SKIPS.fetch_add(1, Ordering::SeqCst) == 0 {
        // SAFETY: registers a plain `extern "C" fn` with no captured state.
        unsafe { libc::atexit(report_torch_skips) };
    }
    None
}

extern "C" fn report_torch_skips() {
    let n = TORCH_SKIPS.load(Ordering::SeqCst);
    let exe = std::env::current_exe().ok();
    let binary = exe.as_deref().and_then(Path::file_name).and_then(|n| n.to_str()).unwrap_or("?");
    let line = format!(
        "skipped: {n} PyTorch interop test(s) in {binary}: no Python with torch \
         (set TANDEM_PYTHON or create .venv-torch, see README); they did not run\n"
    );
    // Straight to file descriptor 2: the harness captures only print!/eprint! output.
    // SAFETY: writes a valid buffer of the given length.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// A private (0600) job-secret file shared by every launcher a test starts for one job (the
/// copy every node of a real job holds), made once per test process.
pub fn job_secret_file() -> &'static Path {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    static FILE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("tandem-test-secret-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .expect("writing the test job secret");
        writeln!(f, "tandem test job secret {}", std::process::id()).expect("writing the secret");
        path
    })
}

/// A loopback port that was free a moment ago. The OS hands out ephemeral ports round-robin, so
/// reuse within a test run is unlikely; servers under test should still retry on AddrInUse.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

/// A loopback port that refuses connections for as long as the returned socket lives: bound
/// (so no other test of a parallel run can take it, as one can a [`free_port`] between its
/// check and its use) but not listening. For tests of "nobody listens there".
pub fn refused_port() -> (socket2::Socket, u16) {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("a TCP socket");
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    socket.bind(&loopback.into()).expect("bind 127.0.0.1:0");
    let port = socket.local_addr().ok().and_then(|a| a.as_socket()).expect("its address").port();
    (socket, port)
}
