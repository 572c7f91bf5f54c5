//! `ProcessGroup`: the user-facing handle (PyTorch's `ProcessGroup`). Owns call ordering (calls
//! run in the order they were issued on this rank, async ones included), sequence numbers,
//! the optional desync check, and turning transport failures into errors that name the
//! operation, its sequence number and the peer rank. After a failure the group is broken:
//! later calls fail at once instead of running on desynchronised streams.
use crate::collectives::{Ctx, ReduceFn, Reduction, ScatterInput};
use crate::element::{reduce_bytes, Element, ReduceOp};
use crate::env::InitOptions;
use crate::error::CommError;
use crate::order::{CallOrder, Ticket};
use crate::store::{Store, StoreServer};
use crate::transport::{FailKind, PeerError, Recv, Transport, TransportKind};

mod all_to_all;
mod async_ops;
pub(crate) mod build;
mod bytes;
mod desync;
pub(crate) mod hierarchy;
mod monitored;
mod objects;
mod p2p;
mod reduce;
mod self_check;
mod subgroups;

use crate::work::Work;
use bytes::alloc_announced;
use desync::{desync_check, op_code, Call};
pub use p2p::{P2PKind, P2POp};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A group of ranks that run collectives together. Cheap to clone; usable from any thread.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup(rank {}/{}, {})", self.inner.rank, self.inner.size, self.inner.name)
    }
}

pub(crate) struct Inner {
    pub rank: usize,
    pub size: usize,
    pub local_rank: usize,
    pub local_size: usize,
    /// Group rank -> world rank (for messages).
    pub world_ranks: Vec<usize>,
    /// Group id, also the store key prefix.
    pub name: String,
    pub store: Option<Store>,
    pub opts: InitOptions,
    pub kind: Option<TransportKind>,
    pub local_ip: IpAddr,
    pub timeout_ms: AtomicU64,
    pub subgroups: AtomicU64,
    /// The groups `new_group` made from this one: aborting this group aborts them too.
    pub children: Mutex<Vec<std::sync::Weak<Inner>>>,
    /// Host index (by first appearance) of every group rank.
    pub hosts: Vec<usize>,
    /// Sub-groups for the hierarchical all-reduce, once set up (multi-host groups only).
    pub hierarchy: std::sync::OnceLock<hierarchy::Hierarchy>,
    /// Issue order of this rank's calls; `state` is locked only by the call whose turn it is.
    pub order: Arc<CallOrder>,
    pub state: Mutex<State>,
    pub _server: Option<Arc<StoreServer>>,
    /// The group's NCCL communicator, made by the first `nccl()` call.
    #[cfg(feature = "nccl")]
    pub nccl: Mutex<Option<crate::nccl::NcclComm>>,
}

pub(crate) struct State {
    pub seq: u64,
    pub transport: Box<dyn Transport>,
    pub p2p_sent: Vec<u64>,
    pub p2p_recvd: Vec<u64>,
}

/// The transport of a world of one: nothing to talk to.
pub(crate) struct NoPeers;

impl Transport for NoPeers {
    fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, Recv<'_>)>,
        _t: Duration,
    ) -> Result<(), PeerError> {
        let peer = send.map(|s| s.0).or(recv.map(|r| r.0)).unwrap_or(0);
        Err(PeerError { peer, kind: FailKind::Io("a group of one rank has no peers".into()) })
    }
    fn abort(&mut self) {}
}

/// Bitwise reductions take integers only (PyTorch's gloo refuses floats too).
pub(crate) fn check_op<T: Element>(what: &'static str, op: ReduceOp) -> Result<(), CommError> {
    if op.is_bitwise() && !T::INTEGER {
        return Err(CommError::invalid(
            what,
            format!("{} of {} elements: bitwise reductions take integers", op.name(), T::DTYPE),
        ));
    }
    Ok(())
}

fn check_root(op: &'static str, root: usize, size: usize) -> Result<(), CommError> {
    if root >= size {
        return Err(CommError::invalid(
            op,
            format!("root {root} is out of range for a group of {size} ranks"),
        ));
    }
    Ok(())
}

fn divide<T: Element>(buf: &mut [T], n: usize) {
    buf.iter_mut().for_each(|x| *x = x.div_count(n));
}

