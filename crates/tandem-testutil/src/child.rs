//! Child processes with a deadline: output drained by threads (a child never blocks on a full
//! pipe) and killed past its limit, so a test can never hang the run.
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Every variable through which a launcher (tandem run, torchrun, Slurm, OpenMPI) could
/// describe a world, or tandem's own markers of one.
pub const WORLD_VARS: [&str; 14] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TANDEM_TRAIN_WORKER",
    "TANDEM_TRANSPORT",
    "TANDEM_RUN_ID",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
    // A launcher's secret for its own workers (a test's job brings its own).
    "TANDEM_SECRET",
];

/// Removes [`WORLD_VARS`] from a child's environment: it starts in no world unless told.
pub fn without_world(cmd: &mut Command) -> &mut Command {
    for v in WORLD_VARS {
        cmd.env_remove(v);
    }
    cmd
}

/// Polling period: fine enough to time how fast a job fails.
const POLL: Duration = Duration::from_millis(2);

/// Waits for `child` at most `limit`; past it kills the child and returns `None`.
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
        std::thread::sleep(POLL);
    }
}

/// A spawned child whose stdout and stderr are drained by threads.
pub struct Running {
    pub child: Child,
    out: Option<JoinHandle<Vec<u8>>>,
    err: Option<JoinHandle<Vec<u8>>>,
}

pub struct Finished {
    /// `None` when the deadline passed (the child was then killed).
    pub status: Option<ExitStatus>,
    /// When `wait` saw the exit (or gave up).
    pub at: Instant,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn describe(&self) -> String {
        format!(
            "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            tail(&self.stdout, 40),
            tail(&self.stderr, 40)
        )
    }
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = r.read_to_end(&mut b);
        b
    })
}

impl Running {
    /// Spawns `cmd` with piped stdout/stderr and no stdin. Panics naming the command if it
    /// cannot start.
    pub fn spawn(cmd: &mut Command) -> Running {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let out = child.stdout.take().map(drain);
        let err = child.stderr.take().map(drain);
        Running { child, out, err }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits at most `limit`; past it the child is killed and `status` is `None`.
    pub fn wait(mut self, limit: Duration) -> Finished {
        let status = wait_with_deadline(&mut self.child, limit);
        let at = Instant::now();
        let text = |h: Option<JoinHandle<Vec<u8>>>| {
            String::from_utf8_lossy(&h.and_then(|h| h.join().ok()).unwrap_or_default()).into_owned()
        };
        Finished { status, at, stdout: text(self.out.take()), stderr: text(self.err.take()) }
    }
}

/// Runs `cmd` to completion with captured output; past `limit` the child is killed and the test
/// panics with the command and what it printed.
pub fn output_with_deadline(cmd: &mut Command, limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    let f = Running::spawn(cmd).wait(limit);
    match f.status {
        Some(status) => {
            Output { status, stdout: f.stdout.into_bytes(), stderr: f.stderr.into_bytes() }
        }
        None => panic!("{what} did not finish within {limit:?}\n{}", f.describe()),
    }
}
