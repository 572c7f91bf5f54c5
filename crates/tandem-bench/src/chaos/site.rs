//! One soak run's world: three simulated hosts (network namespaces, each with its own hostname
//! and etcd member), the job's launchers on them, its directory on a tmpfs of its own (so that
//! "the disk is full" can be made true), and the faults applied to them.
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tandem_testutil::etcd::EtcdCluster;
use tandem_testutil::netns::Hosts;
use tandem_testutil::procs::{environ, leftovers, marked_processes, sigkill, MARKER_VAR};
use tandem_testutil::tmpfs::Tmpfs;
use tandem_testutil::{children_of, without_world};

use super::plan::{Fault, HOSTS, LOSS_PERCENT, RANKS_PER_HOST};

/// A launcher this run started: its process and its log file.
struct Launcher {
    child: Child,
    log: PathBuf,
}

/// What became of a launcher.
pub struct Ended {
    pub host: usize,
    pub log: PathBuf,
    /// Its exit code; `None`: it was SIGKILLed by a fault (or by the run's limit).
    pub code: Option<i32>,
    /// Whether a fault killed it (its failure is then the fault's, not the job's).
    pub killed_by_fault: bool,
}

pub struct Site {
    hosts: Hosts,
    cluster: EtcdCluster,
    /// The run's directory (a tmpfs mount), and the job's `--out` inside it.
    pub dir: PathBuf,
    pub marker: String,
    tandem: PathBuf,
    worker: Vec<String>,
    running: Vec<Option<Launcher>>,
    ended: Vec<Ended>,
    starts: usize,
    /// Unmounted when the site is dropped, after its processes are gone (the run's files go
    /// with it; its logs were copied out by then).
    _disk: Tmpfs,
}

impl Site {
    /// Hosts, etcd cluster and the tmpfs at `dir` (`size` like `64m`); nothing runs yet.
    pub fn new(dir: &Path, tandem: &Path, marker: &str, size: &str) -> anyhow::Result<Site> {
        let disk = Tmpfs::mount(dir, size)
            .with_context(|| format!("mounting a {size} tmpfs at {} (root only)", dir.display()))?;
        let hosts = Hosts::new(HOSTS, None);
        let cluster = EtcdCluster::start(
            HOSTS,
            |i| (hosts.addr(i), 2379, 2380),
            |i, args| hosts.command(i, "etcd", args),
        );
        Ok(Site {
            hosts,
            cluster,
            dir: dir.to_path_buf(),
            marker: marker.to_string(),
            tandem: tandem.to_path_buf(),
            worker: Vec::new(),
            running: (0..HOSTS).map(|_| None).collect(),
            ended: Vec::new(),
            starts: 0,
            _disk: disk,
        })
    }

    /// Starts the job (`tandem WORKER...` on every host under live recovery on etcd).
    pub fn start(&mut self, worker: &[String]) -> anyhow::Result<()> {
        self.worker = worker.to_vec();
        (0..HOSTS).try_for_each(|h| self.launch(h))
    }

    /// `tandem run --nnodes 3 --node-rank h --nproc-per-node 2 --live-recovery --rdzv-backend
    /// etcd ...` on host `h`, its output in a log file of its own.
    fn launch(&mut self, h: usize) -> anyhow::Result<()> {
        self.starts += 1;
        let log = self.dir.join(format!("launcher-{}-host{h}.log", self.starts));
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let (nnodes, node_rank, nproc) =
            (HOSTS.to_string(), h.to_string(), RANKS_PER_HOST.to_string());
        let endpoints = self.cluster.joined();
        let tandem = s(&self.tandem);
        #[rustfmt::skip]
        let mut args: Vec<&str> = vec![
            "run", "--nnodes", &nnodes, "--node-rank", &node_rank, "--nproc-per-node", &nproc,
            "--live-recovery", "--max-restarts", "1000", "--rdzv-backend", "etcd",
            "--rdzv-endpoints", &endpoints, "--run-id", &self.marker, "--monitor-interval", "0.05",
            "--", &tandem,
        ];
        args.extend(self.worker.iter().map(String::as_str));
        let mut cmd = self.hosts.command(h, &tandem, &args);
        without_world(&mut cmd);
        // The timeouts of the repo's live-recovery tests: a lost peer is noticed within seconds.
        cmd.env(MARKER_VAR, &self.marker)
            .env("TANDEM_TIMEOUT", "3")
            .env("TANDEM_INIT_TIMEOUT", "60")
            .env("TANDEM_LIVE_ARRIVAL_TIMEOUT", "5")
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let child = cmd.spawn().with_context(|| format!("starting host {h}'s launcher"))?;
        self.running[h] = Some(Launcher { child, log });
        Ok(())
    }

