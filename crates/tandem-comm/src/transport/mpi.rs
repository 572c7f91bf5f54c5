//! The MPI transport (build feature `mpi`, `TANDEM_TRANSPORT=mpi`): for jobs started by
//! `mpirun`/`srun --mpi`, whose MPI library reaches the interconnect (InfiniBand, shared memory)
//! better than sockets. The collectives are MPI's own — `MPI_Iallreduce`, `MPI_Ibcast`,
//! `MPI_Iallgatherv`, `MPI_Ireduce_scatter_block`, `MPI_Igather`, `MPI_Iscatter`,
//! `MPI_Ibarrier` — and point-to-point (send/recv, the desync check, and f16/bf16 reductions,
//! which MPI has no types for, run as tandem's ring) is `MPI_Isend`/`MPI_Irecv`. Sub-groups are
//! `MPI_Comm_create_group` over the members only, as `new_group` is called by members only.
//!
//! Bounded waits: every call is non-blocking and polled with `MPI_Testall` until it completes
//! or the group timeout passes (MPI itself would wait forever on a stalled rank). MPI cannot
//! cancel a started collective and would still write into the caller's buffers, so a timeout
//! prints what stalled and calls `MPI_Abort`, which ends the whole job. A rank that dies is
//! reported by mpirun, which ends the job (`mpirun noticed that process rank 1 ... exited on
//! signal 9`).
//!
//! MPI is initialised once per process with `MPI_THREAD_MULTIPLE` (async work and sub-groups
//! call from several threads) and finalised at exit; after a failure the exit calls
//! `MPI_Abort` instead, so no rank is left waiting in a collective.
//!
//! There is no `MPI_IN_PLACE` in the `mpi` crate's portable constants, so the in-place
//! all_reduce and all_gather send from a copy of the input (one memcpy per call).
use std::ffi::{c_int, c_void};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, Group, SimpleCommunicator};
use mpi::traits::Equivalence;

use super::{FailKind, NativeCollectives, PeerError, Recv, Transport};
use crate::element::{ReduceOp, WireType};

/// Set after a failure: the exit must abort the job instead of finalising.
static BROKEN: AtomicBool = AtomicBool::new(false);
/// The outcome of initialising MPI in this process.
static INIT: OnceLock<Result<(), String>> = OnceLock::new();
/// MPI counts are C ints: larger buffers go in pieces of this many elements.
const MAX_COUNT: usize = 1 << 30;

fn ensure_init() -> Result<(), String> {
    INIT.get_or_init(|| {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or("MPI was already initialised by other code in this process")?;
        // Finalised by the exit handler below, not by a drop.
        std::mem::forget(universe);
        // SAFETY: registers a plain `extern "C" fn` with no captured state.
        unsafe { libc::atexit(finalize_at_exit) };
        if level < mpi::Threading::Multiple {
            return Err(format!(
                "the MPI library offers thread level {level:?}; tandem needs MPI_THREAD_MULTIPLE \
                 (OpenMPI and MPICH builds from Debian provide it)"
            ));
        }
        Ok(())
    })
    .clone()
}

extern "C" fn finalize_at_exit() {
    // SAFETY: MPI was initialised (this handler is registered after init) and is finalised or
    // aborted once, here.
    unsafe {
        if BROKEN.load(Ordering::SeqCst) {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
        } else {
            ffi::MPI_Finalize();
        }
    }
}

/// A communicator usable from any thread (MPI_THREAD_MULTIPLE).
struct Comm(SimpleCommunicator);
// SAFETY: with MPI_THREAD_MULTIPLE (checked at init) MPI handles may be used from any thread;
// the group serialises calls on one communicator.
unsafe impl Send for Comm {}

pub(crate) struct MpiTransport {
    comm: Comm,
    rank: usize,
}

