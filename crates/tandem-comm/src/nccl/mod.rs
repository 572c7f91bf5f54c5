//! NCCL collectives on device buffers (feature `nccl`), for groups whose ranks each drive one
//! GPU: PyTorch's NCCL process group behind tandem's `ProcessGroup` (`pg.nccl(device)`).
//!
//! - One communicator per group, made on first use: rank 0's `ncclUniqueId` goes through the
//!   group's TCP store; every rank first checks in there, so a rank that never arrives is named
//!   instead of NCCL's init hanging.
//! - Collectives are ordered on the communicator's own stream: it waits (an event) for the
//!   caller's stream, where the data was produced, and each call records a completion event
//!   that its [`NcclWork`] waits on — on the host (`wait`) or on another stream (`wait_stream`).
//! - A watchdog thread polls the oldest unfinished call. When it has not finished within the
//!   group timeout, or NCCL reports an asynchronous error (a peer died), the watchdog names the
//!   ranks that did not reach the call (through the store), aborts the communicator
//!   (`ncclCommAbort`, which also unblocks the GPU), and every later call fails with that
//!   reason instead of hanging.
//!
//! tandem-comm knows nothing of tensors: buffers are raw device pointers ([`DeviceBuffer`]) and
//! streams raw handles ([`CudaStream`]); tandem-ddp takes them from candle's CUDA storage.
mod grouped;
mod library;
mod watchdog;

use crate::element::{ReduceOp, WireType};
use crate::error::CommError;
use crate::store::Store;
use library::{check_cuda, check_nccl, libraries, nccl_reason, Libraries, RawComm, RawStream};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use grouped::DeviceTransfer;
pub use library::{nccl_library, NcclLibraryInfo};

/// A device buffer: a CUDA device pointer, its length in elements and their dtype.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBuffer {
    pub ptr: u64,
    pub len: usize,
    pub dtype: WireType,
}

/// A CUDA stream owned by the caller (`cudaStream_t`; a driver `CUstream` is the same object).
#[derive(Clone, Copy, Debug)]
pub struct CudaStream(pub *mut c_void);
// SAFETY: a stream handle is a process-wide CUDA object, usable from any thread.
unsafe impl Send for CudaStream {}
// SAFETY: as above; the handle is only copied, never mutated through a shared reference.
unsafe impl Sync for CudaStream {}

/// A raw handle shared with the watchdog thread.
#[derive(Clone, Copy)]
struct Handle(*mut c_void);
// SAFETY: NCCL communicators, CUDA streams, events and device pointers may be used from any
// thread; every use of the communicator is serialised by `Shared::issue` or is ncclCommAbort /
// ncclCommGetAsyncError, which NCCL allows concurrently.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// The communicator of one group on one device. Cheap to clone.
#[derive(Clone)]
pub struct NcclComm {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {}/{}, cuda:{})",
            self.shared.rank,
            self.shared.size,
            self.device()
        )
    }
}

struct Shared {
    libs: &'static Libraries,
    comm: Handle,
    stream: Handle,
    /// One f32 on the device, all-reduced by `barrier`.
    scratch: Handle,
    device: i32,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Enqueue order: NCCL needs every rank to issue calls in the same order; one at a time.
    issue: Mutex<u64>,
    pending: Mutex<std::collections::VecDeque<watchdog::Pending>>,
    /// The first failure; once set, the communicator is aborted and every call fails.
    broken: Mutex<Option<String>>,
    reporter: Option<watchdog::Reporter>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let l = self.libs;
        // SAFETY: the handles were made by the matching create calls and are not used after
        // this. Abort rather than destroy: it never blocks on a peer that has gone.
        unsafe {
            (l.set_device)(self.device);
            if self.broken.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
                (l.comm_abort)(self.comm.0);
            }
            (l.free)(self.scratch.0);
            (l.stream_destroy)(self.stream.0);
        }
    }
}

