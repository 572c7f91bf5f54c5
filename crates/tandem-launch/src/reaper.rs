//! A backstop for a launcher that dies without cleaning up (SIGKILL, OOM killer, a panic in
//! an embedding program). Workers get PR_SET_PDEATHSIG, but that reaches only the worker
//! itself, not the processes it started. So `launch` forks a tiny watchdog before starting any
//! worker: it is told each worker's process group through a pipe, and when the pipe reaches end
//! of file, which the kernel guarantees when the launcher process is gone however it ended,
//! it SIGKILLs every group still listed and exits.
//!
//! A worker lists its own group, between `fork` and `exec` ([`list_own_group`]): listed by the
//! launcher after `spawn` returned, a worker that had already started a child of its own lost
//! that child to init when the launcher died in between (PDEATHSIG kills the worker alone).
//!
//! Hand-written rather than a crate because it is ~60 lines and must run between `fork` and
//! `_exit` with only async-signal-safe calls (read, kill, close, signal): no allocation and no
//! locks, since the launcher may have other threads.
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The watchdog's process name (`/proc/PID/comm`; at most 15 bytes).
pub const WATCHDOG_NAME: &std::ffi::CStr = c"tandem-watchdog";

/// Largest number of groups the watchdog remembers at once (one per worker of an attempt).
const CAPACITY: usize = 4096;

pub(crate) struct GroupReaper {
    tx: Option<File>,
    pid: libc::pid_t,
}

impl GroupReaper {
    /// Forks the watchdog. Errors (no fork possible) are reported by the caller as a warning:
    /// the launcher still works, with only PR_SET_PDEATHSIG as a backstop.
    pub(crate) fn start() -> std::io::Result<GroupReaper> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: plain system call on a local array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both fds were just created and are owned here.
        let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the child runs only `watch`, which makes async-signal-safe calls and never
        // returns.
        match unsafe { libc::fork() } {
            -1 => Err(std::io::Error::last_os_error()),
            // SAFETY: in the forked child, `watch` only makes async-signal-safe calls on the
            // pipe's read end, which this process owns, and exits without returning.
            0 => unsafe { watch(rx.as_raw_fd()) },
            pid => {
                drop(rx);
                Ok(GroupReaper { tx: Some(File::from(tx)), pid })
            }
        }
    }

    fn send(&mut self, value: i32) {
        if let Some(tx) = &mut self.tx {
            // 4 bytes is below PIPE_BUF, so each message arrives whole.
            if tx.write_all(&value.to_ne_bytes()).is_err() {
                self.tx = None;
            }
        }
    }

    /// The pipe's write end, for a worker to list its own group before it execs
    /// ([`list_own_group`]); `None` once the watchdog is known to be gone.
    pub(crate) fn listing_fd(&self) -> Option<RawFd> {
        self.tx.as_ref().map(|f| f.as_raw_fd())
    }

    /// Lists a worker's process group (`pgid > 0`).
    pub(crate) fn watch_group(&mut self, pgid: i32) {
        self.send(pgid);
    }

    /// Forgets a group once it is known to be empty, so its id can never hit a stranger.
    pub(crate) fn forget_group(&mut self, pgid: i32) {
        self.send(-pgid);
    }

    /// The watchdog's pid.
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Reaps the watchdog if it has died (somebody killed it): returns how it ended. It never
    /// exits by itself while the launcher lives, so any end means the backstop is gone.
    pub(crate) fn check_dead(&mut self) -> Option<String> {
        if self.pid <= 0 {
            return None;
        }
        let mut status = 0;
        // SAFETY: non-blocking wait for our own child.
        if unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) } != self.pid {
            return None;
        }
        self.pid = 0; // reaped: Drop must not wait for it again
        self.tx = None;
        Some(if libc::WIFSIGNALED(status) {
            format!("was killed by signal {}", libc::WTERMSIG(status))
        } else {
            format!("exited with code {}", libc::WEXITSTATUS(status))
        })
    }
}

impl Drop for GroupReaper {
    fn drop(&mut self) {
        self.tx = None; // end of file: the watchdog kills what is still listed and exits
        if self.pid > 0 {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(self.pid, &mut status, 0) };
        }
    }
}

/// Lists the calling process's group with the watchdog behind `fd` ([`GroupReaper::listing_fd`]).
/// For a worker between `fork` and `exec`: async-signal-safe calls only. A watchdog that is gone
/// fails the write, not the worker: SIGPIPE is ignored around it (the launcher replaces a dead
/// watchdog and lists the running groups itself).
///
/// # Safety
/// `fd` must be the pipe's write end inherited from the launcher.
pub(crate) unsafe fn list_own_group(fd: RawFd) {
    // Only a group this process leads (`process_group(0)`): never the launcher's own.
    let pgid = libc::getpgrp();
    if pgid != libc::getpid() {
        return;
    }
    let pgid = pgid.to_ne_bytes();
    let previous = libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    // 4 bytes is below PIPE_BUF: written whole or not at all.
    libc::write(fd, pgid.as_ptr().cast(), pgid.len());
    libc::signal(libc::SIGPIPE, previous);
}

