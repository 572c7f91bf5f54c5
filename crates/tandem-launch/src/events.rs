//! What a launch reports while it runs: restarts, lost ranks, the failure summary. The library
//! prints nothing; each [`LaunchEvent`] goes to the configuration's [`EventSink`], which the
//! `tandem` binary points at stderr and a program embedding the launcher at its own log (the
//! default sends them to `tracing`). Each event's `Display` is the line an operator reads.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::outcome::{LaunchOutcome, WorkerExit};

/// One thing that happened to a launch, as it happened.
#[derive(Clone, Debug)]
pub enum LaunchEvent {
    /// The job ran past `--deadline`; its workers were stopped.
    PastDeadline { limit: Duration, nproc: u32 },
    /// A rank failed and the whole group starts again.
    Restarting { rank: u32, exit: WorkerExit, nproc: u32, restart: u32, max_restarts: u32 },
    /// The round ended on another node (`cause`); this node's workers start again with the others.
    RestartingWithNodes { cause: String, nproc: u32, restart: u32, max_restarts: u32 },
    /// A node not in the round waits to join an elastic job below its `--nnodes` maximum:
    /// this node's workers start again with it (not counted as a restart).
    AdmittingNode { hostname: String, nproc: u32 },
    /// The job finished on its `nnodes` nodes (round `round`) while this launcher waited as a
    /// spare: it never started workers.
    SpareNotNeeded { round: u32, nnodes: u32 },
    /// The round ended on another node and the job cannot go on; `node_needed`: a fixed
    /// `--nnodes` lost a node.
    FailedOnNodes { cause: String, node_needed: bool },
    /// Another process took the picked MASTER_PORT before rank 0 bound it; not a restart.
    PortTaken { old: u16, new: u16 },
    /// The rendezvous host has not answered for `silent`: the other nodes are not told of a
    /// failure here.
    HostSilent { silent: Duration },
    /// Telling the other nodes of this node's failure did not work.
    NodesNotTold { error: String },
    /// The watchdog of the workers' process groups (pid `old_pid`) died (`how`); `new_pid` is
    /// its replacement, `None` when none could start.
    WatchdogReplaced { old_pid: i32, how: String, new_pid: Option<i32> },
    /// Live recovery: a rank failed after the job had finished on the other ranks.
    FailedAfterFinish { rank: u32, exit: WorkerExit },
    /// Live recovery on etcd: this launcher found the job running (generation `generation`,
    /// without this node's ranks) and starts them as joiners: a lost host coming back.
    JoiningRunningJob { node_rank: u32, ranks: Vec<u32>, generation: u64, alive: usize },
    /// Live recovery on etcd: every rank of the job died (no member finished it); this node's
    /// ranks start as replacements, which restart it from its newest checkpoint.
    RestartingDeadJob { node_rank: u32, ranks: Vec<u32>, generation: u64 },
    /// Live recovery: a rank failed and is started again alone, to join the running job.
    Rejoining { rank: u32, exit: WorkerExit, restart: u32, max_restarts: u32 },
    /// Live recovery: a rank failed with no restarts left; the job goes on without it.
    GoingOnWithout { rank: u32, exit: WorkerExit, max_restarts: u32 },
    /// Live recovery: fewer than `--min-nproc-per-node` ranks are left; the node stops.
    NodeBelowMinimum { left: usize, nproc: u32, min: u32 },
    /// Live recovery: the job finished on `finished` ranks of this node after replacements
    /// or losses.
    FinishedWithLosses { finished: usize, replacements: u32, lost: Vec<u32> },
    /// The launch failed or was stopped by a signal: its summary (root cause, stderr tail).
    Ended { outcome: LaunchOutcome, max_restarts: u32 },
}

