//! Point-to-point transfers: `send` / `recv`, their async forms `isend` / `irecv`, and
//! `batch_isend_irecv` (PyTorch's names). Transfers to one peer arrive in the order they were
//! issued. A rank's calls run in issue order, so an `isend` whose receiver is itself still
//! sending can only complete once the bytes fit the socket's buffer; exchanges between ranks
//! belong in one `batch_isend_irecv`, which runs its sends and receives together (as PyTorch's
//! documentation recommends for NCCL too).
use super::{Call, ProcessGroup, State};
use crate::element::{Element, WireType};
use crate::error::CommError;
use crate::order::Ticket;
use crate::transport::{FailKind, PeerError, Recv, Transport};
use crate::work::Work;
use std::time::Duration;

/// Whether a [`P2POp`] sends or receives (PyTorch passes `dist.isend` or `dist.irecv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum P2PKind {
    Send,
    Recv,
}

/// One transfer of a [`ProcessGroup::batch_isend_irecv`] batch (PyTorch's `P2POp`). A receive's
/// `buf` has the length it expects and holds the data once the batch's `Work` is waited on.
#[derive(Clone, Debug, PartialEq)]
pub struct P2POp<T> {
    pub kind: P2PKind,
    pub peer: usize,
    pub buf: Vec<T>,
}

impl<T> P2POp<T> {
    pub fn isend(buf: Vec<T>, peer: usize) -> P2POp<T> {
        P2POp { kind: P2PKind::Send, peer, buf }
    }
    pub fn irecv(buf: Vec<T>, peer: usize) -> P2POp<T> {
        P2POp { kind: P2PKind::Recv, peer, buf }
    }
}

/// One side of a transfer as the desync check states it: `send` names the receiver.
fn header(dtype: WireType, count: usize, to: usize, seq: u64) -> [u8; 32] {
    Call::new("send", Some(dtype), count, to as u64).encode(seq)
}