/// The watchdog's whole life. Only async-signal-safe calls from here on.
unsafe fn watch(rx: libc::c_int) -> ! {
    // Named apart from the launcher it was forked from (same command line): `ps`, `pgrep` and a
    // benchmark picking a worker to kill by its command tell the two apart by this name.
    libc::prctl(libc::PR_SET_NAME, WATCHDOG_NAME.as_ptr(), 0, 0, 0);
    // Stay alive through the terminal's Ctrl-C and a `kill` of the launcher's group: the
    // launcher handles those itself; our job starts when it is gone.
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGPIPE] {
        libc::signal(sig, libc::SIG_IGN);
    }
    // Drop every other descriptor inherited from the launcher (its stdout, workers' pipes), so
    // nobody waits for an end of file that the watchdog would hold back.
    let closed_all = rx > 0
        && libc::syscall(libc::SYS_close_range, 0u32, (rx - 1) as u32, 0u32) == 0
        && libc::syscall(libc::SYS_close_range, (rx + 1) as u32, u32::MAX, 0u32) == 0;
    if !closed_all {
        // Kernels before 5.9 have no close_range.
        for fd in 0..4096 {
            if fd != rx {
                libc::close(fd);
            }
        }
    }
    let mut groups = [0i32; CAPACITY];
    let mut buf = [0u8; 4];
    let mut have = 0usize;
    loop {
        let n = libc::read(rx, buf.as_mut_ptr().add(have).cast(), 4 - have);
        if n < 0 && *libc::__errno_location() == libc::EINTR {
            continue;
        }
        if n <= 0 {
            break;
        }
        have += n as usize;
        if have < 4 {
            continue;
        }
        have = 0;
        let v = i32::from_ne_bytes(buf);
        if v > 0 {
            // Listed once, however often it is sent (a replaced watchdog is sent the groups
            // again): one `forget` must unlist it.
            if groups.contains(&v) {
                continue;
            }
            if let Some(slot) = groups.iter_mut().find(|g| **g == 0) {
                *slot = v;
            }
        } else if let Some(slot) = groups.iter_mut().find(|g| **g == -v) {
            *slot = 0;
        }
    }
    for &g in groups.iter().filter(|g| **g > 0) {
        libc::kill(-g, libc::SIGKILL);
    }
    libc::_exit(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::time::{Duration, Instant};

    fn gone(child: &mut std::process::Child) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    #[test]
    fn listed_groups_die_when_the_pipe_closes_and_forgotten_ones_live() {
        let mut listed = Command::new("sleep").arg("60").process_group(0).spawn().unwrap();
        let mut forgotten = Command::new("sleep").arg("60").process_group(0).spawn().unwrap();
        let mut reaper = GroupReaper::start().unwrap();
        reaper.watch_group(listed.id() as i32);
        reaper.watch_group(forgotten.id() as i32);
        reaper.forget_group(forgotten.id() as i32);
        drop(reaper); // same end of file the watchdog sees when the launcher dies
        assert!(gone(&mut listed), "listed group survived");
        assert_eq!(forgotten.try_wait().unwrap(), None, "forgotten group was killed");
        forgotten.kill().unwrap();
        forgotten.wait().unwrap();
    }

    #[test]
    fn the_watchdog_carries_a_name_of_its_own() {
        let reaper = GroupReaper::start().unwrap();
        let comm = format!("/proc/{}/comm", reaper.pid());
        // (It names itself right after the fork: give it a moment.)
        let deadline = Instant::now() + Duration::from_secs(5);
        let want = WATCHDOG_NAME.to_str().unwrap();
        let mut name = String::new();
        while Instant::now() < deadline {
            name = std::fs::read_to_string(&comm).unwrap_or_default().trim_end().to_string();
            if name == want {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(name, want, "the watchdog's process name");
        drop(reaper);
    }

    #[test]
    fn a_killed_watchdog_is_reaped_and_reported() {
        let mut reaper = GroupReaper::start().unwrap();
        assert_eq!(reaper.check_dead(), None);
        let pid = reaper.pid();
        // SAFETY: signalling our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        let deadline = Instant::now() + Duration::from_secs(5);
        let how = loop {
            if let Some(how) = reaper.check_dead() {
                break how;
            }
            assert!(Instant::now() < deadline, "the dead watchdog was never reaped");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(how, "was killed by signal 9");
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "left a zombie");
        drop(reaper); // must not block on the already reaped pid
    }
}