/// Where the group's rendezvous happens; `ProcessGroup::nccl` fills it from the group.
pub(crate) struct Rendezvous<'a> {
    pub store: Option<&'a Store>,
    /// Store key prefix, unique to the group.
    pub prefix: String,
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
}

impl NcclComm {
    pub(crate) fn new(rv: Rendezvous<'_>, device: i32) -> Result<NcclComm, CommError> {
        let op = "nccl init";
        let l = libraries()?;
        // The rendezvous first: a missing rank is named even where the device fails too.
        let id = unique_id(l, &rv)?;
        // SAFETY: plain CUDA runtime calls with valid out-pointers.
        check_cuda(l, "cudaSetDevice", unsafe { (l.set_device)(device) })?;
        // Setting up NCCL's own connections can take a while on many hosts; the ranks are
        // known to be alive (they all checked in), so allow at least a minute.
        let init_deadline = Instant::now() + rv.timeout.max(Duration::from_secs(60));
        let mut comm: RawComm = std::ptr::null_mut();
        let mut cfg = library::Config::new();
        cfg.blocking = 0; // returns at once; we poll with a deadline and can abort
                          // SAFETY: `comm` and `cfg` are live locals NCCL writes and reads during the call; `id`
                          // is the unique id every rank received from the rendezvous.
        let rc = unsafe {
            (l.comm_init_rank_config)(&mut comm, rv.size as c_int, id, rv.rank as c_int, &mut cfg)
        };
        check_nccl(l, "ncclCommInitRankConfig", rc)?;
        if let Err(e) = settle(l, comm, init_deadline) {
            // SAFETY: `comm` was made by the init call above and is not used after the abort.
            unsafe { (l.comm_abort)(comm) };
            return Err(CommError::Nccl {
                op,
                reason: format!("rank {} of {}: {e}", rv.rank, rv.size),
            });
        }
        let stream = l.new_stream()?;
        let malloc = l.malloc;
        // SAFETY: allocates one f32 on the current device.
        let scratch = l.create("cudaMalloc", |out| unsafe { malloc(out, 4) })?;
        let shared = Arc::new(Shared {
            libs: l,
            comm: Handle(comm),
            stream: Handle(stream),
            scratch: Handle(scratch),
            device,
            rank: rv.rank,
            size: rv.size,
            timeout: rv.timeout,
            issue: Mutex::new(0),
            pending: Mutex::new(Default::default()),
            broken: Mutex::new(None),
            reporter: rv.store.map(|s| watchdog::Reporter::new(s.clone(), &rv.prefix)),
        });
        watchdog::spawn(&shared)?;
        Ok(NcclComm { shared })
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }
    pub fn size(&self) -> usize {
        self.shared.size
    }
    /// The CUDA device ordinal this communicator runs on.
    pub fn device(&self) -> i32 {
        self.shared.device
    }
    /// The communicator's own stream, on which every collective runs in issue order.
    pub fn stream(&self) -> CudaStream {
        CudaStream(self.shared.stream.0)
    }

    /// In-place all-reduce of `buf` on every rank.
    ///
    /// # Safety
    /// `buf.ptr` must point to `buf.len` elements of `buf.dtype` on this communicator's device,
    /// valid until the returned work completes; `after` (if any) must be a live stream of that
    /// device — the collective starts after the work queued on it so far.
    pub unsafe fn all_reduce(
        &self,
        buf: DeviceBuffer,
        op: ReduceOp,
        after: Option<CudaStream>,
    ) -> Result<NcclWork, CommError> {
        let f = self.shared.libs.all_reduce;
        let o = nccl_op("all_reduce", op)?;
        let (p, n, t) = (buf.ptr as *mut c_void, buf.len, nccl_dtype(buf.dtype));
        // SAFETY: the caller's contract (above) covers `buf`; `c` and `s` are this
        // communicator's own handle and stream.
        self.enqueue("all_reduce", after, |c, s| unsafe { f(p, p, n, t, o, c, s) })
    }

