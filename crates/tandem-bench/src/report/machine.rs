//! What the report says about the machine it ran on: CPU model, cores, memory, load average
//! before and after, date, git commit. Read from /proc where Linux has it; "unknown" elsewhere.
use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub memory: String,
    pub kernel: String,
    pub date_utc: String,
    pub git_commit: String,
}

impl Machine {
    pub fn probe(repo: &Path) -> Machine {
        let cpu_model = host_cpu();
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                let kib: f64 = m
                    .lines()
                    .find(|l| l.starts_with("MemTotal:"))?
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()?;
                Some(format!("{:.1} GiB", kib / (1u64 << 20) as f64))
            })
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| format!("Linux {}", s.trim()))
            .unwrap_or_else(|_| std::env::consts::OS.into());
        Machine {
            cpu_model,
            cores,
            memory,
            kernel,
            date_utc: now_utc(),
            git_commit: git_commit(repo),
        }
    }
}

/// The vector extensions the kernels (and oneDNN) pick from, as /proc/cpuinfo names them:
/// x86's AVX2 / FMA / AVX-512 family / AMX, Arm's NEON (asimd) / SVE; "ISA unknown" elsewhere.
pub fn isa(cpuinfo: &str) -> String {
    const NAMED: [&str; 14] = [
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512dq",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "asimd",
        "sve",
        "sve2",
    ];
    let flags: std::collections::HashSet<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect())
        .unwrap_or_default();
    let have: Vec<&str> = NAMED.into_iter().filter(|f| flags.contains(f)).collect();
    if have.is_empty() {
        "ISA unknown".into()
    } else {
        have.join(" ")
    }
}

/// "CPU model (ISA)" of this host, from /proc/cpuinfo ("unknown" where there is none).
pub fn host_cpu() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| {
            l.starts_with("model name") || l.starts_with("Model") || l.starts_with("Hardware")
        })
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    format!("{model} ({})", isa(&cpuinfo))
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg prints them.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

fn git_commit(repo: &Path) -> String {
    let run = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c} (with uncommitted changes)")
            } else {
                c
            }
        }
        None => "unknown (not a git checkout)".into(),
    }
}

/// "YYYY-MM-DD HH:MM UTC" from the system clock (civil-from-days, proleptic Gregorian).
fn now_utc() -> String {
    let secs =
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil_from_days(0), (1970, 1, 1));
        assert_eq!(super::civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(super::civil_from_days(20_413), (2025, 11, 21));
    }
}
