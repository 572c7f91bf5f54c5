//! The launchers of a multi-node job agree on every attempt ("round"), as torchrun's c10d
//! rendezvous does: they meet in a store hosted by the node-rank-0 launcher at
//! `MASTER_ADDR:MASTER_PORT`, learn which nodes take part, their node ranks and the port of the
//! workers' own store (the host picks a free one each round). A worker failure on any node ends
//! the round on every node, and all of them start the next round together while restarts
//! remain. Each launcher holds an owned key (deleted by the store when its connection closes),
//! so a launcher that dies is seen by the others at once and named.
//!
//! With `--rdzv-backend etcd` the store is an etcd cluster instead (keys under
//! `tandem/<run id>/nodes/`), and no node is special: each round is closed by the launcher that
//! first claims `r<k>/closer`, whichever node it is, so an elastic job goes on when node 0 is
//! lost. A launcher's owned key then lives on an etcd lease: its death is seen within the
//! lease's 3 s.
//!
//! A launcher that comes while the running round has `--nnodes` MAX nodes is a spare: it waits
//! in the next round without a deadline, joined there by the others when one of them is lost,
//! and ends successfully, starting nothing, when the job finishes without it. A launcher that
//! joined a round and died before it closed is left out of it; on etcd a closer
//! that dies before closing is replaced by the first launcher to claim its place.
//!
//! Keys: `alive/<id>` (owned), `round` (the newest round opened), and per round `r<k>/count`
//! (join counter), `r<k>/member/<j>`, `r<k>/closer` (etcd), `r<k>/closed` (`ok N PORT J,J..`:
//! the joiners taken, by join order; `over K N`: the job finished in round K while spares
//! waited here), `r<k>/failed` +
//! `r<k>/failed/msg`, `r<k>/done`, `r<k>/left`.
use std::time::{Duration, Instant};
use tandem_comm::JobSecret;

use tandem_comm::{CommError, Store, StoreServer};

use crate::error::LaunchError;

mod watch;
pub(crate) use watch::{Remote, RoundWatch};

/// With `--nnodes MIN:MAX`, how long the count of joined nodes must stay unchanged (at MIN or
/// more) before the host closes the round without waiting for MAX.
const LAST_CALL: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(50);
/// How often a launcher waiting for a round on etcd checks that its closer is alive.
const CLOSER_CHECK: Duration = Duration::from_millis(250);
/// How long the host keeps the store up for the other launchers to read the job's end.
const EXIT_LINGER: Duration = Duration::from_secs(10);
/// Failure reports are best effort and must not hold up a launcher whose link is cut.
const REPORT_LIMIT: Duration = Duration::from_millis(500);
/// Store operations of the watcher thread and of the exit barrier.
const OP_LIMIT: Duration = Duration::from_secs(5);

/// Who takes part in one round, and what this node is in it.
#[derive(Clone, Debug)]
pub(crate) struct Round {
    pub index: u32,
    pub nnodes: u32,
    pub node_rank: u32,
    pub worker_port: u16,
    /// By node rank: the member's owned key and its hostname.
    members: Vec<Member>,
}

#[derive(Clone, Debug)]
struct Member {
    alive_key: String,
    hostname: String,
}

/// What joining a round gave.
pub(crate) enum Joined {
    Round(Round),
    /// The job finished while this launcher waited as a spare (the running round had
    /// `--nnodes` MAX nodes, none of them lost): nothing left to do.
    JobOver {
        round: u32,
        nnodes: u32,
    },
}

/// The round before the one a launcher waits in, as the waiting launcher sees it.
enum Previous {
    /// Training on `--nnodes` MAX nodes: the launcher waits as a spare, without a deadline.
    RunningFull,
    /// Every node of it passed the exit barrier: the job is over.
    Finished { nnodes: u32 },
    /// None, ended, or running below MAX (its nodes come to this round): the usual deadline.
    Other,
}

/// How the exit barrier after a local success ended.
pub(crate) enum Finish {
    AllDone,
    Remote(Remote),
}

