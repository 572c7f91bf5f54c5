//! Point-to-point byte transports under the collectives. A transport moves bytes between group
//! ranks; its one primitive, `exchange`, sends to one peer while receiving from another (the
//! step of every ring algorithm), overlapping both directions, and can reduce received
//! elements into the destination as they arrive (pipelining the reduction with the transfer).
//! Timeouts are inactivity timeouts: no byte of progress for `timeout` fails the exchange.
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
pub(crate) mod shm;
pub(crate) mod tcp;
#[doc(hidden)]
pub use tcp::fuzz_mesh_hello;

use std::ops::Range;
use std::time::Duration;

use crate::element::{ReduceOp, WireType};

/// Which transport a group uses (`TANDEM_TRANSPORT=tcp|shm|mpi`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// Sockets: any hosts.
    Tcp,
    /// Shared memory: every rank of the group on one host.
    Shm,
    /// The MPI library the job was started with (`mpirun`): its collectives, its interconnect.
    /// Needs the `mpi` build feature.
    Mpi,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
        }
    }
}

/// What to do with received bytes.
pub(crate) enum Recv<'a> {
    Copy(&'a mut [u8]),
    /// Reduce received elements of `elem` bytes into `dst` with `f(dst_part, src_part)`.
    Reduce {
        dst: &'a mut [u8],
        elem: usize,
        f: &'a (dyn Fn(&mut [u8], &[u8]) + Sync),
    },
}

impl Recv<'_> {
    pub fn len(&self) -> usize {
        match self {
            Recv::Copy(b) => b.len(),
            Recv::Reduce { dst, .. } => dst.len(),
        }
    }
}

/// Why a transfer with `peer` (a group rank) failed.
#[derive(Debug, Clone)]
pub(crate) enum FailKind {
    Closed,
    Timeout(Duration),
    Io(String),
    /// Raised by the group (desync check), carried through the same path.
    Desync {
        rank_a: usize,
        call_a: String,
        rank_b: usize,
        call_b: String,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct PeerError {
    pub peer: usize,
    pub kind: FailKind,
}

pub(crate) trait Transport: Send {
    /// Sends `send.1` to group rank `send.0` while receiving `recv`'s length from `recv.0`.
    fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, Recv<'_>)>,
        timeout: Duration,
    ) -> Result<(), PeerError>;

    /// Called after a failure: make the peers' pending operations fail quickly too.
    fn abort(&mut self);

    /// Collectives the transport's library runs itself (MPI's); `None` (the default) runs
    /// tandem's algorithms over `exchange`.
    fn native(&mut self) -> Option<&mut dyn NativeCollectives> {
        None
    }
}

/// Collectives on raw bytes that a library implements (ranks are group ranks; every wait is
/// bounded by `timeout`). The reductions return `Ok(false)` for an element type or operator
/// the library has no equivalent of (f16, bf16), which then runs over `exchange`.
pub(crate) trait NativeCollectives {
    fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: WireType,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool, PeerError>;
    fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: WireType,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool, PeerError>;
    fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        timeout: Duration,
    ) -> Result<(), PeerError>;
    /// Rank r's block is `buf[bounds[r]]`; this rank's own block is already in place.
    fn all_gather_blocks(
        &mut self,
        buf: &mut [u8],
        bounds: &[Range<usize>],
        timeout: Duration,
    ) -> Result<(), PeerError>;
    fn barrier(&mut self, timeout: Duration) -> Result<(), PeerError>;
    fn gather(
        &mut self,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: usize,
        timeout: Duration,
    ) -> Result<(), PeerError>;
    fn scatter(
        &mut self,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: usize,
        timeout: Duration,
    ) -> Result<(), PeerError>;
}
