//! Collective algorithms over a point-to-point transport, on raw bytes. Ring reduce-scatter +
//! all-gather for all_reduce (bandwidth-optimal: each rank sends 2(n-1)/n of the buffer), a
//! pipelined chain for broadcast, rings for all_gather / reduce_scatter / barrier, and direct
//! sends for gather / scatter. Ranks here are group ranks.
use crate::element::{ReduceOp, WireType};
use crate::transport::{PeerError, Recv, Transport};
use std::ops::Range;
use std::time::Duration;

/// Segment size of the pipelined broadcast chain.
const BCAST_SEGMENT: usize = 256 << 10;

pub(crate) type ReduceFn<'a> = &'a (dyn Fn(&mut [u8], &[u8]) + Sync);

/// A reduction: the element type and operator (what a library such as MPI runs natively) and
/// the byte-level function tandem's ring applies.
#[derive(Clone, Copy)]
pub(crate) struct Reduction<'a> {
    pub dtype: WireType,
    pub op: ReduceOp,
    pub f: ReduceFn<'a>,
}

/// A reduce-scatter's input: the caller's, which the ring reduces into a copy of, or a buffer
/// handed over for the ring to reduce into in place (an async reduce-scatter owns its input:
/// no copy of it, no fresh pages for one).
pub(crate) enum ScatterInput<'a> {
    Shared(&'a [u8]),
    Scratch(&'a mut [u8]),
}

impl ScatterInput<'_> {
    pub fn bytes(&self) -> &[u8] {
        match self {
            ScatterInput::Shared(b) => b,
            ScatterInput::Scratch(b) => b,
        }
    }
}

pub(crate) struct Ctx<'a> {
    pub t: &'a mut dyn Transport,
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
}