/// Connects group rank `rank` of the group whose members are `world_ranks` (MPI_COMM_WORLD
/// ranks). `name` tags the sub-group's creation.
pub(crate) fn connect(
    name: &str,
    rank: usize,
    world_ranks: &[usize],
) -> Result<MpiTransport, String> {
    ensure_init()?;
    let world = SimpleCommunicator::world();
    let (mpi_rank, mpi_size) = (world.rank() as usize, world.size() as usize);
    let me = world_ranks[rank];
    if me != mpi_rank || world_ranks.iter().any(|&r| r >= mpi_size) {
        return Err(format!(
            "tandem's rank {me} (of ranks {world_ranks:?}) is MPI_COMM_WORLD rank {mpi_rank} of \
             {mpi_size}: with TANDEM_TRANSPORT=mpi the job must be started by mpirun (or srun \
             --mpi) with one process per rank, and RANK/WORLD_SIZE must not be overridden"
        ));
    }
    let comm =
        if world_ranks.len() == mpi_size && world_ranks.iter().enumerate().all(|(i, &r)| i == r) {
            world
        } else {
            let ranks: Vec<i32> = world_ranks.iter().map(|&r| r as i32).collect();
            let group = world.group().include(&ranks);
            // The tag keeps concurrent creations of different sub-groups apart.
            let tag = name.bytes().fold(17i32, |h, b| (h.wrapping_mul(31) + b as i32) & 0x7fff);
            world.split_by_subgroup_with_tag(&group, tag).ok_or_else(|| {
                format!("MPI_Comm_create_group for ranks {world_ranks:?} gave no communicator")
            })?
        };
    Ok(MpiTransport { comm: Comm(comm), rank })
}

fn datatype(dtype: WireType) -> Option<ffi::MPI_Datatype> {
    Some(match dtype {
        WireType::F32 => f32::equivalent_datatype().as_raw(),
        WireType::F64 => f64::equivalent_datatype().as_raw(),
        WireType::I32 => i32::equivalent_datatype().as_raw(),
        WireType::I64 => i64::equivalent_datatype().as_raw(),
        WireType::U8 => u8::equivalent_datatype().as_raw(),
        WireType::F16 | WireType::BF16 => return None,
    })
}

fn operator(op: ReduceOp) -> ffi::MPI_Op {
    use mpi::collective::SystemOperation;
    match op {
        // The group divides after a sum for Avg.
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum().as_raw(),
        ReduceOp::Max => SystemOperation::max().as_raw(),
        ReduceOp::Min => SystemOperation::min().as_raw(),
        ReduceOp::Product => SystemOperation::product().as_raw(),
        ReduceOp::BitAnd => SystemOperation::bitwise_and().as_raw(),
        ReduceOp::BitOr => SystemOperation::bitwise_or().as_raw(),
        ReduceOp::BitXor => SystemOperation::bitwise_xor().as_raw(),
    }
}

fn bytes_type() -> ffi::MPI_Datatype {
    u8::equivalent_datatype().as_raw()
}

fn count(n: usize, what: &str) -> Result<c_int, PeerError> {
    c_int::try_from(n).map_err(|_| PeerError {
        peer: 0,
        kind: FailKind::Io(format!("{what}: {n} exceeds MPI's 32-bit counts")),
    })
}

impl MpiTransport {
    fn raw(&self) -> ffi::MPI_Comm {
        self.comm.0.as_raw()
    }