/// Where the launchers meet.
pub(crate) enum Meeting<'a> {
    /// Node 0's launcher hosts the store at `--master-addr:--master-port`.
    Node0 { master_addr: &'a str, port: u16 },
    /// An etcd cluster holds it (`--rdzv-backend etcd --rdzv-endpoints ...`).
    Etcd(&'a [String]),
}

pub(crate) struct NodeAgent {
    store: Store,
    /// The etcd cluster's endpoints, when it holds the rendezvous.
    etcd: Option<Vec<String>>,
    _server: Option<StoreServer>,
    run_id: String,
    secret: Option<JobSecret>,
    is_host: bool,
    alive_key: String,
    hostname: String,
    endpoint: String,
    static_node_rank: u32,
    min_nodes: u32,
    max_nodes: u32,
    timeout: Duration,
}

fn lost_message(is_host: bool, on_etcd: bool, endpoint: &str, e: &CommError) -> String {
    if on_etcd {
        format!(
            "lost the rendezvous: the etcd cluster at {endpoint} does not answer (its quorum \
             lost, or the network to it cut): {e}"
        )
    } else if is_host {
        format!("the rendezvous store on this node failed: {e}")
    } else {
        format!(
            "lost the rendezvous host, node 0 at {endpoint} (its launcher died, or the network \
             to it is cut): {e}"
        )
    }
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown-host".into())
}

impl NodeAgent {
    /// Hosts the store (node rank 0) or connects to it (or to etcd), and announces this
    /// launcher.
    pub fn start(
        meeting: Meeting<'_>,
        run_id: &str,
        secret: Option<&JobSecret>,
        node_rank: u32,
        (min_nodes, max_nodes): (u32, u32),
        timeout: Duration,
    ) -> Result<NodeAgent, LaunchError> {
        let (endpoint, etcd, is_host, port) = match meeting {
            Meeting::Node0 { master_addr, port } => {
                (format!("{master_addr}:{port}"), None, node_rank == 0, port)
            }
            Meeting::Etcd(endpoints) => (endpoints.join(","), Some(endpoints.to_vec()), false, 0),
        };
        let server = if is_host {
            // Every interface: MASTER_ADDR is how the others reach this host, whichever it is.
            let server =
                StoreServer::bind(&format!("0.0.0.0:{port}"), run_id, secret).map_err(|e| {
                    LaunchError::Rendezvous(format!(
                        "node 0 cannot host the launchers' rendezvous on port {port} \
                     (--master-port): {e}"
                    ))
                })?;
            Some(server)
        } else {
            None
        };
        let store = connect(etcd.as_deref(), &endpoint, run_id, secret, timeout)
            .map_err(|e| LaunchError::Rendezvous(format!("node {node_rank}: {e}")))?;
        let hostname = hostname();
        let alive_key = format!("alive/{hostname}/{}", std::process::id());
        let agent = NodeAgent {
            store,
            etcd,
            _server: server,
            run_id: run_id.to_string(),
            secret: secret.cloned(),
            is_host,
            alive_key,
            hostname,
            endpoint,
            static_node_rank: node_rank,
            min_nodes,
            max_nodes,
            timeout,
        };
        agent
            .store
            .set_owned(&agent.alive_key, agent.hostname.as_bytes())
            .map_err(|e| agent.lost(e))?;
        if agent.is_host {
            agent.claim_host()?;
        }
        Ok(agent)
    }

    /// Node rank 0 hosts the rendezvous. A second launcher started with `--node-rank 0` on
    /// another machine also binds a store, but the one it reaches at `--master-addr` is not its
    /// own: it is refused, naming the launcher that hosts the rendezvous.
    fn claim_host(&self) -> Result<(), LaunchError> {
        let own = self._server.as_ref().map(|s| s.id().to_string()).unwrap_or_default();
        let reached = self.text(tandem_comm::SERVER_ID_KEY)?;
        if reached == own {
            return self.store.set("host", self.alive_key.as_bytes()).map_err(|e| self.lost(e));
        }
        // The real host records itself right after connecting; wait for that (bounded).
        let holder = self.wait_text("host", Duration::from_secs(10)).unwrap_or_default();
        let who = holder.strip_prefix("alive/").unwrap_or(&holder).replace('/', " pid ");
        Err(LaunchError::Rendezvous(format!(
            "--node-rank 0 is already taken: the rendezvous at {} is hosted by the launcher on \
             {who}; every other node needs its own --node-rank (with --nnodes MIN:MAX, any value \
             but 0)",
            self.endpoint
        )))
    }

    fn elastic(&self) -> bool {
        self.min_nodes != self.max_nodes
    }

    /// A store error: for a non-host it almost always means the host's launcher is gone.
    fn lost(&self, e: CommError) -> LaunchError {
        LaunchError::Rendezvous(lost_message(self.is_host, self.etcd.is_some(), &self.endpoint, &e))
    }

    fn int(&self, key: &str) -> Result<i64, LaunchError> {
        self.store.add(key, 0).map_err(|e| self.lost(e))
    }

    fn text(&self, key: &str) -> Result<String, LaunchError> {
        self.store
            .get(key)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .map_err(|e| self.lost(e))
    }

    /// Joins the first round numbered `at_least` or later that is still open, waits until it
    /// closes, and returns it. `pick_port` gives the host a free port for the workers' store.
    /// While the round before runs on `--nnodes` MAX nodes this launcher is a spare: it waits
    /// without a deadline, for a node to be lost (the others then come to this round) or the
    /// job to finish.
    pub fn join(
        &self,
        at_least: u32,
        nproc: u32,
        pick_port: impl Fn() -> std::io::Result<u16>,
    ) -> Result<Joined, LaunchError> {
        let opened = self.int("round")?.max(0) as u32;
        let mut index = at_least.max(opened);
        // A round already closed (running without this node, or aborted) is not joined: this
        // launcher waits in the next one, which the running nodes come to (`NodeWaiting`).
        while self.store.get_now(&format!("r{index}/closed")).map_err(|e| self.lost(e))?.is_some() {
            index += 1;
        }
        let pre = format!("r{index}");
        let j = self.store.add(&format!("{pre}/count"), 1).map_err(|e| self.lost(e))?;
        let rank_claim = match (self.elastic(), self.is_host) {
            (false, _) => self.static_node_rank.to_string(),
            (true, true) => "h".to_string(),
            (true, false) => "-".to_string(),
        };
        self.store
            .set(
                &format!("{pre}/member/{j}"),
                format!("{rank_claim} {nproc} {} {}", self.alive_key, self.hostname).as_bytes(),
            )
            .map_err(|e| self.lost(e))?;
        // On etcd the first launcher to claim the round closes it, whichever node it is.
        let closer_key = format!("{pre}/closer");
        let closer = match &self.etcd {
            None => self.is_host,
            Some(_) => self.claim_closer(&closer_key, b"")?,
        };
        if closer {
            if let Some(over) = self.close_round(index, &pick_port)? {
                return Ok(over);
            }
        }
        let closed = match self.wait_closed_or_take_over(index, &pick_port)? {
            Ok(closed) => closed,
            Err(over) => return Ok(over),
        };
        let mut words = closed.splitn(4, ' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("ok"), Some(n), Some(port), joined) => {
                let n: u32 = n.parse().unwrap_or(0);
                let worker_port: u16 = port.parse().unwrap_or(0);
                let joined: Vec<u32> = match joined {
                    Some(list) => list.split(',').filter_map(|j| j.parse().ok()).collect(),
                    None => (1..=n).collect(),
                };
                if !joined.contains(&(j as u32)) {
                    let reused = if self.etcd.is_some() {
                        " (or an earlier job on this etcd cluster used the same --run-id: each \
                         job needs its own)"
                    } else {
                        ""
                    };
                    return Err(LaunchError::Rendezvous(format!(
                        "round {index} closed with {n} node(s) before this node joined; the \
                         job has its nodes (--nnodes max is {}){reused}",
                        self.max_nodes
                    )));
                }
                self.assemble(index, &joined, worker_port, j as u32).map(Joined::Round)
            }
            (Some("over"), Some(round), Some(nnodes), _) => Ok(Joined::JobOver {
                round: round.parse().unwrap_or(0),
                nnodes: nnodes.parse().unwrap_or(0),
            }),
            _ => Err(LaunchError::Rendezvous(
                closed.strip_prefix("abort ").unwrap_or(&closed).to_string(),
            )),
        }
    }

    /// Claims closing a round on etcd: sets `key` to this launcher's alive key if it holds
    /// `holder` (empty: nobody). Whether this launcher now closes the round.
    fn claim_closer(&self, key: &str, holder: &[u8]) -> Result<bool, LaunchError> {
        let me = self.alive_key.as_bytes();
        Ok(self.store.compare_set(key, holder, me).map_err(|e| self.lost(e))? == me)
    }

    /// Waits for round `index` to close. On etcd a closer that dies before closing it (its
    /// alive key gone with its lease) is replaced: the first launcher to claim its place
    /// closes the round, without it. `Err(JobOver)`: the job finished while this launcher
    /// waited as a spare.
    fn wait_closed_or_take_over(
        &self,
        index: u32,
        pick_port: &impl Fn() -> std::io::Result<u16>,
    ) -> Result<Result<String, Joined>, LaunchError> {
        let pre = format!("r{index}");
        let (closed_key, closer_key) = (format!("{pre}/closed"), format!("{pre}/closer"));
        let wait = self.timeout + LAST_CALL * 2;
        // Each takeover, and each look finding this launcher a spare, starts the wait again.
        let mut deadline = Instant::now() + wait;
        let mut last_look = Instant::now();
        loop {
            if let Some(v) = self.store.get_now(&closed_key).map_err(|e| self.lost(e))? {
                return Ok(Ok(String::from_utf8_lossy(&v).into_owned()));
            }
            if last_look.elapsed() >= CLOSER_CHECK {
                last_look = Instant::now();
                match self.previous(index)? {
                    Previous::RunningFull => deadline = Instant::now() + wait,
                    Previous::Finished { nnodes } => {
                        return Ok(Err(Joined::JobOver { round: index - 1, nnodes }))
                    }
                    Previous::Other => {}
                }
                if self.etcd.is_some() && self.closer_gone(&closer_key)? {
                    self.close_round(index, pick_port)?;
                    deadline = Instant::now() + wait;
                    continue;
                }
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::Rendezvous(format!(
                    "round {index} was not closed within {wait:?} (the launcher closing it: {})",
                    self.store
                        .get_now(&closer_key)
                        .ok()
                        .flatten()
                        .map(|v| String::from_utf8_lossy(&v).into_owned())
                        .unwrap_or_else(|| "node 0's".into())
                )));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether round `index`'s closer is gone and this launcher has claimed its place.
    fn closer_gone(&self, closer_key: &str) -> Result<bool, LaunchError> {
        let holder = self.store.get_now(closer_key).map_err(|e| self.lost(e))?;
        let holder = String::from_utf8_lossy(&holder.unwrap_or_default()).into_owned();
        if holder.is_empty()
            || self.store.missing(&[holder.as_str()]).map_err(|e| self.lost(e))?.is_empty()
        {
            return Ok(false);
        }
        let claimed = self.claim_closer(closer_key, holder.as_bytes())?;
        if claimed {
            let who = holder.strip_prefix("alive/").unwrap_or(&holder).replace('/', " pid ");
            tracing::warn!(closer = %who, "the launcher closing the round is gone; closing it here");
        }
        Ok(claimed)
    }

    /// The round before `index`, as a launcher waiting in `index` sees it.
    fn previous(&self, index: u32) -> Result<Previous, LaunchError> {
        let Some(k) = index.checked_sub(1) else { return Ok(Previous::Other) };
        let closed = self.store.get_now(&format!("r{k}/closed")).map_err(|e| self.lost(e))?;
        let closed = String::from_utf8_lossy(&closed.unwrap_or_default()).into_owned();
        let mut words = closed.split(' ');
        let (Some("ok"), Some(n), Some(_port), Some(joined)) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            return Ok(Previous::Other);
        };
        let n: u32 = n.parse().unwrap_or(0);
        let count = |key: &str| -> Result<i64, LaunchError> {
            self.store.add(&format!("r{k}/{key}"), 0).map_err(|e| self.lost(e))
        };
        if n > 0 && count("done")? >= n as i64 {
            return Ok(Previous::Finished { nnodes: n });
        }
        if n < self.max_nodes || count("failed")? > 0 {
            return Ok(Previous::Other);
        }
        // Full, and no failure reported: running, unless one of its launchers is gone.
        let mut keys = Vec::new();
        for j in joined.split(',').filter_map(|j| j.parse::<u32>().ok()) {
            keys.push(self.member(&format!("r{k}"), j)?.2);
        }
        let names: Vec<&str> = keys.iter().map(String::as_str).collect();
        let gone = self.store.missing(&names).map_err(|e| self.lost(e))?;
        Ok(if gone.is_empty() { Previous::RunningFull } else { Previous::Other })
    }

    /// Of the `count` launchers that joined round `pre`, those whose launcher is still alive
    /// (its owned key there), in the order they joined. One that has not written its record
    /// yet is not counted.
    fn live_members(&self, pre: &str, count: u32) -> Result<Vec<u32>, LaunchError> {
        let mut keys = Vec::with_capacity(count as usize);
        for j in 1..=count {
            let record =
                self.store.get_now(&format!("{pre}/member/{j}")).map_err(|e| self.lost(e))?;
            let Some(record) = record else { continue };
            keys.push((j, parse_member(&String::from_utf8_lossy(&record)).2));
        }
        let names: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
        let gone = self.store.missing(&names).map_err(|e| self.lost(e))?;
        Ok(keys.into_iter().filter(|(_, k)| !gone.contains(k)).map(|(j, _)| j).collect())
    }

    /// `get` with its own deadline, keeping the store's timeout for everything else.
    fn wait_text(&self, key: &str, limit: Duration) -> Result<String, LaunchError> {
        let before = self.store.timeout();
        self.store.set_timeout(limit);
        let r = self.text(key);
        self.store.set_timeout(before);
        r
    }

    /// The closer's side of a round: wait for the nodes (a launcher that joined and died
    /// before the round closed is left out), check they agree, pick the port, close.
    fn close_round(
        &self,
        index: u32,
        pick_port: &impl Fn() -> std::io::Result<u16>,
    ) -> Result<Option<Joined>, LaunchError> {
        let pre = format!("r{index}");
        let mut start = Instant::now();
        let mut last_look = Instant::now();
        let (mut last_count, mut changed_at) = (0, Instant::now());
        let need = if self.elastic() { self.min_nodes } else { self.max_nodes };
        let joined = loop {
            let count = self.int(&format!("{pre}/count"))?;
            if count != last_count {
                (last_count, changed_at) = (count, Instant::now());
            }
            if count >= need as i64 {
                let mut live = self.live_members(&pre, count as u32)?;
                live.truncate(self.max_nodes as usize);
                let full = live.len() as u32 >= self.max_nodes;
                let last_call = self.elastic()
                    && live.len() as u32 >= self.min_nodes
                    && changed_at.elapsed() >= LAST_CALL;
                if full || last_call {
                    break live;
                }
            }
            if last_look.elapsed() >= CLOSER_CHECK {
                last_look = Instant::now();
                match self.previous(index)? {
                    // A spare: no deadline while the nodes it would replace all train.
                    Previous::RunningFull => start = Instant::now(),
                    Previous::Finished { nnodes } => {
                        // (Any other spare waiting in this round reads the same.)
                        let over = format!("over {} {nnodes}", index - 1);
                        let _ = self.store.set(&format!("{pre}/closed"), over.as_bytes());
                        return Ok(Some(Joined::JobOver { round: index - 1, nnodes }));
                    }
                    Previous::Other => {}
                }
            }
            if start.elapsed() >= self.timeout {
                let joined = self.member_names(&pre, count as u32);
                let msg = format!(
                    "round {index}: only {count} of {need} node(s) joined within {:?} \
                     (--rdzv-timeout); joined: {joined}",
                    self.timeout
                );
                let _ = self.store.set(&format!("{pre}/closed"), format!("abort {msg}").as_bytes());
                return Err(LaunchError::Rendezvous(msg));
            }
            std::thread::sleep(POLL);
        };
        if let Err(msg) = self.check_members(&pre, &joined) {
            let _ = self.store.set(&format!("{pre}/closed"), format!("abort {msg}").as_bytes());
            return Err(LaunchError::Rendezvous(msg));
        }
        let port = pick_port().map_err(|e| {
            LaunchError::Rendezvous(format!("no free port for the workers' store: {e}"))
        })?;
        let cur = self.int("round")?;
        self.store.add("round", index as i64 - cur).map_err(|e| self.lost(e))?;
        let list: Vec<String> = joined.iter().map(u32::to_string).collect();
        let closed = format!("ok {} {port} {}", joined.len(), list.join(","));
        self.store.set(&format!("{pre}/closed"), closed.as_bytes()).map_err(|e| self.lost(e))?;
        Ok(None)
    }

    fn member(&self, pre: &str, j: u32) -> Result<(String, u32, String, String), LaunchError> {
        Ok(parse_member(&self.text(&format!("{pre}/member/{j}"))?))
    }

    fn member_names(&self, pre: &str, count: u32) -> String {
        let names: Vec<String> = (1..=count)
            .filter_map(|j| self.member(pre, j).ok())
            .map(|(claim, _, _, host)| format!("{host} (node rank {claim})"))
            .collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(", ")
        }
    }

    /// Same worker count everywhere; with fixed node ranks, each rank exactly once.
    fn check_members(&self, pre: &str, joined: &[u32]) -> Result<(), String> {
        let n = joined.len();
        let members: Vec<_> = joined
            .iter()
            .map(|&j| self.member(pre, j))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let (_, nproc0, _, host0) = &members[0];
        for (claim, nproc, _, host) in &members {
            if nproc != nproc0 {
                return Err(format!(
                    "--nproc-per-node differs between nodes: {host} runs {nproc} worker(s), \
                     {host0} runs {nproc0}; every node must run the same number"
                ));
            }
            if !self.elastic() {
                let twice = members.iter().filter(|m| &m.0 == claim).count();
                if twice > 1 {
                    return Err(format!(
                        "--node-rank {claim} was given to {twice} launchers (one is on {host}); \
                         each node needs its own rank in 0..{n}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every participant reads the members and derives the node ranks: the given ones for a
    /// fixed size; for `MIN:MAX`, the host first and the others in the order they joined.
    fn assemble(
        &self,
        index: u32,
        joined: &[u32],
        worker_port: u16,
        me: u32,
    ) -> Result<Round, LaunchError> {
        let pre = format!("r{index}");
        let n = joined.len() as u32;
        let mut ranked = Vec::with_capacity(joined.len());
        for &j in joined {
            let (claim, _, alive_key, hostname) = self.member(&pre, j)?;
            let rank = if self.elastic() { None } else { claim.parse::<u32>().ok() };
            ranked.push((rank, j, Member { alive_key, hostname }));
        }
        if self.elastic() {
            // The host first, then the others in the order they joined.
            let host_key = self.host_alive_key(&pre, joined);
            ranked.sort_by_key(|(_, j, m)| (m.alive_key != host_key, *j));
            for (i, r) in ranked.iter_mut().enumerate() {
                r.0 = Some(i as u32);
            }
        }
        ranked.sort_by_key(|r| r.0);
        let node_rank = ranked
            .iter()
            .position(|(_, j, _)| *j == me)
            .map(|p| ranked[p].0.unwrap_or(p as u32))
            .unwrap_or(0);
        Ok(Round {
            index,
            nnodes: n,
            node_rank,
            worker_port,
            members: ranked.into_iter().map(|(_, _, m)| m).collect(),
        })
    }

    fn host_alive_key(&self, pre: &str, joined: &[u32]) -> String {
        if self.etcd.is_some() {
            return self.text(&format!("{pre}/closer")).unwrap_or_default();
        }
        joined
            .iter()
            .filter_map(|&j| self.member(pre, j).ok())
            .find(|m| m.0 == "h")
            .map(|m| m.2)
            .unwrap_or_default()
    }

    /// Tells the other nodes that this round failed here (the first report wins). Best effort,
    /// bounded: a launcher cut off from the host must still end in time.
    pub fn report_failure(&self, round: &Round, message: &str) -> Result<(), CommError> {
        let pre = format!("r{}", round.index);
        self.store.add_within(&format!("{pre}/failed"), 1, REPORT_LIMIT).and_then(|n| {
            if n == 1 {
                self.store.set_within(
                    &format!("{pre}/failed/msg"),
                    message.as_bytes(),
                    REPORT_LIMIT,
                )
            } else {
                Ok(())
            }
        })
    }

    /// The exit barrier after this node's workers all succeeded: wait (up to `limit`) for every
    /// node to finish, or for the round to end elsewhere.
    pub fn finish(
        &self,
        round: &Round,
        watch: &RoundWatch,
        limit: Duration,
    ) -> Result<Finish, LaunchError> {
        let pre = format!("r{}", round.index);
        let done_key = format!("{pre}/done");
        self.store.add_within(&done_key, 1, OP_LIMIT).map_err(|e| self.lost(e))?;
        let start = Instant::now();
        loop {
            if self.store.add_within(&done_key, 0, OP_LIMIT).map_err(|e| self.lost(e))?
                >= round.nnodes as i64
            {
                break;
            }
            // (A node waiting to join is admitted only into a round still training.)
            if let Some(remote) = watch.seen().filter(|r| !matches!(r, Remote::NodeWaiting { .. }))
            {
                return Ok(Finish::Remote(remote));
            }
            if start.elapsed() >= limit {
                return Err(LaunchError::Rendezvous(format!(
                    "this node's workers finished, but the other nodes did not within {limit:?}"
                )));
            }
            std::thread::sleep(POLL);
        }
        let left_key = format!("{pre}/left");
        self.store.add_within(&left_key, 1, OP_LIMIT).map_err(|e| self.lost(e))?;
        if self.is_host {
            // Keep the store up until every launcher has read that the job is done.
            let start = Instant::now();
            while start.elapsed() < EXIT_LINGER
                && self.store.add_within(&left_key, 0, OP_LIMIT).map_err(|e| self.lost(e))?
                    < round.nnodes as i64
            {
                std::thread::sleep(POLL);
            }
        }
        Ok(Finish::AllDone)
    }

    pub fn hostname(&self) -> &str {
        &self.hostname
    }
}

/// A member record, `CLAIM NPROC ALIVE_KEY HOSTNAME`: (node-rank claim, worker count, the
/// launcher's alive key, its hostname).
fn parse_member(record: &str) -> (String, u32, String, String) {
    let mut w = record.splitn(4, ' ');
    let (claim, nproc, key, host) = (w.next(), w.next(), w.next(), w.next());
    (
        claim.unwrap_or("-").to_string(),
        nproc.and_then(|n| n.parse().ok()).unwrap_or(0),
        key.unwrap_or_default().to_string(),
        host.unwrap_or_default().to_string(),
    )
}

/// A client of the launchers' rendezvous: node 0's store at `endpoint`, or the etcd cluster.
fn connect(
    etcd: Option<&[String]>,
    endpoint: &str,
    run_id: &str,
    secret: Option<&JobSecret>,
    timeout: Duration,
) -> Result<Store, CommError> {
    match etcd {
        None => Store::connect(endpoint, run_id, secret, timeout, "--master-addr/--master-port"),
        Some(endpoints) => Store::connect_etcd(endpoints, secret, timeout, "--rdzv-endpoints")
            .map(|store| store.with_prefix(&format!("tandem/{run_id}/nodes"))),
    }
}