/// Element range of chunk `i` when `count` elements are split into `n` near-equal chunks.
pub(crate) fn chunk(count: usize, n: usize, i: usize) -> Range<usize> {
    let base = count / n;
    let extra = count % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// `(&buf[a], &mut buf[b])` for disjoint ranges.
fn split(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn bytes(r: Range<usize>, elem: usize) -> Range<usize> {
    r.start * elem..r.end * elem
}

impl Ctx<'_> {
    fn right(&self) -> usize {
        (self.rank + 1) % self.size
    }
    fn left(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Ring reduce-scatter over `bounds` (byte ranges, one per rank); afterwards this rank's
    /// block `(rank + owner_offset) % n` holds the full reduction.
    fn ring_reduce_scatter(
        &mut self,
        buf: &mut [u8],
        bounds: &[Range<usize>],
        owner_offset: usize,
        elem: usize,
        f: ReduceFn<'_>,
    ) -> Result<(), PeerError> {
        let n = self.size;
        let (right, left) = (self.right(), self.left());
        for s in 0..n - 1 {
            let send_i = (self.rank + owner_offset + 2 * n - 1 - s) % n;
            let recv_i = (self.rank + owner_offset + 2 * n - 2 - s) % n;
            let (out, into) = split(buf, bounds[send_i].clone(), bounds[recv_i].clone());
            self.t.exchange(
                Some((right, out)),
                Some((left, Recv::Reduce { dst: into, elem, f })),
                self.timeout,
            )?;
        }
        Ok(())
    }

    /// Ring all-gather over `bounds`: this rank starts with block `(rank + owner_offset) % n`.
    fn ring_all_gather(
        &mut self,
        buf: &mut [u8],
        bounds: &[Range<usize>],
        owner_offset: usize,
    ) -> Result<(), PeerError> {
        let n = self.size;
        let (right, left) = (self.right(), self.left());
        for s in 0..n - 1 {
            let send_i = (self.rank + owner_offset + n - s) % n;
            let recv_i = (self.rank + owner_offset + 2 * n - 1 - s) % n;
            let (out, into) = split(buf, bounds[send_i].clone(), bounds[recv_i].clone());
            self.t.exchange(Some((right, out)), Some((left, Recv::Copy(into))), self.timeout)?;
        }
        Ok(())
    }

    /// The transport library's all_reduce where it has one for this type (MPI), else the ring
    /// reduce-scatter + all-gather.
    pub fn all_reduce(&mut self, buf: &mut [u8], r: Reduction<'_>) -> Result<(), PeerError> {
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        let timeout = self.timeout;
        if let Some(n) = self.t.native() {
            if n.all_reduce(buf, r.dtype, r.op, timeout)? {
                return Ok(());
            }
        }
        let elem = r.dtype.size();
        let count = buf.len() / elem;
        let bounds: Vec<_> =
            (0..self.size).map(|i| bytes(chunk(count, self.size, i), elem)).collect();
        self.ring_reduce_scatter(buf, &bounds, 1, elem, r.f)?;
        self.ring_all_gather(buf, &bounds, 1)
    }

    /// `input` is `size` blocks of `output.len()` bytes; this rank gets the reduction of block `rank`.
    pub fn reduce_scatter(
        &mut self,
        input: ScatterInput<'_>,
        output: &mut [u8],
        r: Reduction<'_>,
    ) -> Result<(), PeerError> {
        let m = output.len();
        if self.size == 1 {
            output.copy_from_slice(input.bytes());
            return Ok(());
        }
        let timeout = self.timeout;
        if let Some(n) = self.t.native() {
            if n.reduce_scatter(input.bytes(), output, r.dtype, r.op, timeout)? {
                return Ok(());
            }
        }
        let mut copy = Vec::new();
        let work = match input {
            ScatterInput::Shared(s) => {
                copy.extend_from_slice(s);
                &mut copy[..]
            }
            ScatterInput::Scratch(s) => s,
        };
        let bounds: Vec<_> = (0..self.size).map(|i| i * m..(i + 1) * m).collect();
        self.ring_reduce_scatter(work, &bounds, 0, r.dtype.size(), r.f)?;
        output.copy_from_slice(&work[bounds[self.rank].clone()]);
        Ok(())
    }

    /// `buf` holds every rank's block at `bounds[r]`; this rank's own block is already in place.
    pub fn all_gather_blocks(
        &mut self,
        buf: &mut [u8],
        bounds: &[Range<usize>],
    ) -> Result<(), PeerError> {
        if self.size == 1 {
            return Ok(());
        }
        let timeout = self.timeout;
        if let Some(n) = self.t.native() {
            return n.all_gather_blocks(buf, bounds, timeout);
        }
        self.ring_all_gather(buf, bounds, 0)
    }

    /// Pipelined chain from `root` around the ring.
    pub fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), PeerError> {
        let n = self.size;
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let timeout = self.timeout;
        if let Some(native) = self.t.native() {
            return native.broadcast(buf, root, timeout);
        }
        let pos = (self.rank + n - root) % n;
        let (right, left) = (self.right(), self.left());
        let segs = buf.len().div_ceil(BCAST_SEGMENT);
        let len = buf.len();
        let seg = |k: usize| k * BCAST_SEGMENT..((k + 1) * BCAST_SEGMENT).min(len);
        for k in 0..=segs {
            let (send_r, recv_r) = if pos == 0 {
                (if k < segs { Some(seg(k)) } else { None }, None)
            } else {
                let fwd = if pos < n - 1 && k >= 1 { Some(seg(k - 1)) } else { None };
                (fwd, if k < segs { Some(seg(k)) } else { None })
            };
            let (out, into) =
                split(buf, send_r.clone().unwrap_or(0..0), recv_r.clone().unwrap_or(0..0));
            self.t.exchange(
                send_r.map(|_| (right, out)),
                recv_r.map(|_| (left, Recv::Copy(into))),
                self.timeout,
            )?;
        }
        Ok(())
    }

    /// Every rank has arrived once the ring has carried a token from every rank.
    pub fn barrier(&mut self) -> Result<(), PeerError> {
        let timeout = self.timeout;
        if let Some(n) = self.t.native() {
            return n.barrier(timeout);
        }
        let mut tokens = vec![0u8; self.size];
        let bounds: Vec<_> = (0..self.size).map(|i| i..i + 1).collect();
        self.all_gather_blocks(&mut tokens, &bounds)
    }

    /// Root receives block r from rank r.
    pub fn gather(
        &mut self,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: usize,
    ) -> Result<(), PeerError> {
        let timeout = self.timeout;
        if let Some(n) = self.t.native() {
            return n.gather(input, output, root, timeout);
        }
        let m = input.len();
        if self.rank != root {
            return self.t.exchange(Some((root, input)), None, self.timeout);
        }
        let Some(out) = output else { return Ok(()) };
        for r in 0..self.size {
            if r == root {
                out[r * m..(r + 1) * m].copy_from_slice(input);
            } else {
                self.t.exchange(
                    None,
                    Some((r, Recv::Copy(&mut out[r * m..(r + 1) * m]))),
                    self.timeout,
                )?;
            }
        }
        Ok(())
    }

    /// Root sends block r to rank r.
    pub fn scatter(
        &mut self,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: usize,
    ) -> Result<(), PeerError> {
        let timeout = self.timeout;
        if let Some(n) = self.t.native() {
            return n.scatter(input, output, root, timeout);
        }
        let m = output.len();
        if self.rank != root {
            return self.t.exchange(None, Some((root, Recv::Copy(output))), self.timeout);
        }
        let Some(inp) = input else { return Ok(()) };
        for r in 0..self.size {
            if r == root {
                output.copy_from_slice(&inp[r * m..(r + 1) * m]);
            } else {
                self.t.exchange(Some((r, &inp[r * m..(r + 1) * m])), None, self.timeout)?;
            }
        }
        Ok(())
    }
}

/// Byte ranges of `counts` elements of `elem` bytes laid end to end.
pub(crate) fn ranges(counts: &[usize], elem: usize) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            let r = start..start + c * elem;
            start = r.end;
            r
        })
        .collect()
}

