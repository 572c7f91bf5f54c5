//! Process checks through /proc (one parser: `tandem_comm::procfs`).
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
