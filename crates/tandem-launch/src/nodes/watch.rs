//! Watching a round while this node's workers run: a thread of its own polls the store for a
//! failure reported elsewhere, a member's launcher gone, or a node waiting to join, so that a
//! cut link never blocks the launcher's monitor loop.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_comm::{CommError, Store};

use super::{connect, lost_message, parse_member, NodeAgent, Round, OP_LIMIT, POLL};
use crate::error::LaunchError;

/// How a round ended elsewhere, seen while this node's workers ran.
#[derive(Clone, Debug)]
pub(crate) enum Remote {
    /// A worker on another node failed; the message names the node and rank.
    Failed(String),
    /// Another node's launcher is gone (its connection to the store closed).
    NodeLost { node_rank: u32, hostname: String },
    /// The store on node 0 stopped answering: its launcher died or the link to it is cut.
    HostLost(String),
    /// A launcher that is not in the round waits for the next one (a lost host started
    /// again), and the round has fewer nodes than `--nnodes` allows: every node starts again
    /// with it (an elastic scale-up, as torchrun's agents admit a waiting node).
    NodeWaiting { hostname: String },
}

impl Remote {
    /// Whether the job can go on after this: not without a node of a fixed-size job, and never
    /// without the host.
    pub fn is_fatal(&self, elastic: bool) -> bool {
        match self {
            Remote::Failed(_) | Remote::NodeWaiting { .. } => false,
            Remote::NodeLost { .. } => !elastic,
            Remote::HostLost(_) => true,
        }
    }
}

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remote::Failed(m) => write!(f, "{m}"),
            Remote::NodeLost { node_rank, hostname } => write!(
                f,
                "node {node_rank} ({hostname}): its launcher is gone (its key in the \
                 rendezvous store went with it)"
            ),
            Remote::HostLost(m) => write!(f, "{m}"),
            Remote::NodeWaiting { hostname } => {
                write!(f, "a node ({hostname}) is waiting to join the job")
            }
        }
    }
}

impl NodeAgent {
    /// Starts watching `round` on a thread of its own with its own connection, so that a cut
    /// link never blocks the launcher's monitor loop.
    pub fn watch(&self, round: &Round, tick: Duration) -> Result<RoundWatch, LaunchError> {
        let store = connect(
            self.etcd.as_deref(),
            &self.endpoint,
            &self.run_id,
            self.secret.as_ref(),
            OP_LIMIT,
        )
        .map_err(|e| self.lost(e))?;
        store.set_timeout(OP_LIMIT);
        let seen = Arc::new(Mutex::new(None));
        let last_ok = Arc::new(Mutex::new(Instant::now()));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen2, stop2, round2) = (seen.clone(), stop.clone(), round.clone());
        let last_ok2 = last_ok.clone();
        let (is_host, on_etcd, endpoint) =
            (self.is_host, self.etcd.is_some(), self.endpoint.clone());
        let max_nodes = self.max_nodes;
        let thread = std::thread::Builder::new()
            .name("tandem-round-watch".into())
            .spawn(move || {
                while !stop2.load(Ordering::Acquire) {
                    let r = check_round(&store, &round2, max_nodes).unwrap_or_else(|e| {
                        Some(Remote::HostLost(lost_message(is_host, on_etcd, &endpoint, &e)))
                    });
                    if let Some(r) = r {
                        *seen2.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                        return;
                    }
                    *last_ok2.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
                    std::thread::sleep(tick.min(POLL * 4));
                }
            })
            .map_err(|e| LaunchError::Rendezvous(format!("cannot start the round watcher: {e}")))?;
        Ok(RoundWatch { seen, last_ok, stop, thread: Some(thread) })
    }
}

/// One look at a round from the watcher: a failure reported, or a member's launcher gone. The
/// report first: a launcher that reports its workers' failure and exits is gone a moment later,
/// and its report names the root cause where its absence would not.
fn check_round(store: &Store, round: &Round, max_nodes: u32) -> Result<Option<Remote>, CommError> {
    let keys: Vec<&str> = round.members.iter().map(|m| m.alive_key.as_str()).collect();
    let gone = store.missing(&keys)?;
    let pre = format!("r{}", round.index);
    if store.add(&format!("{pre}/failed"), 0)? > 0 {
        // (The message follows the count: not there yet, or never from a reporter gone between.)
        if let Some(msg) = store.get_now(&format!("{pre}/failed/msg"))? {
            return Ok(Some(Remote::Failed(String::from_utf8_lossy(&msg).into_owned())));
        }
    }
    if let Some(key) = gone.first() {
        let node_rank = keys.iter().position(|k| k == key).unwrap_or(0);
        return Ok(Some(Remote::NodeLost {
            node_rank: node_rank as u32,
            hostname: round.members[node_rank].hostname.clone(),
        }));
    }
    if round.nnodes < max_nodes {
        // The next round's first joiner, when it is not one of this round's launchers (they
        // come there only after this round ended, which the checks above see first).
        let next = format!("r{}/member/1", round.index + 1);
        if let Some(record) = store.get_now(&next)? {
            let (_, _, key, hostname) = parse_member(&String::from_utf8_lossy(&record));
            if !keys.contains(&key.as_str()) && store.missing(&[key.as_str()])?.is_empty() {
                return Ok(Some(Remote::NodeWaiting { hostname }));
            }
        }
    }
    Ok(None)
}

/// The watcher of one round; stops its thread when dropped.
pub(crate) struct RoundWatch {
    seen: Arc<Mutex<Option<Remote>>>,
    /// When the store last answered the watcher.
    last_ok: Arc<Mutex<Instant>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RoundWatch {
    /// How long the store has not answered the watcher (zero while it answers every tick).
    pub fn silent_for(&self) -> Duration {
        self.last_ok.lock().unwrap_or_else(|p| p.into_inner()).elapsed()
    }

    /// How the round ended elsewhere, if it has (never blocks).
    pub fn seen(&self) -> Option<Remote> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for RoundWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // A watcher blocked on a cut link is left to finish on its own (bounded by OP_LIMIT).
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}
