//! `/proc/<pid>/stat`, read once for the whole workspace: the shared-memory transport uses it to
//! tell a dead (zombie) peer from a live one, and tandem's tests to find and check processes;
//! and `/proc/meminfo`'s available memory, which bounds what a peer may make a rank allocate.
//! Public but hidden from the docs: a helper, not part of tandem's API.

/// The fields of `/proc/<pid>/stat` that tandem needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    pub ppid: i32,
    /// The kernel's task flags (`PF_*`).
    pub flags: u64,
}

impl ProcStat {
    /// `None` when there is no such process (or /proc is not mounted).
    pub fn read(pid: i32) -> Option<ProcStat> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        ProcStat::parse(&stat)
    }

    /// "pid (comm) S ppid ...": comm may hold spaces and parentheses, so the fields are read
    /// after the last ')'.
    pub fn parse(stat: &str) -> Option<ProcStat> {
        let (_, rest) = stat.rsplit_once(')')?;
        let mut fields = rest.split_whitespace();
        let state = fields.next()?.chars().next()?;
        let ppid = fields.next()?.parse().ok()?;
        // pgrp, session, tty_nr, tpgid, then flags.
        let flags = fields.nth(4)?.parse().ok()?;
        Some(ProcStat { state, ppid, flags })
    }

    /// Already inside exit (`PF_EXITING`): a signal sent now changes nothing, not even the exit
    /// status.
    pub fn is_exiting(&self) -> bool {
        const PF_EXITING: u64 = 0x4;
        self.flags & PF_EXITING != 0
    }

    /// Exited but not reaped yet (`Z`), or being torn down (`X`).
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes (`None` where it cannot be read).
pub fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// This process's peak resident set size (`VmHWM` of `/proc/self/status`) in bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Every pid listed in /proc.
pub fn all_pids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::ProcStat;

    #[test]
    fn command_names_with_spaces_and_parentheses() {
        let s = "4242 (my (odd) name) Z 17 4242 4242 0 -1 4194564 0 0";
        assert_eq!(ProcStat::parse(s), Some(ProcStat { state: 'Z', ppid: 17, flags: 4194564 }));
        assert!(ProcStat::parse(s).unwrap().is_dead() && ProcStat::parse(s).unwrap().is_exiting());
        assert_eq!(ProcStat::parse("garbage"), None);
        let me = ProcStat::read(std::process::id() as i32).expect("this process");
        assert!(!me.is_dead() && !me.is_exiting());
    }
}
