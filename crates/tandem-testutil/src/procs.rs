//! Process checks through /proc (one parser: `tandem_comm::procfs`): running, children, survivors,
//! and a trial's processes found by the marker every one of them inherits.
use std::path::Path;
use std::time::{Duration, Instant};

use tandem_comm::procfs::{all_pids, ProcStat};

/// Running means: a /proc entry exists and is not a zombie or dead process waiting to be reaped.
pub fn is_running(pid: i32) -> bool {
    ProcStat::read(pid).is_some_and(|s| !s.is_dead())
}

/// The children of `parent`, zombies included, as (pid, stat).
pub fn children_of(parent: i32) -> Vec<(i32, ProcStat)> {
    let mut out: Vec<(i32, ProcStat)> = all_pids()
        .into_iter()
        .filter_map(|pid| Some((pid, ProcStat::read(pid)?)))
        .filter(|(_, s)| s.ppid == parent)
        .collect();
    out.sort_by_key(|(pid, _)| *pid);
    out
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
        // SAFETY: kill(2) on a pid the test recorded; no memory involved.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(alive.is_empty(), "processes outlived the launch: {alive:?}");
}

/// Environment variable holding a trial's unique marker; every process of the trial inherits it.
pub const MARKER_VAR: &str = "TANDEM_TRIAL_ID";

/// The environment of process `pid` (empty when it cannot be read).
pub fn environ(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| b.split(|&c| c == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect())
        .unwrap_or_default()
}

/// Live (non-zombie) processes whose environment has `TANDEM_TRIAL_ID=marker`.
pub fn marked_processes(marker: &str) -> Vec<i32> {
    let needle = format!("{MARKER_VAR}={marker}");
    all_pids()
        .into_iter()
        .filter(|&pid| pid != std::process::id() as i32)
        .filter(|&pid| is_running(pid))
        .filter(|&pid| environ(pid).contains(&needle))
        .collect()
}

/// Live processes of the trial `marker` whose environment also has every `VAR=value` of
/// `also`, and whose command line contains `arg` (e.g. `train`, `run`).
pub fn marked_processes_with(marker: &str, also: &[&str], arg: &str) -> Vec<i32> {
    marked_processes(marker)
        .into_iter()
        .filter(|&pid| {
            let env = environ(pid);
            also.iter().all(|kv| env.iter().any(|e| e == kv))
        })
        .filter(|&pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| b.split(|&c| c == 0).any(|a| a == arg.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

/// Orphan check: waits up to `settle` for every process of the trial to be gone; returns the
/// survivors after that (and SIGKILLs them so one failed trial cannot disturb the next).
pub fn leftovers(marker: &str, settle: Duration) -> Vec<i32> {
    let start = Instant::now();
    loop {
        let left = marked_processes(marker);
        if left.is_empty() {
            return left;
        }
        if start.elapsed() > settle {
            for &p in &left {
                sigkill(p);
            }
            return left;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGKILL; false when the process was already gone or going — a zombie, which has exited on
/// its own but is not reaped yet, or a process already inside exit (`PF_EXITING`): kill(2)
/// succeeds on both without any effect, and the process still exits with its own status.
pub fn sigkill(pid: i32) -> bool {
    let stat = ProcStat::read(pid);
    if !stat.is_some_and(|s| !s.is_dead() && !s.is_exiting()) {
        return false;
    }
    // SAFETY: kill(2) with a pid we found ourselves; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
}