    /// Reaps launchers that exited.
    fn reap(&mut self) {
        for h in 0..HOSTS {
            let done = match self.running[h].as_mut().map(|l| l.child.try_wait()) {
                Some(Ok(Some(status))) => Some(status.code()),
                _ => None,
            };
            if let Some(code) = done {
                let l = self.running[h].take().expect("a launcher that exited");
                self.ended.push(Ended { host: h, log: l.log, code, killed_by_fault: false });
            }
        }
    }

    /// Whether every launcher has exited.
    pub fn finished(&mut self) -> bool {
        self.reap();
        self.running.iter().all(Option::is_none)
    }

    /// Waits for the job until `deadline`; past it SIGKILLs what is left and says so.
    pub fn wait(&mut self, deadline: Instant) -> anyhow::Result<()> {
        while !self.finished() {
            if Instant::now() > deadline {
                for l in self.running.iter_mut().flatten() {
                    let _ = l.child.kill();
                }
                leftovers(&self.marker, Duration::from_secs(1));
                self.finished();
                bail!("the job had not finished at the run's limit (a hang)");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Every launcher that ran, in the order they ended.
    pub fn ended(&self) -> &[Ended] {
        &self.ended
    }

    /// The job's processes still alive `settle` after its end (they are SIGKILLed).
    pub fn leftovers(&self, settle: Duration) -> Vec<i32> {
        leftovers(&self.marker, settle)
    }

    /// Applies `fault`, through to its end (the link back up, the launcher started again).
    pub fn apply(&mut self, fault: Fault) -> anyhow::Result<()> {
        let wait = |secs: f64| std::thread::sleep(Duration::from_secs_f64(secs));
        match fault {
            Fault::WorkerKill { host, local_rank } => {
                let pid = self.worker_pid(host, local_rank)?;
                sigkill(pid);
            }
            Fault::LauncherKill { host, back_s } => {
                self.kill_launcher(host)?;
                wait(back_s);
                self.launch(host)?;
            }
            Fault::HostZeroLost { back_s } => {
                self.kill_launcher(0)?;
                self.cluster.kill(0);
                wait(back_s);
                let hosts = &self.hosts;
                self.cluster.restart(0, |i, args| hosts.command(i, "etcd", args));
                self.launch(0)?;
            }
            Fault::LinkCut { host, secs } => {
                self.hosts.set_link(host, false).map_err(anyhow::Error::msg)?;
                wait(secs);
                self.hosts.set_link(host, true).map_err(anyhow::Error::msg)?;
            }
            Fault::PacketLoss { host, secs } => {
                self.hosts.set_loss(host, Some(LOSS_PERCENT)).map_err(anyhow::Error::msg)?;
                wait(secs);
                self.hosts.set_loss(host, None).map_err(anyhow::Error::msg)?;
            }
            Fault::DiskFull { secs } => {
                let filler = self.dir.join("filler");
                tandem_testutil::tmpfs::fill(&filler, 0)
                    .with_context(|| format!("filling {}", filler.display()))?;
                wait(secs);
                std::fs::remove_file(&filler)
                    .with_context(|| format!("removing {}", filler.display()))?;
            }
            Fault::EtcdMemberKill { member, back_s } => {
                self.cluster.kill(member);
                wait(back_s);
                let hosts = &self.hosts;
                self.cluster.restart(member, |i, args| hosts.command(i, "etcd", args));
            }
        }
        Ok(())
    }

    fn kill_launcher(&mut self, h: usize) -> anyhow::Result<()> {
        self.reap();
        let Some(mut l) = self.running[h].take() else {
            bail!("host {h}'s launcher had already exited")
        };
        sigkill(l.child.id() as i32);
        let _ = l.child.wait();
        self.ended.push(Ended { host: h, log: l.log, code: None, killed_by_fault: true });
        Ok(())
    }

    /// The worker of local rank `local_rank` under host `h`'s launcher, waited for up to 10 s
    /// (a replacement may be starting).
    fn worker_pid(&mut self, h: usize, local_rank: usize) -> anyhow::Result<i32> {
        let want = format!("LOCAL_RANK={local_rank}");
        let start = Instant::now();
        loop {
            self.reap();
            let Some(l) = &self.running[h] else { bail!("host {h}'s launcher had exited") };
            let marked = marked_processes(&self.marker);
            let found = children_of(l.child.id() as i32)
                .into_iter()
                .map(|(pid, _)| pid)
                .find(|pid| marked.contains(pid) && environ(*pid).contains(&want));
            match found {
                Some(pid) => return Ok(pid),
                None if start.elapsed() > Duration::from_secs(10) => {
                    bail!("no worker of local rank {local_rank} on host {h} for 10 s")
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        for l in self.running.iter_mut().flatten() {
            let _ = l.child.kill();
            let _ = l.child.wait();
        }
        leftovers(&self.marker, Duration::from_secs(1));
    }
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}
