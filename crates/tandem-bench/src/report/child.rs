//! Runs one benchmark process (a `tandem bench ...` or a PyTorch peer) with a deadline. Each
//! child gets its own process group, so the ranks it spawns die with it on a timeout and none is
//! left behind.
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::bail;

fn kill_group(pid: u32) {
    // SAFETY: kill(2) with a negative pid signals the process group we created for the child;
    // ESRCH (nothing left) is the expected outcome after a clean exit.
    unsafe {
        libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
    }
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// stdout of `cmd` when it exits 0 within `limit`; otherwise an error naming `what`, with the
/// end of its stderr.
pub fn stdout_of(cmd: &mut Command, limit: Duration, what: &str) -> anyhow::Result<String> {
    output_of(cmd, limit, what).map(|(out, _)| out)
}

/// (stdout, stderr) of `cmd` when it exits 0 within `limit`; as `stdout_of` otherwise.
pub fn output_of(
    cmd: &mut Command,
    limit: Duration,
    what: &str,
) -> anyhow::Result<(String, String)> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => bail!("{what}: cannot start {:?}: {e}", cmd.get_program()),
    };
    let pid = child.id();
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(o) = out.as_mut() {
            o.read_to_string(&mut s).ok();
        }
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = err.as_mut() {
            e.read_to_string(&mut s).ok();
        }
        s
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() > limit => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                kill_group(pid);
                let _ = child.wait();
                bail!("{what}: waiting for the process: {e}");
            }
        }
    };
    // Whatever the child left running in its group (ranks, spawned workers) goes with it.
    kill_group(pid);
    if status.is_none() {
        let _ = child.wait();
    }
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    match status {
        None => {
            bail!("{what}: no result within {} s (killed)\n{}", limit.as_secs(), tail(&stderr, 15))
        }
        Some(st) if !st.success() => bail!("{what}: exited with {st}\n{}", tail(&stderr, 15)),
        Some(_) => Ok((stdout, stderr)),
    }
}