impl fmt::Display for LaunchEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use LaunchEvent::*;
        match self {
            PastDeadline { limit, nproc } => write!(
                f,
                "[launcher] the job ran past its deadline of {:.0} s; stopped its {nproc} worker(s)",
                limit.as_secs_f64()
            ),
            Restarting { rank, exit, nproc, restart, max_restarts } => write!(
                f,
                "[launcher] rank {rank} failed ({exit}); restarting all {nproc} worker(s) \
                 (restart {restart} of {max_restarts})"
            ),
            RestartingWithNodes { cause, nproc, restart, max_restarts } => write!(
                f,
                "[launcher] {cause}; restarting all {nproc} worker(s) of this node with the \
                 other nodes (restart {restart} of {max_restarts})"
            ),
            AdmittingNode { hostname, nproc } => write!(
                f,
                "[launcher] a node ({hostname}) is waiting to join the job; restarting all \
                 {nproc} worker(s) of this node with it (not counted as a restart)"
            ),
            SpareNotNeeded { round, nnodes } => write!(
                f,
                "[launcher] the job finished on its {nnodes} node(s) (round {round}) while this \
                 node waited as a spare; no worker was started here"
            ),
            FailedOnNodes { cause, node_needed } => write!(
                f,
                "[launcher] the job failed: {cause}; stopped this node's workers{}",
                if *node_needed { " (a fixed --nnodes cannot go on without that node)" } else { "" }
            ),
            PortTaken { old, new } => write!(
                f,
                "[launcher] MASTER_PORT {old} was taken before rank 0 could bind it; starting \
                 again on port {new} (not counted as a restart)"
            ),
            HostSilent { silent } => write!(
                f,
                "[launcher] the rendezvous host has not answered for {:.1}s; the other nodes are \
                 not told of this failure",
                silent.as_secs_f64()
            ),
            NodesNotTold { error } => write!(
                f,
                "[launcher] could not tell the other nodes that this node failed: {error}"
            ),
            WatchdogReplaced { old_pid, how, new_pid } => {
                write!(
                    f,
                    "[launcher] the watchdog that stops the workers' process groups if the \
                     launcher dies (pid {old_pid}) {how}; reaped it and "
                )?;
                match new_pid {
                    Some(pid) => write!(f, "started a new one (pid {pid})"),
                    None => write!(
                        f,
                        "could not start a new one: if this launcher is killed now, processes \
                         the workers started may outlive it"
                    ),
                }
            }
            FailedAfterFinish { rank, exit } => write!(
                f,
                "[launcher] rank {rank} failed ({exit}) after the job finished on the other \
                 ranks; not started again"
            ),
            JoiningRunningJob { node_rank, ranks, generation, alive } => write!(
                f,
                "[launcher] the job is running without node {node_rank} (generation \
                 {generation}, {alive} rank(s) alive): starting ranks {ranks:?} to join it"
            ),
            RestartingDeadJob { node_rank, ranks, generation } => write!(
                f,
                "[launcher] every rank of the job died (generation {generation}, none finished \
                 it): node {node_rank} starts ranks {ranks:?} to restart it from its newest \
                 checkpoint"
            ),
            Rejoining { rank, exit, restart, max_restarts } => write!(
                f,
                "[launcher] rank {rank} failed ({exit}); starting it again, to join the running \
                 job (restart {restart} of {max_restarts}; the other ranks go on)"
            ),
            GoingOnWithout { rank, exit, max_restarts } => write!(
                f,
                "[launcher] rank {rank} failed ({exit}); no restarts left (--max-restarts \
                 {max_restarts}): the job goes on without it"
            ),
            NodeBelowMinimum { left, nproc, min } => write!(
                f,
                "[launcher] only {left} of this node's {nproc} rank(s) are left and \
                 --min-nproc-per-node is {min}: stopping the node"
            ),
            FinishedWithLosses { finished, replacements, lost } => write!(
                f,
                "[launcher] live recovery: the job finished on {finished} rank(s) of this node; \
                 {replacements} replacement(s) started, rank(s) {lost:?} lost for good"
            ),
            Ended { outcome, max_restarts } => {
                write!(f, "{}", outcome.summary(*max_restarts).trim_end_matches('\n'))
            }
        }
    }
}

/// Where a launch's [`LaunchEvent`]s go. The default hands them to `tracing` (a library prints
/// nothing of its own); `tandem run` writes each to stderr as it comes.
#[derive(Clone)]
pub struct EventSink(Arc<dyn Fn(&LaunchEvent) + Send + Sync>);

impl EventSink {
    /// Calls `f` with every event, on the launcher's thread, as it happens.
    pub fn new(f: impl Fn(&LaunchEvent) + Send + Sync + 'static) -> Self {
        EventSink(Arc::new(f))
    }

    pub(crate) fn emit(&self, event: LaunchEvent) {
        (self.0)(&event)
    }
}

impl Default for EventSink {
    fn default() -> Self {
        EventSink::new(|e| match e {
            LaunchEvent::Ended { .. } | LaunchEvent::FailedOnNodes { .. } => {
                tracing::error!("{e}")
            }
            _ => tracing::warn!("{e}"),
        })
    }
}

impl fmt::Debug for EventSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EventSink")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_sink_receives_each_event_and_the_line_names_rank_and_restart() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = Arc::clone(&seen);
        let sink = EventSink::new(move |e| seen2.lock().unwrap().push(e.to_string()));
        sink.emit(LaunchEvent::Restarting {
            rank: 2,
            exit: WorkerExit::Code(3),
            nproc: 4,
            restart: 1,
            max_restarts: 2,
        });
        sink.emit(LaunchEvent::WatchdogReplaced {
            old_pid: 7,
            how: "exited".into(),
            new_pid: None,
        });
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert!(seen[0].starts_with("[launcher] rank 2 failed ("), "{}", seen[0]);
        assert!(seen[0].ends_with("restarting all 4 worker(s) (restart 1 of 2)"), "{}", seen[0]);
        assert!(seen[1].contains("(pid 7) exited; reaped it and could not start"), "{}", seen[1]);
    }
}
