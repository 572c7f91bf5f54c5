//! Simulated hosts for multi-host tests: each host is a network namespace with its own address
//! (10.77.0.<i+1>/24 on a veth whose other end sits on a bridge in a "switch" namespace) and,
//! for every command run in it, its own hostname (a fresh UTS namespace), so tandem's host
//! detection sees different machines. An optional `tc netem` on each host's link delays,
//! rate-limits or drops packets. Kernels built without `sch_netem` (some VMs) get the same
//! rate from a `tbf` qdisc and the same loss from an nftables rule (`numgen random`); only the
//! delay is then left out, and [`Hosts::shaping`] says so. Needs root and iproute2 (`ip`, `tc`;
//! `nft` for loss without netem) — CI has them; elsewhere [`Hosts::unavailable`] says why, and
//! the test is reported as skipped, never as passed.
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
    shaping: String,
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

    /// Why packet loss cannot be simulated here (no `sch_netem` in the kernel and no `nft`),
    /// or `None`.
    pub fn loss_unavailable() -> Option<String> {
        if let Some(why) = Hosts::unavailable() {
            return Some(why);
        }
        let probe = format!("tdm-lossprobe-{}", std::process::id());
        sh(&["ip", "netns", "add", &probe]).ok()?;
        let netem =
            sh(&["ip", "-n", &probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
                .and_then(|_| {
                    sh(&[
                        "ip", "netns", "exec", &probe, "tc", "qdisc", "add", "dev", "p0", "root",
                        "netem", "loss", "1%",
                    ])
                });
        let _ = sh(&["ip", "netns", "del", &probe]);
        if netem.is_ok() || Command::new("nft").arg("--version").output().is_ok() {
            None
        } else {
            Some(
                "the kernel has no sch_netem and `nft` is not installed (apt install nftables)"
                    .into(),
            )
        }
    }

    /// `n` hosts on one switch, each link shaped by `netem` when given. Panics naming the
    /// failing command (callers check [`Hosts::unavailable`] first).
    pub fn new(n: usize, netem: Option<Netem>) -> Hosts {
        let id = format!("tdm{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst));
        let mut hosts = Hosts {
            names: (0..n).map(|i| format!("{id}h{i}")).collect(),
            switch: format!("{id}sw"),
            shaping: "none".into(),
        };
        if let Err(e) = hosts.build(netem) {
            panic!("building {n} simulated hosts: {e}");
        }
        hosts
    }

    fn build(&mut self, netem: Option<Netem>) -> Result<(), String> {
        let sw = self.switch.as_str();
        sh(&["ip", "netns", "add", sw])?;
        sh(&["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", sw, "link", "set", "br0", "up"])?;
        for (i, ns) in self.names.clone().iter().enumerate() {
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
                self.shaping = shape_link(ns, &host_if, n)?;
            }
        }
        self.write_etc_hosts()
    }

    /// Every host's name resolves to its address inside every namespace (programs such as
    /// torchrun look their own hostname up): `ip netns exec` bind-mounts `/etc/netns/NS/hosts`
    /// over `/etc/hosts`.
    fn write_etc_hosts(&self) -> Result<(), String> {
        let mut table = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for i in 0..self.names.len() {
            table.push_str(&format!("{} {}\n", self.addr(i), self.hostname(i)));
        }
        for ns in &self.names {
            let dir = format!("/etc/netns/{ns}");
            std::fs::create_dir_all(&dir)
                .and_then(|_| std::fs::write(format!("{dir}/hosts"), &table))
                .map_err(|e| format!("writing {dir}/hosts: {e}"))?;
        }
        Ok(())
    }

    /// How the links are shaped: `none`, `netem ...`, or the tbf/nftables fallback with what it
    /// left out.
    pub fn shaping(&self) -> &str {
        &self.shaping
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
            .args(args)
            // The simulated hosts are one job's nodes: each holds the job's secret file.
            .env("TANDEM_SECRET_FILE", crate::job_secret_file());
        c
    }

    /// Packets dropped so far by the loss shaping of host `i` (netem's or the nftables rule's
    /// counter); `None` when it cannot be read.
    pub fn dropped_packets(&self, i: usize) -> Option<u64> {
        let ns = &self.names[i];
        let run = |args: &[&str]| {
            Command::new("ip")
                .args(["netns", "exec", ns])
                .args(args)
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        };
        let number_after = |text: &str, word: &str| {
            let rest = &text[text.find(word)? + word.len()..];
            rest.split_whitespace().next()?.trim_end_matches(',').parse::<u64>().ok()
        };
        if self.shaping.starts_with("netem") {
            let dev = format!("eth{i}");
            number_after(&run(&["tc", "-s", "qdisc", "show", "dev", &dev])?, "dropped ")
        } else {
            number_after(
                &run(&["nft", "list", "chain", "inet", "tdm_shape", "in"])?,
                "counter packets ",
            )
        }
    }

    /// Adds a second network: every host gets an interface named `data` (the same name on
    /// every host, as a cluster's second NIC) with address [`Hosts::data_addr`], on a bridge of
    /// its own. Panics naming the failing command.
    pub fn add_data_network(&self) {
        let run = || -> Result<(), String> {
            let sw = self.switch.as_str();
            sh(&["ip", "-n", sw, "link", "add", "br1", "type", "bridge"])?;
            sh(&["ip", "-n", sw, "link", "set", "br1", "up"])?;
            for (i, ns) in self.names.iter().enumerate() {
                let port = format!("data{i}");
                sh(&[
                    "ip", "link", "add", "data", "netns", ns, "type", "veth", "peer", "name",
                    &port, "netns", sw,
                ])?;
                sh(&["ip", "-n", sw, "link", "set", &port, "master", "br1"])?;
                sh(&["ip", "-n", sw, "link", "set", &port, "up"])?;
                let cidr = format!("{}/24", self.data_addr(i));
                sh(&["ip", "-n", ns, "addr", "add", &cidr, "dev", "data"])?;
                sh(&["ip", "-n", ns, "link", "set", "data", "up"])?;
            }
            Ok(())
        };
        if let Err(e) = run() {
            panic!("adding the data network: {e}");
        }
    }

    /// Host `i`'s address on the data network ([`Hosts::add_data_network`]).
    pub fn data_addr(&self, i: usize) -> String {
        format!("10.78.0.{}", i + 1)
    }

    /// Bytes host `i` has sent through its interface `dev` (the kernel's counter).
    pub fn tx_bytes(&self, i: usize, dev: &str) -> u64 {
        let path = format!("/sys/class/net/{dev}/statistics/tx_bytes");
        let out = Command::new("ip")
            .args(["netns", "exec", &self.names[i], "cat", &path])
            .output()
            .unwrap_or_else(|e| panic!("reading {path} on host {i}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().unwrap_or_else(|_| panic!("{path} on host {i}: {text:?}"))
    }

    /// The name of host `i`'s interface on the switch.
    pub fn interface(&self, i: usize) -> String {
        format!("eth{i}")
    }

    /// Drops `percent` of the packets arriving on host `i`'s link from now on (`None`: none
    /// again), as [`Netem::loss_percent`] does from the start; returns what was applied.
    pub fn set_loss(&self, i: usize, percent: Option<f64>) -> Result<String, String> {
        let (ns, dev) = (&self.names[i], format!("eth{i}"));
        // Whatever shaped the link before goes first (either kind; the other is absent).
        let _ = sh(&["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", &dev, "root"]);
        let _ = sh(&["ip", "netns", "exec", ns, "nft", "delete table inet tdm_shape"]);
        match percent {
            None => Ok("none".into()),
            Some(p) => shape_link(ns, &dev, Netem { loss_percent: p, ..Netem::default() }),
        }
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
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
        }
    }
}

/// Applies `n` to the egress of `dev` in namespace `ns`: netem when the kernel has it, else tbf
/// for the rate and nftables for the loss. Returns a description of what was applied.
fn shape_link(ns: &str, dev: &str, n: Netem) -> Result<String, String> {
    let tc = |rest: &[&str]| {
        let mut args = vec!["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"];
        args.extend(rest);
        sh(&args)
    };
    let mut netem = vec!["netem".to_string(), "delay".into(), format!("{}ms", n.delay_ms)];
    if let Some(rate) = n.rate_mbit {
        netem.extend(["rate".into(), format!("{rate}mbit")]);
    }
    if n.loss_percent > 0.0 {
        netem.extend(["loss".into(), format!("{}%", n.loss_percent)]);
    }
    match tc(&netem.iter().map(String::as_str).collect::<Vec<_>>()) {
        Ok(()) => return Ok(netem.join(" ")),
        Err(e) if !e.contains("qdisc kind is unknown") => return Err(e),
        Err(_) => {}
    }
    let mut applied = Vec::new();
    if let Some(rate) = n.rate_mbit {
        // A burst of ~1 ms at the rate (at least 64 KiB) keeps TCP near the configured rate.
        let burst = ((rate * 1000 / 8) as usize).max(64 * 1024);
        let (rate_s, burst_s) = (format!("{rate}mbit"), format!("{burst}b"));
        tc(&["tbf", "rate", &rate_s, "burst", &burst_s, "latency", "50ms"])?;
        applied.push(format!("tbf rate {rate}mbit"));
    }
    if n.loss_percent > 0.0 {
        let nft = |rule: &str| sh(&["ip", "netns", "exec", ns, "nft", rule]);
        nft("add table inet tdm_shape")?;
        // Dropped on arrival: to the sender it is loss on the wire. (Dropping in the output hook
        // would instead hand the sender EPERM, which TCP handles differently.)
        nft("add chain inet tdm_shape in { type filter hook input priority 0 ; }")?;
        let per_mille = (n.loss_percent * 10.0).round() as u32;
        nft(&format!(
            "add rule inet tdm_shape in iifname \"{dev}\" numgen random mod 1000 < {per_mille} counter drop"
        ))?;
        applied.push(format!("nftables drop {}%", n.loss_percent));
    }
    if n.delay_ms > 0.0 {
        applied.push(format!(
            "no delay (this kernel has no sch_netem; {} ms not applied)",
            n.delay_ms
        ));
    }
    Ok(applied.join(", "))
}
