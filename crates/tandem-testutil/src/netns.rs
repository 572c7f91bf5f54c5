//! Simulated hosts for multi-host tests: each host is a network namespace with its own address
//! (10.77.0.<i+1>/24 on a veth whose other end sits on a bridge in a "switch" namespace) and,
//! for every command run in it, its own hostname (a fresh UTS namespace), so tandem's host
//! detection sees different machines. An optional `tc netem` on each host's link delays,
//! rate-limits or drops packets. Needs root and iproute2 (`ip`, `tc`) — CI has both; elsewhere
//! [`Hosts::unavailable`] says why, and the test is reported as skipped, never as passed.
//! Namespaces are removed when the `Hosts` value is dropped (their links go with them).
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `tc netem` settings for every host's link.
#[derive(Clone, Copy, Debug, Default)]
pub struct Netem {
    pub delay_ms: f64,
    pub rate_mbit: Option<u64>,
    pub loss_percent: f64,
}

pub struct Hosts {
    names: Vec<String>,
    switch: String,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Hosts {
    /// Why simulated hosts cannot be made here (not root, no iproute2, namespaces refused), or
    /// `None` when they can: a namespace is created and deleted to find out.
    pub fn unavailable() -> Option<String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Some("network namespaces need root (CI runs as root)".into());
        }
        for tool in ["ip", "tc", "unshare"] {
            if Command::new(tool).arg("-V").output().is_err() {
                return Some(format!(
                    "`{tool}` is not installed (apt install iproute2 util-linux)"
                ));
            }
        }
        let probe = format!("tdm-probe-{}", std::process::id());
        match sh(&["ip", "netns", "add", &probe]) {
            Ok(()) => {
                let _ = sh(&["ip", "netns", "del", &probe]);
                None
            }
            Err(e) => Some(format!("cannot create a network namespace: {e}")),
        }
    }

    /// `n` hosts on one switch, each link shaped by `netem` when given. Panics naming the
    /// failing command (callers check [`Hosts::unavailable`] first).
    pub fn new(n: usize, netem: Option<Netem>) -> Hosts {
        let id = format!("tdm{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst));
        let hosts = Hosts {
            names: (0..n).map(|i| format!("{id}h{i}")).collect(),
            switch: format!("{id}sw"),
        };
        if let Err(e) = hosts.build(netem) {
            panic!("building {n} simulated hosts: {e}");
        }
        hosts
    }

    fn build(&self, netem: Option<Netem>) -> Result<(), String> {
        let sw = self.switch.as_str();
        sh(&["ip", "netns", "add", sw])?;
        sh(&["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", sw, "link", "set", "br0", "up"])?;
        for (i, ns) in self.names.iter().enumerate() {
            let (host_if, port) = (format!("eth{i}"), format!("port{i}"));
            sh(&["ip", "netns", "add", ns])?;
            sh(&[
                "ip", "link", "add", &host_if, "netns", ns, "type", "veth", "peer", "name", &port,
                "netns", sw,
            ])?;
            sh(&["ip", "-n", sw, "link", "set", &port, "master", "br0"])?;
            sh(&["ip", "-n", sw, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", self.addr(i));
            sh(&["ip", "-n", ns, "addr", "add", &cidr, "dev", &host_if])?;
            sh(&["ip", "-n", ns, "link", "set", &host_if, "up"])?;
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
            if let Some(n) = netem {
                let mut args: Vec<String> = [
                    "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", &host_if, "root",
                    "netem",
                ]
                .map(String::from)
                .to_vec();
                args.extend(["delay".into(), format!("{}ms", n.delay_ms)]);
                if let Some(rate) = n.rate_mbit {
                    args.extend(["rate".into(), format!("{rate}mbit")]);
                }
                if n.loss_percent > 0.0 {
                    args.extend(["loss".into(), format!("{}%", n.loss_percent)]);
                }
                sh(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Host `i`'s address on the switch.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// The hostname commands on host `i` see.
    pub fn hostname(&self, i: usize) -> String {
        format!("simhost{i}")
    }

    /// `program args` to run on host `i`: inside its network namespace, in a new UTS namespace
    /// named [`Hosts::hostname`]. The environment is inherited.
    pub fn command(&self, i: usize, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i], "unshare", "--uts", "sh", "-c"])
            .arg(format!("hostname {} && exec \"$0\" \"$@\"", self.hostname(i)))
            .arg(program)
            .args(args);
        c
    }

    /// Cuts (or restores) host `i`'s link.
    pub fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        let dev = format!("eth{i}");
        sh(&["ip", "-n", &self.names[i], "link", "set", &dev, if up { "up" } else { "down" }])
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in self.names.iter().chain(std::iter::once(&self.switch)) {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}
