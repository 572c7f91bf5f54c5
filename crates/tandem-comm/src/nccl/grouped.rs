//! The device collectives NCCL builds from grouped point-to-point calls — all_to_all (even or
//! uneven splits), batched send/recv, gather and scatter — and ncclReduce. A group of
//! ncclSend/ncclRecv between ncclGroupStart and ncclGroupEnd runs as one operation, so a
//! batch cannot deadlock on its own order (PyTorch's NCCL backend builds the same calls so).
use super::{nccl_dtype, nccl_op, DeviceBuffer, NcclComm, NcclWork};
use crate::element::ReduceOp;
use crate::error::CommError;
use crate::group::P2PKind;
use std::ffi::{c_int, c_void};

/// One transfer of a grouped call: a buffer and the peer it goes to or comes from.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTransfer {
    pub kind: P2PKind,
    pub peer: usize,
    pub buf: DeviceBuffer,
}

impl NcclComm {
    fn check_rank(&self, op: &'static str, what: &str, r: usize) -> Result<(), CommError> {
        if r >= self.size() {
            return Err(CommError::invalid(
                op,
                format!("{what} {r} is out of range for a group of {} ranks", self.size()),
            ));
        }
        Ok(())
    }

    /// `recv` on rank `root` gets the reduction of every rank's `send` (PyTorch's `reduce`;
    /// `recv` is ignored elsewhere and may alias `send`).
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`], for both buffers.
    pub unsafe fn reduce(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        op: ReduceOp,
        root: usize,
        after: Option<super::CudaStream>,
    ) -> Result<NcclWork, CommError> {
        self.check_rank("reduce", "root", root)?;
        self.check_pair("reduce", &send, &recv, send.len, recv.len)?;
        let f = self.shared.libs.reduce;
        let (sp, rp, n) = (send.ptr as *const c_void, recv.ptr as *mut c_void, send.len);
        let (t, o) = (nccl_dtype(send.dtype), nccl_op("reduce", op)?);
        // SAFETY: the caller's contract covers both buffers; `root` was checked; `c` and `s` are
        // this communicator's own handle and stream.
        self.enqueue("reduce", after, |c, s| unsafe { f(sp, rp, n, t, o, root as c_int, c, s) })
    }

    /// Runs `transfers` as one NCCL group (PyTorch's `batch_isend_irecv` on NCCL).
    ///
    /// # Safety
    /// Every buffer as for [`NcclComm::all_reduce`].
    pub unsafe fn batch_send_recv(
        &self,
        transfers: &[DeviceTransfer],
        after: Option<super::CudaStream>,
    ) -> Result<NcclWork, CommError> {
        self.grouped("batch_isend_irecv", transfers, after)
    }

    /// Rank r sends `send`'s j-th piece (`send_splits[j]` elements, or an equal share) to rank
    /// j, which stores it as its r-th piece of `recv` (PyTorch's `all_to_all_single` on NCCL).
    /// NCCL cannot check that two ranks' splits agree: a mismatch stalls until the watchdog
    /// fails the communicator at the group timeout.
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`], for both buffers.
    pub unsafe fn all_to_all(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        send_splits: Option<&[usize]>,
        recv_splits: Option<&[usize]>,
        after: Option<super::CudaStream>,
    ) -> Result<NcclWork, CommError> {
        let op = "all_to_all";
        // Element types only: the lengths are the splits' business.
        self.check_pair(op, &send, &recv, 0, 0)?;
        let sends = self.pieces(op, "input", send, send_splits)?;
        let recvs = self.pieces(op, "output", recv, recv_splits)?;
        let mut transfers = Vec::with_capacity(2 * self.size());
        for (peer, (s, r)) in sends.into_iter().zip(recvs).enumerate() {
            transfers.push(DeviceTransfer { kind: P2PKind::Send, peer, buf: s });
            transfers.push(DeviceTransfer { kind: P2PKind::Recv, peer, buf: r });
        }
        self.grouped(op, &transfers, after)
    }

    /// Root's `recv` (size × `send.len` elements, rank-major) gets every rank's `send`.
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`]; `recv` is read on root only.
    pub unsafe fn gather(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        root: usize,
        after: Option<super::CudaStream>,
    ) -> Result<NcclWork, CommError> {
        self.check_rank("gather", "root", root)?;
        let mut transfers = vec![DeviceTransfer { kind: P2PKind::Send, peer: root, buf: send }];
        if self.rank() == root {
            self.check_pair("gather", &send, &recv, send.len * self.size(), recv.len)?;
            let pieces = self.pieces("gather", "output", recv, None)?;
            transfers.extend(pieces.into_iter().enumerate().map(|(peer, buf)| DeviceTransfer {
                kind: P2PKind::Recv,
                peer,
                buf,
            }));
        }
        self.grouped("gather", &transfers, after)
    }

    /// Rank r's `recv` gets root's r-th block of `send` (size × `recv.len` elements).
    ///
    /// # Safety
    /// As for [`NcclComm::all_reduce`]; `send` is read on root only.
    pub unsafe fn scatter(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        root: usize,
        after: Option<super::CudaStream>,
    ) -> Result<NcclWork, CommError> {
        self.check_rank("scatter", "root", root)?;
        let mut transfers = vec![DeviceTransfer { kind: P2PKind::Recv, peer: root, buf: recv }];
        if self.rank() == root {
            self.check_pair("scatter", &send, &recv, send.len, recv.len * self.size())?;
            let pieces = self.pieces("scatter", "input", send, None)?;
            transfers.extend(pieces.into_iter().enumerate().map(|(peer, buf)| DeviceTransfer {
                kind: P2PKind::Send,
                peer,
                buf,
            }));
        }
        self.grouped("scatter", &transfers, after)
    }

    /// `buf` cut into one piece per rank: `splits` elements each (one per rank, summing to
    /// the buffer's length) or equal shares.
    fn pieces(
        &self,
        op: &'static str,
        which: &str,
        buf: DeviceBuffer,
        splits: Option<&[usize]>,
    ) -> Result<Vec<DeviceBuffer>, CommError> {
        let n = self.size();
        let counts = match splits {
            Some(s) if s.len() == n && s.iter().sum::<usize>() == buf.len => s.to_vec(),
            Some(s) => {
                return Err(CommError::invalid(
                    op,
                    format!(
                        "{which}_split_sizes {s:?} must give one count per rank ({n}) summing to \
                         the {which}'s {} elements",
                        buf.len
                    ),
                ))
            }
            None if buf.len.is_multiple_of(n) => vec![buf.len / n; n],
            None => {
                return Err(CommError::invalid(
                    op,
                    format!(
                        "the {which}'s {} elements do not split evenly over {n} ranks",
                        buf.len
                    ),
                ))
            }
        };
        let es = buf.dtype.size() as u64;
        let mut at = buf.ptr;
        Ok(counts
            .into_iter()
            .map(|len| {
                let piece = DeviceBuffer { ptr: at, len, dtype: buf.dtype };
                at += len as u64 * es;
                piece
            })
            .collect())
    }

    fn grouped(
        &self,
        op: &'static str,
        transfers: &[DeviceTransfer],
        after: Option<super::CudaStream>,
    ) -> Result<NcclWork, CommError> {
        for t in transfers {
            self.check_rank(op, "peer", t.peer)?;
        }
        let l = self.shared.libs;
        let transfers = transfers.to_vec();
        self.enqueue(op, after, move |c, s| {
            // SAFETY: NCCL calls on a live communicator and stream; every buffer is the
            // caller's (this function's contract).
            unsafe {
                let mut first = (l.group_start)();
                for t in transfers.iter().filter(|t| t.buf.len > 0) {
                    let (dt, peer) = (nccl_dtype(t.buf.dtype), t.peer as c_int);
                    let rc = match t.kind {
                        P2PKind::Send => {
                            (l.send)(t.buf.ptr as *const c_void, t.buf.len, dt, peer, c, s)
                        }
                        P2PKind::Recv => {
                            (l.recv)(t.buf.ptr as *mut c_void, t.buf.len, dt, peer, c, s)
                        }
                    };
                    if first == super::library::NCCL_SUCCESS {
                        first = rc;
                    }
                }
                let end = (l.group_end)();
                if first == super::library::NCCL_SUCCESS {
                    end
                } else {
                    first
                }
            }
        })
    }
}
