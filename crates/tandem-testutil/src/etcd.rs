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
    /// Each member's arguments, for [`EtcdCluster::restart`].
    args: Vec<Vec<String>>,
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
        let args: Vec<Vec<String>> = urls
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
                args.iter().map(|a| a.to_string()).collect()
            })
            .collect();
        let mut cluster = EtcdCluster {
            members: (0..n).map(|_| None).collect(),
            args,
            endpoints: urls.iter().map(|(c, _)| c.trim_start_matches("http://").into()).collect(),
            dir,
        };
        for i in 0..n {
            cluster.restart(i, &command);
        }
        cluster
    }

    /// Starts member `i` (again, after [`EtcdCluster::kill`]: etcd takes its data directory
    /// back and catches up with the others), its process made by `command` as in
    /// [`EtcdCluster::start`]. Nothing happens while it runs.
    pub fn restart(&mut self, i: usize, command: impl Fn(usize, &[&str]) -> Command) {
        if self.members[i].is_some() {
            return;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("m{i}.log")))
            .expect("a member's log file");
        let args: Vec<&str> = self.args[i].iter().map(String::as_str).collect();
        let child = command(i, &args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start an etcd member");
        self.members[i] = Some(child);
    }

    /// SIGKILLs member `i` (and reaps it).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `sig` to member `i` (SIGSTOP makes it a member that is there but answers
    /// nothing, as one behind a cut link; SIGCONT brings it back). False when it is not running.
    pub fn signal(&self, i: usize, sig: i32) -> bool {
        let Some(c) = &self.members[i] else { return false };
        // SAFETY: kill(2) on the pid of a child this cluster started and has not reaped.
        unsafe { libc::kill(c.id() as i32, sig) == 0 }
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