/// A send and a receive that run as one overlapped exchange, either side optional.
struct Pair<'a> {
    send: Option<(usize, &'a [u8], usize, u64)>,
    recv: Option<(usize, &'a mut [u8], usize, u64)>,
}

/// Runs `pair`; with the desync check on, first swaps headers so a receive that does not match
/// its sender's call (count, type, order) fails naming both calls.
fn run_pair(
    t: &mut dyn Transport,
    pair: Pair<'_>,
    dtype: WireType,
    me: usize,
    detail: bool,
    timeout: Duration,
) -> Result<(), PeerError> {
    if detail {
        let mine = pair.send.as_ref().map(|&(to, _, count, seq)| header(dtype, count, to, seq));
        let mut theirs = [0u8; 32];
        t.exchange(
            pair.send.as_ref().zip(mine.as_ref()).map(|(s, h)| (s.0, &h[..])),
            pair.recv.as_ref().map(|r| r.0).map(|from| (from, Recv::Copy(&mut theirs))),
            timeout,
        )?;
        if let Some(&(from, _, count, seq)) = pair.recv.as_ref() {
            if theirs != header(dtype, count, me, seq) {
                let want = Call::new("recv", Some(dtype), count, from as u64).encode(seq);
                return Err(PeerError {
                    peer: from,
                    kind: FailKind::Desync {
                        rank_a: me,
                        call_a: Call::describe(&want),
                        rank_b: from,
                        call_b: Call::describe(&theirs),
                    },
                });
            }
        }
    }
    t.exchange(
        pair.send.map(|(to, data, _, _)| (to, data)),
        pair.recv.map(|(from, buf, _, _)| (from, Recv::Copy(buf))),
        timeout,
    )
}

impl ProcessGroup {
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), CommError> {
        let n = self.size();
        if peer >= n || peer == self.rank() {
            return Err(CommError::invalid(
                op,
                format!("peer {peer} must be another rank of this {n}-rank group"),
            ));
        }
        Ok(())
    }

    /// Runs a batch of sends and receives (every peer checked) as one call in issue order:
    /// the i-th send and the i-th receive form one overlapped exchange, so a ring shift or a
    /// swap between two ranks never waits on itself.
    fn p2p_batch(
        &self,
        ticket: Ticket,
        op: &'static str,
        dtype: WireType,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<(), CommError> {
        for &(peer, _) in sends {
            self.check_peer(op, peer)?;
        }
        for (peer, _) in recvs.iter() {
            self.check_peer(op, *peer)?;
        }
        let (timeout, detail, me) = (self.timeout(), self.inner.opts.desync_check, self.rank());
        let elem = dtype.size();
        // The call's number: its first transfer's place in that peer's stream.
        let first = sends.first().map(|s| (true, s.0)).or(recvs.first().map(|r| (false, r.0)));
        let seq_of = move |st: &mut State| match first {
            Some((true, peer)) => st.p2p_sent[peer],
            Some((false, peer)) => st.p2p_recvd[peer],
            None => 0,
        };
        let n_sends = sends.len();
        self.ordered(ticket, op, seq_of, |st, _| {
            // Every transfer's number in its (peer, direction) stream.
            let mut numbers = Vec::with_capacity(sends.len() + recvs.len());
            for &(peer, _) in sends {
                numbers.push(st.p2p_sent[peer]);
                st.p2p_sent[peer] += 1;
            }
            for (peer, _) in recvs.iter() {
                numbers.push(st.p2p_recvd[*peer]);
                st.p2p_recvd[*peer] += 1;
            }
            let t = st.transport.as_mut();
            let mut recv_iter = recvs.iter_mut().enumerate();
            let mut send_iter = sends.iter().enumerate();
            loop {
                let send = send_iter
                    .next()
                    .map(|(i, &(to, data))| (to, data, data.len() / elem, numbers[i]));
                let recv = recv_iter.next().map(|(i, (from, buf))| {
                    let count = buf.len() / elem;
                    (*from, &mut **buf, count, numbers[n_sends + i])
                });
                if send.is_none() && recv.is_none() {
                    return Ok(());
                }
                run_pair(t, Pair { send, recv }, dtype, me, detail, timeout)?;
            }
        })
    }

    /// Sends `buf` to rank `dst` (matched by a `recv` there, in order).
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<(), CommError> {
        self.p2p_batch(
            self.ticket(),
            "send",
            T::DTYPE,
            &[(dst, bytemuck::cast_slice(buf))],
            &mut [],
        )
    }

    /// Receives into `buf` from rank `src` (which must send exactly `buf.len()` elements).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<(), CommError> {
        let mut recvs = [(src, bytemuck::cast_slice_mut(buf))];
        self.p2p_batch(self.ticket(), "recv", T::DTYPE, &[], &mut recvs)
    }

    /// Starts sending `buf` to `dst` (PyTorch's `isend`); `wait()` gives the buffer back.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize) -> Work<Vec<T>> {
        self.spawn_ordered("send", move |pg, ticket| {
            pg.p2p_batch(ticket, "send", T::DTYPE, &[(dst, bytemuck::cast_slice(&buf))], &mut [])?;
            Ok(buf)
        })
    }

    /// Starts receiving `buf.len()` elements from `src` (PyTorch's `irecv`); `wait()` returns
    /// them.
    pub fn irecv<T: Element>(&self, mut buf: Vec<T>, src: usize) -> Work<Vec<T>> {
        self.spawn_ordered("recv", move |pg, ticket| {
            let mut recvs = [(src, bytemuck::cast_slice_mut(&mut buf[..]))];
            pg.p2p_batch(ticket, "recv", T::DTYPE, &[], &mut recvs)?;
            Ok(buf)
        })
    }

    /// Runs `ops` together (PyTorch's `batch_isend_irecv`); `wait()` returns them in the order
    /// given, receives filled. Every rank named must run a matching batch (or matching
    /// `send`/`recv` calls); transfers to one peer arrive in list order.
    pub fn batch_isend_irecv<T: Element>(&self, mut ops: Vec<P2POp<T>>) -> Work<Vec<P2POp<T>>> {
        if let Some(e) = ops.iter().find_map(|o| self.check_peer("batch_isend_irecv", o.peer).err())
        {
            return Work::failed("batch_isend_irecv", e);
        }
        self.spawn_ordered("batch_isend_irecv", move |pg, ticket| {
            let (sends, recvs): (Vec<_>, Vec<_>) =
                ops.iter_mut().partition(|o| o.kind == P2PKind::Send);
            let sends: Vec<(usize, &[u8])> =
                sends.iter().map(|o| (o.peer, bytemuck::cast_slice(&o.buf[..]))).collect();
            let mut recvs: Vec<(usize, &mut [u8])> = recvs
                .into_iter()
                .map(|o| (o.peer, bytemuck::cast_slice_mut(&mut o.buf[..])))
                .collect();
            pg.p2p_batch(ticket, "batch_isend_irecv", T::DTYPE, &sends, &mut recvs)?;
            drop(sends);
            drop(recvs);
            Ok(ops)
        })
    }
}
