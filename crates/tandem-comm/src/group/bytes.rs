//! Byte collectives of any length (`broadcast_bytes`, `all_gather_bytes`): lengths first, then
//! the bytes, every announced length checked against the caller's bound and the host's memory
//! before anything is allocated.

use super::{check_root, Call, ProcessGroup};
use crate::error::CommError;
use crate::transport::{FailKind, PeerError};

impl ProcessGroup {
    /// Copies root's bytes (any length this host's memory can hold) to every rank; other ranks'
    /// `data` is replaced.
    pub fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        self.broadcast_bytes_at_most(data, root, usize::MAX)
    }

    /// [`ProcessGroup::broadcast_bytes`] where the caller knows the most root can send: a
    /// larger announced length is refused before anything is allocated.
    pub fn broadcast_bytes_at_most(
        &self,
        data: &mut Vec<u8>,
        root: usize,
        max_len: usize,
    ) -> Result<(), CommError> {
        check_root("broadcast_bytes", root, self.size())?;
        let len = if self.rank() == root { data.len() } else { 0 };
        let call = Call::new("broadcast_bytes", None, 0, root as u64);
        self.collective(self.ticket(), call, |c| {
            let mut len_buf = (len as u64).to_le_bytes();
            c.broadcast(&mut len_buf, root)?;
            let len = u64::from_le_bytes(len_buf);
            if c.rank != root {
                data.clear();
                alloc_announced(data, len, root, max_len as u64)?;
                data.resize(len as usize, 0);
            }
            c.broadcast(data, root)
        })
    }

    /// Every rank's bytes (any length per rank this host's memory can hold), indexed by rank.
    pub fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.all_gather_bytes_at_most(data, usize::MAX)
    }

    /// [`ProcessGroup::all_gather_bytes`] where the caller knows the most any rank can send: a
    /// larger announced length is refused before anything is allocated.
    pub fn all_gather_bytes_at_most(
        &self,
        data: &[u8],
        max_per_rank: usize,
    ) -> Result<Vec<Vec<u8>>, CommError> {
        let n = self.size();
        let call = Call::new("all_gather_bytes", None, 0, 0);
        let rank = self.rank();
        self.collective(self.ticket(), call, |c| {
            let mut lens = vec![0u8; 8 * n];
            lens[8 * rank..8 * rank + 8].copy_from_slice(&(data.len() as u64).to_le_bytes());
            let bounds: Vec<_> = (0..n).map(|r| 8 * r..8 * r + 8).collect();
            c.all_gather_blocks(&mut lens, &bounds)?;
            let lens: Vec<usize> = lens
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
                .collect();
            let mut offs = vec![0usize; n + 1];
            for r in 0..n {
                offs[r + 1] = offs[r].saturating_add(lens[r]);
            }
            let mut all = Vec::new();
            let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l as u64));
            let biggest = (0..n).max_by_key(|&r| lens[r]).unwrap_or(0);
            if lens[biggest] > max_per_rank {
                alloc_announced(&mut all, lens[biggest] as u64, biggest, max_per_rank as u64)?;
            }
            alloc_announced(&mut all, total, biggest, u64::MAX)?;
            all.resize(offs[n], 0);
            all[offs[rank]..offs[rank + 1]].copy_from_slice(data);
            let bounds: Vec<_> = (0..n).map(|r| offs[r]..offs[r + 1]).collect();
            c.all_gather_blocks(&mut all, &bounds)?;
            Ok(bounds.into_iter().map(|b| all[b].to_vec()).collect())
        })
    }
}

/// Reserves room for a length a peer announced; an absurd length (a peer in another collective
/// without TANDEM_DEBUG=detail) is an error instead of an allocation failure.
/// Reserves `len` bytes a peer announced, after checking them against the caller's `limit` and
/// the memory this host has available: with overcommit an allocation of any size "succeeds" and
/// the OOM killer comes later, so the size is checked before, not by the allocator.
pub(super) fn alloc_announced(
    v: &mut Vec<u8>,
    len: u64,
    peer: usize,
    limit: u64,
) -> Result<(), PeerError> {
    let fail = |why: String| PeerError {
        peer,
        kind: FailKind::Io(format!(
            "announced {len} bytes, {why} (ranks calling different collectives? run with \
             TANDEM_DEBUG=detail)"
        )),
    };
    if len > limit {
        return Err(fail(format!("more than the {limit} this operation can need")));
    }
    // Small lengths cannot exhaust a host: /proc/meminfo is read only for large ones.
    let available = (len > 1 << 26).then(crate::procfs::mem_available).flatten();
    if let Some(available) = available.filter(|&a| len > a) {
        return Err(fail(format!("more than the {available} bytes of memory available")));
    }
    let len = usize::try_from(len).map_err(|_| fail("more than this host can address".into()))?;
    v.try_reserve_exact(len).map_err(|_| fail("which cannot be allocated".into()))
}