    /// Polls `reqs` until all complete; past `timeout`, says what stalled and aborts the job
    /// (the library would still write into buffers the caller gets back).
    fn wait(
        &self,
        reqs: &mut [ffi::MPI_Request],
        what: &str,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let deadline = Instant::now() + timeout;
        let mut polls = 0u64;
        loop {
            let mut done: c_int = 0;
            // SAFETY: `reqs` are requests started by this transport and not yet completed.
            let rc = unsafe {
                ffi::MPI_Testall(
                    reqs.len() as c_int,
                    reqs.as_mut_ptr(),
                    &mut done,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            if rc != 0 {
                // The requests may still be writing into the caller's buffers, which an
                // error return would hand back: this process cannot go on safely.
                self.abort_job(&format!("{what}: MPI error code {rc} while waiting"));
            }
            if done != 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                BROKEN.store(true, Ordering::SeqCst);
                crate::diagnostics::last_words(&format!(
                    "tandem: rank {}: {what} did not complete within {timeout:?} (a rank is \
                     stalled, dead, or called a different collective; MPI does not say which): \
                     aborting the MPI job",
                    self.comm.0.rank()
                ));
                // SAFETY: aborts every process of the job; does not return.
                unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
                std::process::exit(1);
            }
            polls += 1;
            if polls > 2000 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Starts one non-blocking call (`start` fills in the request and returns MPI's code) and
    /// waits for it: the shape of every collective here.
    fn call(
        &self,
        what: &str,
        timeout: Duration,
        start: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
    ) -> Result<(), PeerError> {
        let mut req = Self::new_request();
        let rc = start(&mut req);
        self.check(rc, what)?;
        self.wait(&mut [req], what, timeout)
    }

    /// Says why and aborts every process of the MPI job (does not return).
    fn abort_job(&self, why: &str) -> ! {
        BROKEN.store(true, Ordering::SeqCst);
        crate::diagnostics::last_words(&format!(
            "tandem: rank {}: {why}: aborting the MPI job",
            self.comm.0.rank()
        ));
        // SAFETY: aborts every process of the job; does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
        std::process::exit(1);
    }

    /// Cancels requests already posted and waits for each to finish, so no buffer they use is
    /// given back while MPI may still write into it (aborting the job if MPI cannot).
    fn cancel_posted(&self, reqs: &mut [ffi::MPI_Request], what: &str) {
        for req in reqs.iter_mut() {
            // SAFETY: `req` was started by this transport and has not completed; cancelling
            // and then waiting on it is how MPI retires a request early.
            let rc = unsafe {
                let rc = ffi::MPI_Cancel(req);
                if rc != 0 {
                    rc
                } else {
                    ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE)
                }
            };
            if rc != 0 {
                self.abort_job(&format!("{what}: cannot cancel a posted request (code {rc})"));
            }
        }
    }

    fn check(&self, rc: c_int, what: &str) -> Result<(), PeerError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(PeerError {
                peer: self.rank,
                kind: FailKind::Io(format!("{what}: MPI error code {rc}")),
            })
        }
    }

    fn new_request() -> ffi::MPI_Request {
        // SAFETY: reads an immutable constant exported by the MPI shim.
        unsafe { ffi::RSMPI_REQUEST_NULL }
    }
}

impl Transport for MpiTransport {
    fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, Recv<'_>)>,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let mut reqs = Vec::with_capacity(2);
        let mut scratch = Vec::new();
        let (recv_peer, mut recv) = match recv {
            Some((p, r)) => (Some(p), Some(r)),
            None => (None, None),
        };
        // Every count is checked before anything is posted: an error after a receive is posted
        // must not leave it writing into a buffer this function gives back.
        let send_count = send.map(|(_, data)| count(data.len(), "MPI_Isend")).transpose()?;
        if let (Some(peer), Some(r)) = (recv_peer, recv.as_mut()) {
            let into: &mut [u8] = match r {
                Recv::Copy(b) => b,
                Recv::Reduce { dst, .. } => {
                    scratch.resize(dst.len(), 0);
                    &mut scratch
                }
            };
            let mut req = Self::new_request();
            let n = count(into.len(), "MPI_Irecv")?;
            // SAFETY: `into` outlives the request, which completes in `wait` below (or the
            // job is aborted there).
            let rc = unsafe {
                ffi::MPI_Irecv(
                    into.as_mut_ptr() as *mut c_void,
                    n,
                    bytes_type(),
                    peer as c_int,
                    0,
                    self.raw(),
                    &mut req,
                )
            };
            self.check(rc, "MPI_Irecv")?;
            reqs.push(req);
        }
        if let (Some((peer, data)), Some(n)) = (send, send_count) {
            let mut req = Self::new_request();
            // SAFETY: as above; MPI only reads `data`.
            let rc = unsafe {
                ffi::MPI_Isend(
                    data.as_ptr() as *const c_void,
                    n,
                    bytes_type(),
                    peer as c_int,
                    0,
                    self.raw(),
                    &mut req,
                )
            };
            if let Err(e) = self.check(rc, "MPI_Isend") {
                self.cancel_posted(&mut reqs, "MPI_Isend failed");
                return Err(e);
            }
            reqs.push(req);
        }
        let what = match (send, recv_peer) {
            (Some((s, _)), Some(r)) => format!("MPI send to rank {s} / receive from rank {r}"),
            (Some((s, _)), None) => format!("MPI send to rank {s}"),
            (None, Some(r)) => format!("MPI receive from rank {r}"),
            (None, None) => return Ok(()),
        };
        self.wait(&mut reqs, &what, timeout)?;
        if let Some(Recv::Reduce { dst, f, .. }) = recv {
            f(dst, &scratch);
        }
        Ok(())
    }

    fn abort(&mut self) {
        // Not MPI_Abort here: the caller still reports the error. The exit aborts the job.
        BROKEN.store(true, Ordering::SeqCst);
    }

    fn native(&mut self) -> Option<&mut dyn NativeCollectives> {
        Some(self)
    }
}