impl ProcessGroup {
    pub(crate) fn from_inner(inner: Inner) -> ProcessGroup {
        ProcessGroup { inner: Arc::new(inner) }
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }
    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.size
    }
    /// Rank among the group's ranks on this host.
    pub fn local_rank(&self) -> usize {
        self.inner.local_rank
    }
    /// Number of the group's ranks on this host.
    pub fn local_size(&self) -> usize {
        self.inner.local_size
    }
    /// The world rank of each group rank.
    pub fn world_ranks(&self) -> &[usize] {
        &self.inner.world_ranks
    }
    /// The transport in use (`None` for a group of one).
    pub fn transport(&self) -> Option<TransportKind> {
        self.inner.kind
    }
    /// The rendezvous store (None in a world of one).
    pub fn store(&self) -> Option<&Store> {
        self.inner.store.as_ref()
    }
    /// The group's NCCL communicator on CUDA device `device` (PyTorch's NCCL backend), made on
    /// the first call — a collective call: every rank of the group must make it. Later calls
    /// return the same communicator; asking for another device is an error.
    #[cfg(feature = "nccl")]
    pub fn nccl(&self, device: i32) -> Result<crate::nccl::NcclComm, CommError> {
        let mut slot = self.inner.nccl.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref() {
            if c.device() != device {
                return Err(CommError::invalid(
                    "nccl",
                    format!(
                        "this group's communicator is on cuda:{}, not cuda:{device} (one device per rank)",
                        c.device()
                    ),
                ));
            }
            return Ok(c.clone());
        }
        let comm = crate::nccl::NcclComm::new(
            crate::nccl::Rendezvous {
                store: self.inner.store.as_ref(),
                prefix: self.inner.name.clone(),
                rank: self.inner.rank,
                size: self.inner.size,
                timeout: self.timeout(),
            },
            device,
        )?;
        *slot = Some(comm.clone());
        Ok(comm)
    }

    /// The communicator made by an earlier [`ProcessGroup::nccl`] call, if any: once a group
    /// has one, Ddp reduces CUDA gradients with it (otherwise through host memory).
    #[cfg(feature = "nccl")]
    pub fn nccl_comm(&self) -> Option<crate::nccl::NcclComm> {
        self.inner.nccl.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The group's first failure, once a collective failed (the group is then broken: every
    /// later call fails). Callers whose errors lost their type on the way (a layer that keeps
    /// only text) ask here whether a collective broke.
    pub fn failure(&self) -> Option<String> {
        self.inner.order.broken()
    }

    /// Collectives fail when a peer makes no progress for `t` (default 10 s, TANDEM_TIMEOUT).
    pub fn set_timeout(&self, t: Duration) {
        self.inner.timeout_ms.store(t.as_millis().max(1) as u64, Ordering::Relaxed);
    }
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.inner.timeout_ms.load(Ordering::Relaxed))
    }

    /// This call's place in the issue order. Every public call validates its arguments first
    /// and only then takes a ticket (a dropped ticket gives its place up in any case).
    fn ticket(&self) -> Ticket {
        self.inner.order.ticket()
    }

    /// Runs `body` when `ticket`'s turn comes (bounded by the group timeout), with the call's
    /// sequence number from `seq_of`; refuses to run on a broken group; on failure records it,
    /// breaks the group and aborts the transport so the other ranks fail too. Every collective
    /// and p2p call, sync or async, goes through here.
    fn ordered<R>(
        &self,
        ticket: Ticket,
        op: &'static str,
        seq_of: impl FnOnce(&mut State) -> u64,
        body: impl FnOnce(&mut State, u64) -> Result<R, PeerError>,
    ) -> Result<R, CommError> {
        let turn = ticket.wait(op, self.timeout())?;
        let mut guard = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        let seq = seq_of(st);
        if let Some(first) = self.inner.order.broken() {
            return Err(CommError::Broken { op, seq, first });
        }
        let result = body(st, seq).map_err(|e| {
            let err = self.record_failure(self.peer_error(op, seq, e));
            self.inner.order.set_broken(err.to_string());
            st.transport.abort();
            err
        });
        drop(guard);
        drop(turn);
        result
    }

    /// Starts `f` with its ticket on a background thread. The ticket is taken here, in issue
    /// order; a thread that cannot start drops `f` and with it the ticket, giving the place up.
    fn spawn_ordered<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&ProcessGroup, Ticket) -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let (pg, ticket) = (self.clone(), self.ticket());
        Work::spawn(op, move || f(&pg, ticket))
    }

    fn peer_error(&self, op: &'static str, seq: u64, e: PeerError) -> CommError {
        let peer = self.inner.world_ranks.get(e.peer).copied().unwrap_or(e.peer);
        let wr = |r: usize| self.inner.world_ranks.get(r).copied().unwrap_or(r);
        match e.kind {
            FailKind::Closed => CommError::Peer {
                op,
                seq,
                peer,
                reason: "closed its connection (process exited, crashed, or aborted this collective after its own failure)".into(),
            },
            FailKind::Timeout(after) => CommError::Timeout { op, seq, peer, after },
            FailKind::Io(reason) => CommError::Peer { op, seq, peer, reason },
            FailKind::Desync { rank_a, call_a, rank_b, call_b } => {
                CommError::Desync { op, seq, rank_a: wr(rank_a), call_a, rank_b: wr(rank_b), call_b }
            }
        }
    }

    /// Records the group's first failure in the store (before this rank aborts its transport,
    /// which is what makes the other ranks fail). A rank that only saw a neighbour abort gets
    /// the original failure appended, so every rank's error leads to the rank that died.
    fn record_failure(&self, err: CommError) -> CommError {
        let Some(store) = &self.inner.store else {
            return err;
        };
        let key = format!("{}/first_failure", self.inner.name);
        let me = self.inner.world_ranks.get(self.inner.rank).copied().unwrap_or(self.inner.rank);
        let mine = format!("rank {me}: {err}");
        // Bounded tightly: with the link to the store cut, this must not delay the rank's exit.
        let recorded =
            store.compare_set_within(&key, b"", mine.as_bytes(), Duration::from_millis(300));
        self.linger_for_readers(store);
        let first = match recorded {
            Ok(first) if first != mine.as_bytes() => String::from_utf8_lossy(&first).to_string(),
            _ => return err,
        };
        match err {
            CommError::Peer { op, seq, peer, reason } => CommError::Peer {
                op,
                seq,
                peer,
                reason: format!("{reason}; first failure in this group: {first}"),
            },
            other => other,
        }
    }

    /// Counts this rank as having read the first failure. The store lives in the hosting rank's
    /// process, so that rank waits (at most 1 s, on the failure path only) until every other
    /// survivor has read it: otherwise it could exit before a rank that only saw a neighbour
    /// abort asks for the root cause, and that rank's error would name the neighbour instead.
    fn linger_for_readers(&self, store: &Store) {
        let key = format!("{}/first_failure_readers", self.inner.name);
        if store.add(&key, 1).is_err() || self.inner._server.is_none() {
            return;
        }
        // Everyone but at least one failed rank.
        let survivors = self.inner.size.saturating_sub(1) as i64;
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while std::time::Instant::now() < deadline {
            match store.add(&key, 0) {
                Ok(n) if n < survivors => std::thread::sleep(Duration::from_millis(2)),
                _ => return,
            }
        }
    }

    /// Runs a group-wide collective in issue order with sequence numbering, the optional
    /// desync check, and failure bookkeeping.
    fn collective<R>(
        &self,
        ticket: Ticket,
        call: Call,
        f: impl FnOnce(&mut Ctx<'_>) -> Result<R, PeerError>,
    ) -> Result<R, CommError> {
        let next_seq = |st: &mut State| {
            st.seq += 1;
            st.seq - 1
        };
        let timeout = self.timeout();
        let (rank, size) = (self.inner.rank, self.inner.size);
        let desync_check_on = self.inner.opts.desync_check && size > 1;
        self.ordered(ticket, call.op, next_seq, |st, seq| {
            let mut ctx = Ctx { t: st.transport.as_mut(), rank, size, timeout };
            if desync_check_on {
                desync_check(&mut ctx, &call.encode(seq))?;
            }
            f(&mut ctx)
        })
    }

    /// Reduces `buf` across ranks in place; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_ticket(self.ticket(), buf, op)
    }

    fn all_reduce_ticket<T: Element>(
        &self,
        ticket: Ticket,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        check_op::<T>("all_reduce", op)?;
        if let Some(h) = self.inner.hierarchy.get() {
            if std::mem::size_of_val(buf) >= hierarchy::MIN_BYTES {
                let turn = ticket.wait("all_reduce", self.timeout())?;
                if let Some(first) = self.inner.order.broken() {
                    return Err(CommError::Broken { op: "all_reduce", seq: 0, first });
                }
                let r = h.all_reduce(buf, op, self.size());
                if let Err(e) = &r {
                    self.inner.order.set_broken(e.to_string());
                }
                drop(turn);
                return r;
            }
        }
        let call = Call::new("all_reduce", Some(T::DTYPE), buf.len(), op_code(op));
        let f = move |d: &mut [u8], s: &[u8]| reduce_bytes::<T>(op, d, s);
        let f: ReduceFn<'_> = &f;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let r = Reduction { dtype: T::DTYPE, op, f };
        self.collective(ticket, call, |c| c.all_reduce(bytes, r))?;
        if op == ReduceOp::Avg {
            divide(buf, self.size());
        }
        Ok(())
    }

    /// Starts an all_reduce in the background; it runs after every call issued before it.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.spawn_ordered("all_reduce", move |pg, ticket| {
            pg.all_reduce_ticket(ticket, &mut buf, op)?;
            Ok(buf)
        })
    }

    /// Copies `root`'s `buf` to every rank (all ranks pass the same length).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        check_root("broadcast", root, self.size())?;
        self.broadcast_ticket(self.ticket(), buf, root)
    }

    fn broadcast_ticket<T: Element>(
        &self,
        ticket: Ticket,
        buf: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        let call = Call::new("broadcast", Some(T::DTYPE), buf.len(), root as u64);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        self.collective(ticket, call, |c| c.broadcast(bytes, root))
    }

    /// Starts a broadcast in the background. A bad `root` fails the returned `Work` without
    /// taking a place in the call order.
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        if let Err(e) = check_root("broadcast", root, self.size()) {
            return Work::failed("broadcast", e);
        }
        self.spawn_ordered("broadcast", move |pg, ticket| {
            pg.broadcast_ticket(ticket, &mut buf, root)?;
            Ok(buf)
        })
    }

    /// `output` (size × input.len(), rank-major) receives every rank's `input`.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<(), CommError> {
        self.all_gather_ticket(self.ticket(), input, output)
    }

    fn all_gather_ticket<T: Element>(
        &self,
        ticket: Ticket,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let (n, m) = (self.size(), input.len());
        if output.len() != n * m {
            return Err(CommError::invalid(
                "all_gather",
                format!(
                    "output has {} elements, expected size {n} × input {m} = {}",
                    output.len(),
                    n * m
                ),
            ));
        }
        output[self.rank() * m..(self.rank() + 1) * m].copy_from_slice(input);
        let es = std::mem::size_of::<T>();
        let bounds: Vec<_> = (0..n).map(|r| r * m * es..(r + 1) * m * es).collect();
        let call = Call::new("all_gather", Some(T::DTYPE), m, 0);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(output);
        self.collective(ticket, call, |c| c.all_gather_blocks(bytes, &bounds))
    }

    /// `input` is size blocks of `output.len()`; this rank gets the reduction of block `rank`.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_ticket(
            self.ticket(),
            ScatterInput::Shared(bytemuck::cast_slice(input)),
            output,
            op,
        )
    }

    /// `input`: the elements' bytes, the caller's or handed over to be reduced into.
    pub(crate) fn reduce_scatter_ticket<T: Element>(
        &self,
        ticket: Ticket,
        input: ScatterInput<'_>,
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        check_op::<T>("reduce_scatter", op)?;
        let len = input.bytes().len() / std::mem::size_of::<T>();
        let (n, m) = (self.size(), output.len());
        if len != n * m {
            return Err(CommError::invalid(
                "reduce_scatter",
                format!("input has {len} elements, expected size {n} × output {m} = {}", n * m),
            ));
        }
        let call = Call::new("reduce_scatter", Some(T::DTYPE), m, op_code(op));
        let f = move |d: &mut [u8], s: &[u8]| reduce_bytes::<T>(op, d, s);
        let f: ReduceFn<'_> = &f;
        let outb: &mut [u8] = bytemuck::cast_slice_mut(output);
        let r = Reduction { dtype: T::DTYPE, op, f };
        self.collective(ticket, call, |c| c.reduce_scatter(input, outb, r))?;
        if op == ReduceOp::Avg {
            divide(output, n);
        }
        Ok(())
    }

    /// Root's `output` (size × input.len(), rank-major) receives every rank's `input`;
    /// other ranks pass `None`.
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<(), CommError> {
        self.gather_ticket(self.ticket(), input, output, root)
    }

    fn gather_ticket<T: Element>(
        &self,
        ticket: Ticket,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<(), CommError> {
        check_root("gather", root, self.size())?;
        let (n, m) = (self.size(), input.len());
        if self.rank() == root {
            match &output {
                Some(o) if o.len() == n * m => {}
                Some(o) => {
                    return Err(CommError::invalid(
                        "gather",
                        format!("root output has {} elements, expected {}", o.len(), n * m),
                    ))
                }
                None => {
                    return Err(CommError::invalid("gather", "the root must pass an output buffer"))
                }
            }
        }
        let call = Call::new("gather", Some(T::DTYPE), m, root as u64);
        let inb: &[u8] = bytemuck::cast_slice(input);
        let outb: Option<&mut [u8]> = output.map(|o| bytemuck::cast_slice_mut(o));
        self.collective(ticket, call, |c| c.gather(inb, outb, root))
    }

    /// Rank r's `output` receives block r of root's `input` (size × output.len());
    /// other ranks pass `None` as input.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        self.scatter_ticket(self.ticket(), input, output, root)
    }

    fn scatter_ticket<T: Element>(
        &self,
        ticket: Ticket,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        check_root("scatter", root, self.size())?;
        let (n, m) = (self.size(), output.len());
        if self.rank() == root {
            match input {
                Some(i) if i.len() == n * m => {}
                Some(i) => {
                    return Err(CommError::invalid(
                        "scatter",
                        format!("root input has {} elements, expected {}", i.len(), n * m),
                    ))
                }
                None => {
                    return Err(CommError::invalid("scatter", "the root must pass an input buffer"))
                }
            }
        }
        let call = Call::new("scatter", Some(T::DTYPE), m, root as u64);
        let inb: Option<&[u8]> = input.map(|i| bytemuck::cast_slice(i));
        let outb: &mut [u8] = bytemuck::cast_slice_mut(output);
        self.collective(ticket, call, |c| c.scatter(inb, outb, root))
    }

    /// Breaks the group on purpose: this rank's later calls fail at once, and peers inside a
    /// collective with it fail at once too (its transport is aborted) — how a live regroup
    /// makes every member leave an old generation. A call in progress on another thread of
    /// this rank fails by itself when its peers abort.
    pub fn abort(&self, reason: &str) {
        let children =
            std::mem::take(&mut *self.inner.children.lock().unwrap_or_else(|p| p.into_inner()));
        for child in children.iter().filter_map(std::sync::Weak::upgrade) {
            ProcessGroup { inner: child }.abort(reason);
        }
        self.inner.order.set_broken(reason.to_string());
        for _ in 0..50 {
            if let Ok(mut st) = self.inner.state.try_lock() {
                st.transport.abort();
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Returns once every rank of the group has called it.
    pub fn barrier(&self) -> Result<(), CommError> {
        self.barrier_ticket(self.ticket())
    }

    fn barrier_ticket(&self, ticket: Ticket) -> Result<(), CommError> {
        self.collective(ticket, Call::new("barrier", None, 0, 0), |c| c.barrier())
    }

    /// Host index of every rank (by first appearance), as the rendezvous found them.
    pub(crate) fn host_indices(&self) -> &[usize] {
        &self.inner.hosts
    }

    pub(crate) fn set_hierarchy(&self, h: hierarchy::Hierarchy) {
        let _ = self.inner.hierarchy.set(h);
    }

    /// Whether large all-reduces go hierarchically (within hosts, then across).
    pub fn is_hierarchical(&self) -> bool {
        self.inner.hierarchy.get().is_some()
    }

    /// A group over `ranks` (ranks of this group). Every rank of this group must call it, in
    /// the same order as its other `new_group` calls; non-members get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>, CommError> {
        let n = self.size();
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() {
            return Err(CommError::invalid(
                "new_group",
                format!("ranks {ranks:?} contain duplicates"),
            ));
        }
        if let Some(bad) = ranks.iter().find(|&&r| r >= n) {
            return Err(CommError::invalid(
                "new_group",
                format!("rank {bad} is out of range for a group of {n} ranks"),
            ));
        }
        if ranks.is_empty() {
            return Err(CommError::invalid("new_group", "ranks is empty"));
        }
        let id = self.inner.subgroups.fetch_add(1, Ordering::AcqRel);
        let Some(my_index) = ranks.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let name = format!("{}.{id}", self.inner.name);
        let world_ranks: Vec<usize> = ranks.iter().map(|&r| self.inner.world_ranks[r]).collect();
        let mut opts = self.inner.opts.clone();
        opts.timeout = self.timeout();
        let group = build::build_group(
            self.inner.store.clone(),
            None,
            &name,
            my_index,
            world_ranks,
            &opts,
            self.inner.local_ip,
            (None, None),
        )?;
        let mut children = self.inner.children.lock().unwrap_or_else(|p| p.into_inner());
        children.retain(|c| c.strong_count() > 0);
        children.push(Arc::downgrade(&group.inner));
        Ok(Some(group))
    }
}
