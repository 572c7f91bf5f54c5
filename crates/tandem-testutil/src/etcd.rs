//! A real etcd cluster for tests (Debian's `etcd-server`): members as processes, on loopback or
//! each inside a simulated host; killed and their data removed when dropped.
use std::process::{Child, Command, Stdio};

/// Why an etcd cluster cannot be started here, if so.
pub fn etcd_missing() -> Option<String> {
    match Command::new("etcd").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no etcd on PATH (Debian: apt install etcd-server)".into()),
    }
}

/// The members of one cluster.
pub struct EtcdCluster {
    members: Vec<Option<Child>>,
    endpoints: Vec<String>,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// `n` members on loopback, each with free ports of its own.
    pub fn on_loopback(n: usize) -> EtcdCluster {
        let ports: Vec<(u16, u16)> =
            (0..n).map(|_| (crate::free_port(), crate::free_port())).collect();
        Self::start(
            n,
            |i| ("127.0.0.1".to_string(), ports[i].0, ports[i].1),
            |_, args| {
                let mut c = Command::new("etcd");
                c.args(args);
                c
            },
        )
    }

    /// `n` members: member `i` at `addr(i)` = (ip, client port, peer port), its process made by
    /// `command(i, etcd's arguments)` (e.g. [`crate::netns::Hosts::command`]).
    pub fn start(
        n: usize,
        addr: impl Fn(usize) -> (String, u16, u16),
        command: impl Fn(usize, &[&str]) -> Command,
    ) -> EtcdCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let urls: Vec<(String, String)> = (0..n)
            .map(|i| {
                let (ip, client, peer) = addr(i);
                (format!("http://{ip}:{client}"), format!("http://{ip}:{peer}"))
            })
            .collect();
        let initial: Vec<String> =
            urls.iter().enumerate().map(|(i, (_, peer))| format!("m{i}={peer}")).collect();
        let initial = initial.join(",");
        let token = format!("tandem-test-{}", std::process::id());
        let members = urls
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let name = format!("m{i}");
                let data = dir.path().join(&name);
                let data = data.to_string_lossy();
                let args = [
                    "--name",
                    &name,
                    "--data-dir",
                    &data,
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    &initial,
                    "--initial-cluster-token",
                    &token,
                    "--initial-cluster-state",
                    "new",
                    // Fast elections: a lost leader is replaced in about a second.
                    "--heartbeat-interval",
                    "100",
                    "--election-timeout",
                    "1000",
                ];
                let log = std::fs::File::create(dir.path().join(format!("{name}.log")))
                    .expect("a member's log file");
                let child = command(i, &args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("start an etcd member");
                Some(child)
            })
            .collect();
        let endpoints =
            urls.iter().map(|(c, _)| c.trim_start_matches("http://").to_string()).collect();
        EtcdCluster { members, endpoints, dir }
    }

    /// SIGKILLs member `i` (and reaps it).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The members' client addresses, host:port.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// [`EtcdCluster::endpoints`] joined by commas (the form flags and variables take).
    pub fn joined(&self) -> String {
        self.endpoints.join(",")
    }

    /// The last lines of member `i`'s log (for a failing test's message).
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.path().join(format!("m{i}.log")));
        crate::tail(&text.unwrap_or_default(), lines)
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