// SAFETY (every `unsafe` call below): the buffers handed to MPI outlive the request, which
// `call` completes before returning (or the job is aborted there); receive buffers are as long
// as the counts say; MPI only reads the send buffers.
impl NativeCollectives for MpiTransport {
    fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: WireType,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool, PeerError> {
        let Some(ty) = datatype(dtype) else { return Ok(false) };
        let elem = dtype.size();
        for piece in buf.chunks_mut(MAX_COUNT * elem) {
            let input = piece.to_vec();
            let n = (piece.len() / elem) as c_int;
            let what = format!("MPI_Iallreduce of {} bytes", piece.len());
            // SAFETY: see the impl's note: buffers outlive the request `call` completes.
            self.call(&what, timeout, |req| unsafe {
                ffi::MPI_Iallreduce(
                    input.as_ptr() as *const c_void,
                    piece.as_mut_ptr() as *mut c_void,
                    n,
                    ty,
                    operator(op),
                    self.raw(),
                    req,
                )
            })?;
        }
        Ok(true)
    }

    fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: WireType,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool, PeerError> {
        let Some(ty) = datatype(dtype) else { return Ok(false) };
        let n = count(output.len() / dtype.size(), "MPI_Ireduce_scatter_block")?;
        // SAFETY: see the impl's note: buffers outlive the request `call` completes.
        self.call("MPI_Ireduce_scatter_block", timeout, |req| unsafe {
            ffi::MPI_Ireduce_scatter_block(
                input.as_ptr() as *const c_void,
                output.as_mut_ptr() as *mut c_void,
                n,
                ty,
                operator(op),
                self.raw(),
                req,
            )
        })?;
        Ok(true)
    }

    fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        for piece in buf.chunks_mut(MAX_COUNT) {
            let what = format!("MPI_Ibcast of {} bytes from rank {root}", piece.len());
            // SAFETY: see the impl's note: buffers outlive the request `call` completes.
            self.call(&what, timeout, |req| unsafe {
                let ptr = piece.as_mut_ptr() as *mut c_void;
                ffi::MPI_Ibcast(
                    ptr,
                    piece.len() as c_int,
                    bytes_type(),
                    root as c_int,
                    self.raw(),
                    req,
                )
            })?;
        }
        Ok(())
    }

    fn all_gather_blocks(
        &mut self,
        buf: &mut [u8],
        bounds: &[Range<usize>],
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let mut counts = Vec::with_capacity(bounds.len());
        let mut displs = Vec::with_capacity(bounds.len());
        for b in bounds {
            counts.push(count(b.len(), "MPI_Iallgatherv")?);
            displs.push(count(b.start, "MPI_Iallgatherv")?);
        }
        let own = buf[bounds[self.rank].clone()].to_vec();
        // SAFETY: see the impl's note: buffers outlive the request `call` completes.
        self.call("MPI_Iallgatherv", timeout, |req| unsafe {
            ffi::MPI_Iallgatherv(
                own.as_ptr() as *const c_void,
                own.len() as c_int,
                bytes_type(),
                buf.as_mut_ptr() as *mut c_void,
                counts.as_ptr(),
                displs.as_ptr(),
                bytes_type(),
                self.raw(),
                req,
            )
        })
    }

    fn barrier(&mut self, timeout: Duration) -> Result<(), PeerError> {
        // SAFETY: see the impl's note: buffers outlive the request `call` completes.
        self.call("MPI_Ibarrier", timeout, |req| unsafe { ffi::MPI_Ibarrier(self.raw(), req) })
    }

    fn gather(
        &mut self,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: usize,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let n = count(input.len(), "MPI_Igather")?;
        // The receive buffer is used at the root only.
        let out = output.map_or(std::ptr::null_mut(), |o| o.as_mut_ptr() as *mut c_void);
        let inp = input.as_ptr() as *const c_void;
        // SAFETY: see the impl's note: buffers outlive the request `call` completes.
        self.call(&format!("MPI_Igather to rank {root}"), timeout, |req| unsafe {
            ffi::MPI_Igather(
                inp,
                n,
                bytes_type(),
                out,
                n,
                bytes_type(),
                root as c_int,
                self.raw(),
                req,
            )
        })
    }

    fn scatter(
        &mut self,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: usize,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let n = count(output.len(), "MPI_Iscatter")?;
        // The send buffer is used at the root only.
        let inp = input.map_or(std::ptr::null(), |i| i.as_ptr() as *const c_void);
        let out = output.as_mut_ptr() as *mut c_void;
        // SAFETY: see the impl's note: buffers outlive the request `call` completes.
        self.call(&format!("MPI_Iscatter from rank {root}"), timeout, |req| unsafe {
            ffi::MPI_Iscatter(
                inp,
                n,
                bytes_type(),
                out,
                n,
                bytes_type(),
                root as c_int,
                self.raw(),
                req,
            )
        })
    }
}