    /// In-place broadcast of `buf` from `root`.
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`].
    pub unsafe fn broadcast(
        &self,
        buf: DeviceBuffer,
        root: usize,
        after: Option<CudaStream>,
    ) -> Result<NcclWork, CommError> {
        if root >= self.shared.size {
            return Err(CommError::invalid(
                "broadcast",
                format!("root {root} is out of range for a group of {} ranks", self.shared.size),
            ));
        }
        let f = self.shared.libs.broadcast;
        let (p, n, t) = (buf.ptr as *mut c_void, buf.len, nccl_dtype(buf.dtype));
        // SAFETY: as in `all_reduce`; `root` was checked against the group's size.
        self.enqueue("broadcast", after, |c, s| unsafe { f(p, p, n, t, root as c_int, c, s) })
    }

    /// `recv` (size × `send.len` elements) gets every rank's `send`, in rank order.
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`], for both buffers.
    pub unsafe fn all_gather(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        after: Option<CudaStream>,
    ) -> Result<NcclWork, CommError> {
        self.check_pair("all_gather", &send, &recv, send.len * self.shared.size, recv.len)?;
        let f = self.shared.libs.all_gather;
        let (sp, rp, n, t) =
            (send.ptr as *const c_void, recv.ptr as *mut c_void, send.len, nccl_dtype(send.dtype));
        // SAFETY: as in `all_reduce`; `check_pair` made `recv` size x `send` long.
        self.enqueue("all_gather", after, |c, s| unsafe { f(sp, rp, n, t, c, s) })
    }

    /// `recv` gets this rank's block (`recv.len` elements) of the reduction of every rank's
    /// `send` (size × `recv.len` elements).
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`], for both buffers.
    pub unsafe fn reduce_scatter(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        op: ReduceOp,
        after: Option<CudaStream>,
    ) -> Result<NcclWork, CommError> {
        self.check_pair("reduce_scatter", &send, &recv, send.len, recv.len * self.shared.size)?;
        let f = self.shared.libs.reduce_scatter;
        let (sp, rp, n) = (send.ptr as *const c_void, recv.ptr as *mut c_void, recv.len);
        let (t, o) = (nccl_dtype(send.dtype), nccl_op("reduce_scatter", op)?);
        // SAFETY: as in `all_reduce`; `check_pair` made `send` size x `recv` long.
        self.enqueue("reduce_scatter", after, |c, s| unsafe { f(sp, rp, n, t, o, c, s) })
    }

    /// Returns once every rank has reached it (an all-reduce of one value, waited on the host).
    pub fn barrier(&self) -> Result<(), CommError> {
        let buf = DeviceBuffer { ptr: self.shared.scratch.0 as u64, len: 1, dtype: WireType::F32 };
        // SAFETY: the scratch value lives as long as the communicator.
        unsafe { self.all_reduce(buf, ReduceOp::Sum, None) }?.wait()
    }

    fn check_pair(
        &self,
        op: &'static str,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        want: usize,
        got: usize,
    ) -> Result<(), CommError> {
        if send.dtype != recv.dtype {
            return Err(CommError::invalid(
                op,
                format!("send is {} but recv is {}", send.dtype.name(), recv.dtype.name()),
            ));
        }
        if want != got {
            return Err(CommError::invalid(
                op,
                format!(
                    "buffer lengths do not match a group of {}: {want} != {got} elements",
                    self.shared.size
                ),
            ));
        }
        Ok(())
    }

    fn enqueue(
        &self,
        op: &'static str,
        after: Option<CudaStream>,
        launch: impl FnOnce(RawComm, RawStream) -> c_int,
    ) -> Result<NcclWork, CommError> {
        let sh = &self.shared;
        let l = sh.libs;
        let mut seq = sh.issue.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(first) = sh.broken_reason() {
            return Err(CommError::Broken { op, seq: *seq, first });
        }
        // SAFETY: handles made by this communicator; `after` is the caller's live stream.
        check_cuda(l, "cudaSetDevice", unsafe { (l.set_device)(sh.device) })?;
        let ready = match after {
            Some(producer) => {
                let ready = watchdog::Event::record(l, producer.0)?;
                // SAFETY: our stream and the event just recorded are live; the caller's
                // stream outlives the call.
                check_cuda(l, "cudaStreamWaitEvent", unsafe {
                    (l.stream_wait_event)(sh.stream.0, ready.raw(), 0)
                })?;
                Some(ready)
            }
            None => None,
        };
        let rc = launch(sh.comm.0, sh.stream.0);
        let settled = if rc == library::NCCL_IN_PROGRESS {
            settle(l, sh.comm.0, Instant::now() + sh.timeout)
        } else if rc != library::NCCL_SUCCESS {
            Err(nccl_reason(l, rc, sh.comm.0))
        } else {
            Ok(())
        };
        if let Err(reason) = settled {
            let why = format!("{op} #{} could not be enqueued: {reason}", *seq);
            sh.fail(&why);
            return Err(CommError::Nccl { op, reason: why });
        }
        let done = watchdog::Event::record(l, sh.stream.0)?;
        *seq += 1;
        sh.pending.lock().unwrap_or_else(|p| p.into_inner()).push_back(watchdog::Pending {
            event: done.clone(),
            ready,
            op,
            seq: *seq,
            since: None,
        });
        Ok(NcclWork { shared: self.shared.clone(), event: done, op, seq: *seq })
    }
}

impl Shared {
    fn broken_reason(&self) -> Option<String> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Marks the communicator failed (first reason wins) and aborts it, which also ends any
    /// NCCL kernel still waiting on a peer.
    fn fail(&self, reason: &str) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if b.is_none() {
            *b = Some(reason.to_string());
            tracing::error!("NCCL communicator aborted: {reason}");
            // SAFETY: ncclCommAbort may be called from any thread, with calls in flight.
            unsafe { (self.libs.comm_abort)(self.comm.0) };
        }
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// A collective in flight on the communicator's stream.
pub struct NcclWork {
    shared: Arc<Shared>,
    event: Arc<watchdog::Event>,
    op: &'static str,
    seq: u64,
}

impl NcclWork {
    /// Blocks the host until the collective has finished on the device. A collective that
    /// cannot finish fails within the group timeout (the watchdog aborts it).
    pub fn wait(self) -> Result<(), CommError> {
        let mut nap = Duration::from_micros(20);
        loop {
            if let Some(first) = self.shared.broken_reason() {
                return Err(CommError::Nccl {
                    op: self.op,
                    reason: format!("#{}: {first}", self.seq),
                });
            }
            if self.event.is_done(self.op)? {
                return Ok(());
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    /// Makes `stream` wait for the collective without blocking the host (PyTorch's
    /// `work.wait()` on a CUDA stream).
    pub fn wait_stream(&self, stream: CudaStream) -> Result<(), CommError> {
        let l = self.shared.libs;
        // SAFETY: the event is live (held by self); the stream is the caller's.
        check_cuda(l, "cudaStreamWaitEvent", unsafe {
            (l.stream_wait_event)(stream.0, self.event.raw(), 0)
        })
    }

    /// Whether the collective has finished (false once the communicator is broken).
    pub fn is_completed(&self) -> bool {
        self.shared.broken_reason().is_none() && self.event.is_done(self.op).unwrap_or(false)
    }
}

/// Polls a non-blocking communicator until its last call has been taken, or the deadline.
fn settle(l: &Libraries, comm: RawComm, deadline: Instant) -> Result<(), String> {
    loop {
        let mut state = 0;
        // SAFETY: valid communicator, one int written.
        let rc = unsafe { (l.comm_get_async_error)(comm, &mut state) };
        if rc != library::NCCL_SUCCESS {
            return Err(nccl_reason(l, rc, comm));
        }
        match state {
            library::NCCL_SUCCESS => return Ok(()),
            library::NCCL_IN_PROGRESS if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(100))
            }
            library::NCCL_IN_PROGRESS => return Err("not finished before the timeout".into()),
            other => return Err(nccl_reason(l, other, comm)),
        }
    }
}

/// Rank 0 makes the id; every rank checks in through the store first, so a rank that never
/// arrives is named here rather than NCCL hanging in init.
fn unique_id(l: &Libraries, rv: &Rendezvous<'_>) -> Result<library::UniqueId, CommError> {
    let mut id = library::UniqueId([0; 128]);
    let make = |id: &mut library::UniqueId| {
        // SAFETY: writes the 128-byte id.
        check_nccl(l, "ncclGetUniqueId", unsafe { (l.get_unique_id)(id) })
    };
    let Some(store) = rv.store else {
        make(&mut id)?;
        return Ok(id);
    };
    let key = format!("{}/nccl/unique_id", rv.prefix);
    if rv.rank == 0 {
        make(&mut id)?;
        store.set(&key, &id.0)?;
    }
    store.set(&format!("{}/nccl/joined/{}", rv.prefix, rv.rank), b"1")?;
    let joined: Vec<String> =
        (0..rv.size).map(|r| format!("{}/nccl/joined/{r}", rv.prefix)).collect();
    let keys: Vec<&str> = joined.iter().map(String::as_str).collect();
    if store.wait_timeout(&keys, rv.timeout).is_err() {
        let missing = store.missing(&keys)?;
        let ranks: Vec<String> =
            missing.iter().filter_map(|k| k.rsplit('/').next()).map(str::to_string).collect();
        return Err(CommError::Nccl {
            op: "nccl init",
            reason: format!(
                "rank(s) {} did not reach the NCCL rendezvous within {:?} (dead, or not calling pg.nccl())",
                ranks.join(", "),
                rv.timeout
            ),
        });
    }
    if rv.rank != 0 {
        let bytes = store.get(&key)?;
        if bytes.len() != 128 {
            return Err(CommError::Protocol {
                from: format!("store key {key}"),
                reason: format!("an ncclUniqueId has 128 bytes, got {}", bytes.len()),
            });
        }
        id.0.copy_from_slice(&bytes);
    }
    Ok(id)
}

/// `ncclDataType_t`.
fn nccl_dtype(d: WireType) -> c_int {
    match d {
        WireType::U8 => 1,
        WireType::I32 => 2,
        WireType::I64 => 4,
        WireType::F16 => 6,
        WireType::F32 => 7,
        WireType::F64 => 8,
        WireType::BF16 => 9,
    }
}

/// `ncclRedOp_t`; NCCL has no bitwise reductions (as PyTorch's NCCL backend refuses them).
fn nccl_op(what: &'static str, op: ReduceOp) -> Result<c_int, CommError> {
    Ok(match op {
        ReduceOp::Sum => 0,
        ReduceOp::Product => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
            return Err(CommError::invalid(what, format!("NCCL has no {} reduction", op.name())))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_and_ops_have_nccl_s_codes() {
        // nccl.h: ncclUint8 = 1, ncclInt32 = 2, ncclInt64 = 4, ncclFloat16 = 6,
        // ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9; ncclSum = 0 ... ncclAvg = 4.
        let codes: Vec<c_int> = [
            WireType::U8,
            WireType::I32,
            WireType::I64,
            WireType::F16,
            WireType::F32,
            WireType::F64,
            WireType::BF16,
        ]
        .map(nccl_dtype)
        .to_vec();
        assert_eq!(codes, [1, 2, 4, 6, 7, 8, 9]);
        let ops: Vec<c_int> =
            [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg]
                .map(|op| nccl_op("all_reduce", op).unwrap())
                .to_vec();
        assert_eq!(ops, [0, 1, 2, 3, 4]);
    }

    #[test]
    fn the_config_struct_has_nccl_2_17_s_layout() {
        // size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs,
        // maxCTAs; const char *netName; int splitShare → 48 bytes on 64-bit Linux.
        assert_eq!(std::mem::size_of::<library::Config>(), 48);
    }
}
