//! Hierarchical all-reduce for groups spanning several hosts: reduce-scatter within each host
//! (shared memory), all-reduce each host's shard across hosts (one ring per local rank, all in
//! parallel, over TCP), all-gather within each host. Every byte crosses the network once per
//! host instead of once per rank, so a host's link carries 2(H-1)/H of the buffer instead of
//! the flat ring's 2(N-1)/N (H hosts, N ranks) — and the intra-host steps run at memory speed.
//! Chosen automatically when every host has the same number of ranks (more than one);
//! `TANDEM_ALLREDUCE=flat` keeps the flat ring. Small buffers stay flat: three latency-bound
//! steps would cost more than they save.
use crate::element::{Element, ReduceOp};
use crate::error::CommError;
use crate::group::ProcessGroup;

/// Buffers below this many bytes use the flat ring.
pub(crate) const MIN_BYTES: usize = 256 * 1024;

/// This rank's two sub-groups: its host's ranks, and the ranks with its local index on every
/// host.
pub(crate) struct Hierarchy {
    local: ProcessGroup,
    cross: ProcessGroup,
}

/// Creates the sub-groups when the layout allows it; a collective over `world` (every rank
/// calls it with the same arguments, so sub-group ids line up).
pub(crate) fn setup(world: &ProcessGroup, wanted: Option<bool>) -> Result<(), CommError> {
    if wanted == Some(false) || world.size() < 2 {
        return Ok(());
    }
    let hosts = world.host_indices().to_vec();
    let nhosts = hosts.iter().max().map_or(0, |m| m + 1);
    let per_host: Vec<Vec<usize>> =
        (0..nhosts).map(|h| (0..hosts.len()).filter(|&r| hosts[r] == h).collect()).collect();
    let l = per_host[0].len();
    let even = per_host.iter().all(|p| p.len() == l);
    if nhosts < 2 || l < 2 || !even {
        if wanted == Some(true) {
            tracing::warn!(
                "TANDEM_ALLREDUCE=hierarchical: {nhosts} host(s) with {:?} rank(s) each; a \
                 hierarchy needs 2+ hosts with the same number (2+) of ranks; using the flat ring",
                per_host.iter().map(Vec::len).collect::<Vec<_>>()
            );
        }
        return Ok(());
    }
    let mut local = None;
    for ranks in &per_host {
        if let Some(g) = world.new_group(ranks)? {
            local = Some(g);
        }
    }
    let mut cross = None;
    for i in 0..l {
        let ranks: Vec<usize> = per_host.iter().map(|p| p[i]).collect();
        if let Some(g) = world.new_group(&ranks)? {
            cross = Some(g);
        }
    }
    if let (Some(local), Some(cross)) = (local, cross) {
        tracing::info!(hosts = nhosts, per_host = l, "hierarchical all-reduce");
        world.set_hierarchy(Hierarchy { local, cross });
    }
    Ok(())
}

impl Hierarchy {
    /// All-reduce of `buf` over the whole group (`world_size` ranks) through the sub-groups.
    pub(crate) fn all_reduce<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        world_size: usize,
    ) -> Result<(), CommError> {
        let l = self.local.size();
        let shard = buf.len().div_ceil(l);
        // Avg is a sum divided once at the end; padding elements only meet other padding.
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let mut padded: Vec<T> = Vec::with_capacity(shard * l);
        padded.extend_from_slice(buf);
        padded.resize(shard * l, T::zeroed());
        let mut mine = vec![T::zeroed(); shard];
        self.local.reduce_scatter(&padded, &mut mine, inner)?;
        self.cross.all_reduce(&mut mine, inner)?;
        self.local.all_gather(&mine, &mut padded)?;
        buf.copy_from_slice(&padded[..buf.len()]);
        if op == ReduceOp::Avg {
            buf.iter_mut().for_each(|x| *x = x.div_count(world_size));
        }
        Ok(())
    }
}