impl Ctx<'_> {
    /// Root gets the reduction of every rank's `buf`: a ring reduce-scatter on a copy (rank r
    /// ends with chunk r reduced), then every rank sends its chunk to root. Other ranks' `buf`
    /// is left as it was.
    pub fn reduce(
        &mut self,
        buf: &mut [u8],
        root: usize,
        r: Reduction<'_>,
    ) -> Result<(), PeerError> {
        let n = self.size;
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let elem = r.dtype.size();
        let count = buf.len() / elem;
        let bounds: Vec<_> = (0..n).map(|i| bytes(chunk(count, n, i), elem)).collect();
        let mut work = buf.to_vec();
        self.ring_reduce_scatter(&mut work, &bounds, 0, elem, r.f)?;
        let mine = bounds[self.rank].clone();
        if self.rank != root {
            return self.t.exchange(Some((root, &work[mine])), None, self.timeout);
        }
        buf[mine.clone()].copy_from_slice(&work[mine]);
        for (from, b) in bounds.iter().enumerate().filter(|(from, _)| *from != root) {
            self.t.exchange(None, Some((from, Recv::Copy(&mut buf[b.clone()]))), self.timeout)?;
        }
        Ok(())
    }

    /// Every rank sends `send[j]` to rank j and receives rank j's block into `recv[j]`, in
    /// n - 1 pairwise rounds (round s: to rank + s, from rank - s). Each round first swaps the
    /// element counts, so split sizes that disagree between two ranks fail naming both instead
    /// of shifting every later byte of the stream.
    pub fn all_to_all(
        &mut self,
        send: &[&[u8]],
        recv: &mut [&mut [u8]],
        elem: usize,
    ) -> Result<(), PeerError> {
        let (n, me) = (self.size, self.rank);
        recv[me].copy_from_slice(send[me]);
        for s in 1..n {
            let (to, from) = ((me + s) % n, (me + n - s) % n);
            let announce = ((send[to].len() / elem) as u64).to_le_bytes();
            let mut announced = [0u8; 8];
            self.t.exchange(
                Some((to, &announce)),
                Some((from, Recv::Copy(&mut announced))),
                self.timeout,
            )?;
            let (theirs, expect) = (u64::from_le_bytes(announced), recv[from].len() / elem);
            if theirs != expect as u64 {
                return Err(PeerError {
                    peer: from,
                    kind: crate::transport::FailKind::Io(format!(
                        "rank {from} sends {theirs} elements to rank {me}, which expects {expect} \
                         (split sizes disagree between the two ranks)"
                    )),
                });
            }
            self.t.exchange(
                Some((to, send[to])),
                Some((from, Recv::Copy(&mut *recv[from]))),
                self.timeout,
            )?;
        }
        Ok(())
    }

    /// Root receives rank r's `input` into `out[at[r]]` (lengths may differ by rank; root
    /// knows them). Runs over `exchange` on every transport.
    pub fn gather_ranges(
        &mut self,
        input: &[u8],
        out: Option<(&mut [u8], &[Range<usize>])>,
        root: usize,
    ) -> Result<(), PeerError> {
        if self.rank != root {
            return self.t.exchange(Some((root, input)), None, self.timeout);
        }
        let Some((out, at)) = out else { return Ok(()) };
        for (from, b) in at.iter().enumerate() {
            if from == root {
                out[b.clone()].copy_from_slice(input);
            } else {
                self.t.exchange(
                    None,
                    Some((from, Recv::Copy(&mut out[b.clone()]))),
                    self.timeout,
                )?;
            }
        }
        Ok(())
    }

    /// Root sends `input[at[r]]` to rank r, which receives it into `output`.
    pub fn scatter_ranges(
        &mut self,
        input: Option<(&[u8], &[Range<usize>])>,
        output: &mut [u8],
        root: usize,
    ) -> Result<(), PeerError> {
        if self.rank != root {
            return self.t.exchange(None, Some((root, Recv::Copy(output))), self.timeout);
        }
        let Some((input, at)) = input else { return Ok(()) };
        for (to, b) in at.iter().enumerate() {
            if to == root {
                output.copy_from_slice(&input[b.clone()]);
            } else {
                self.t.exchange(Some((to, &input[b.clone()])), None, self.timeout)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_in_order() {
        for count in [0, 1, 7, 10, 1000] {
            for n in 1..6 {
                let mut next = 0;
                for i in 0..n {
                    let c = chunk(count, n, i);
                    assert_eq!(c.start, next);
                    next = c.end;
                }
                assert_eq!(next, count);
            }
        }
    }
}
