//! A run's faults, drawn from its seed: what happens, where, when and for how long. The same
//! seed gives the same schedule, so a failing run is replayed by its seed alone.
use std::fmt;

use tandem_testutil::Rng;

/// Ranks per simulated host, and hosts, of the soak's job.
pub const HOSTS: usize = 3;
pub const RANKS_PER_HOST: usize = 2;

/// Percent of the packets dropped on a lossy link.
pub const LOSS_PERCENT: f64 = 10.0;

/// One fault of the schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// A worker SIGKILLed; its launcher starts a replacement.
    WorkerKill { host: usize, local_rank: usize },
    /// A launcher SIGKILLed (its watchdog takes its workers), started again `back_s` later.
    LauncherKill { host: usize, back_s: f64 },
    /// Host 0 lost whole: its launcher, its workers and its etcd member SIGKILLed; the member
    /// and the launcher started again `back_s` later.
    HostZeroLost { back_s: f64 },
    /// A host's link down for `secs`.
    LinkCut { host: usize, secs: f64 },
    /// [`LOSS_PERCENT`] of a host's incoming packets dropped for `secs`.
    PacketLoss { host: usize, secs: f64 },
    /// The run's directory full (every write fails with ENOSPC) for `secs`, saves included.
    DiskFull { secs: f64 },
    /// An etcd member SIGKILLed (the cluster keeps its quorum), started again `back_s` later.
    EtcdMemberKill { member: usize, back_s: f64 },
}

impl Fault {
    /// Every kind, in the order the report counts them.
    pub const KINDS: [&'static str; 7] = [
        "worker SIGKILL",
        "launcher SIGKILL",
        "host 0 lost",
        "link cut",
        "packet loss",
        "disk full",
        "etcd member SIGKILL",
    ];

    /// Its entry in [`Fault::KINDS`].
    pub fn kind(&self) -> usize {
        match self {
            Fault::WorkerKill { .. } => 0,
            Fault::LauncherKill { .. } => 1,
            Fault::HostZeroLost { .. } => 2,
            Fault::LinkCut { .. } => 3,
            Fault::PacketLoss { .. } => 4,
            Fault::DiskFull { .. } => 5,
            Fault::EtcdMemberKill { .. } => 6,
        }
    }

    /// The live-recovery members a fault takes out for certain (each must leave the world in a
    /// regroup after it): a worker's, or every worker of a launcher or host lost.
    pub fn members_lost(&self) -> Vec<usize> {
        let of_host = |h: usize| (0..RANKS_PER_HOST).map(|l| h * RANKS_PER_HOST + l).collect();
        match *self {
            Fault::WorkerKill { host, local_rank } => vec![host * RANKS_PER_HOST + local_rank],
            Fault::LauncherKill { host, .. } => of_host(host),
            Fault::HostZeroLost { .. } => of_host(0),
            _ => Vec::new(),
        }
    }

    fn draw(rng: &mut Rng) -> Fault {
        let host = rng.below(HOSTS as u64) as usize;
        let between = |rng: &mut Rng, lo: f64, hi: f64| lo + (hi - lo) * rng.unit();
        match rng.below(Fault::KINDS.len() as u64) {
            0 => Fault::WorkerKill { host, local_rank: rng.below(RANKS_PER_HOST as u64) as usize },
            1 => Fault::LauncherKill { host, back_s: between(rng, 1.0, 4.0) },
            2 => Fault::HostZeroLost { back_s: between(rng, 2.0, 5.0) },
            3 => Fault::LinkCut { host, secs: between(rng, 2.0, 8.0) },
            4 => Fault::PacketLoss { host, secs: between(rng, 5.0, 10.0) },
            5 => Fault::DiskFull { secs: between(rng, 2.0, 4.0) },
            _ => Fault::EtcdMemberKill { member: host, back_s: between(rng, 2.0, 5.0) },
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Fault::WorkerKill { host, local_rank } => {
                write!(f, "worker (local rank {local_rank}) of host {host} SIGKILLed")
            }
            Fault::LauncherKill { host, back_s } => {
                write!(f, "launcher of host {host} SIGKILLed, started again after {back_s:.1} s")
            }
            Fault::HostZeroLost { back_s } => write!(
                f,
                "host 0 lost whole (launcher, workers, etcd member), back after {back_s:.1} s"
            ),
            Fault::LinkCut { host, secs } => write!(f, "link of host {host} cut for {secs:.1} s"),
            Fault::PacketLoss { host, secs } => {
                write!(f, "{LOSS_PERCENT}% packet loss on host {host} for {secs:.1} s")
            }
            Fault::DiskFull { secs } => write!(f, "the run's disk full for {secs:.1} s"),
            Fault::EtcdMemberKill { member, back_s } => {
                write!(f, "etcd member {member} SIGKILLed, started again after {back_s:.1} s")
            }
        }
    }
}

/// A fault at `at_s` seconds into the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Planned {
    pub at_s: f64,
    pub fault: Fault,
}

/// `n` faults of seed `seed` spread over `[from_s, to_s)` of a run: one per equal slot, each in
/// the first third of its slot so that it has ended (and the job recovered) before the next.
pub fn schedule(seed: u64, n: usize, from_s: f64, to_s: f64) -> Vec<Planned> {
    let mut rng = Rng::new(seed);
    let slot = (to_s - from_s) / n.max(1) as f64;
    (0..n)
        .map(|i| Planned {
            at_s: from_s + slot * (i as f64 + rng.unit() / 3.0),
            fault: Fault::draw(&mut rng),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_schedule_and_the_faults_stay_in_order_inside_the_span() {
        let a = schedule(7, 5, 10.0, 60.0);
        assert_eq!(a, schedule(7, 5, 10.0, 60.0));
        assert_ne!(a, schedule(8, 5, 10.0, 60.0));
        assert!(a.windows(2).all(|w| w[0].at_s < w[1].at_s), "{a:?}");
        assert!(a.iter().all(|p| (10.0..60.0).contains(&p.at_s)), "{a:?}");
        // Over many seeds every kind is drawn, and only hosts and members that exist.
        let all: Vec<Fault> =
            (0..40).flat_map(|s| schedule(s, 4, 0.0, 1.0)).map(|p| p.fault).collect();
        for kind in 0..Fault::KINDS.len() {
            assert!(all.iter().any(|f| f.kind() == kind), "{} never drawn", Fault::KINDS[kind]);
        }
        for f in &all {
            assert!(f.members_lost().iter().all(|&m| m < HOSTS * RANKS_PER_HOST), "{f:?}");
        }
        assert_eq!(Fault::LauncherKill { host: 2, back_s: 1.0 }.members_lost(), vec![4, 5]);
        assert_eq!(Fault::WorkerKill { host: 1, local_rank: 1 }.members_lost(), vec![3]);
    }
}
