//! Hierarchical all-reduce for groups spanning several hosts: reduce-scatter within each host
//! (shared memory), all-reduce each host's shard across hosts (one ring per local rank, all in
//! parallel, over TCP), all-gather within each host. Every byte crosses the network once per
//! host instead of once per rank, so a host's link carries 2(H-1)/H of the buffer instead of
//! the flat ring's 2(N-1)/N (H hosts, N ranks) — and the intra-host steps run at memory speed.
//! The buffer goes through in pieces (1–4 MiB), pipelined: while piece k crosses the network, piece k+1
//! is reduced within the host and piece k-1 gathered back, so the intra-host steps hide behind
//! the network instead of adding to it. Each sub-group is driven by one thread in a fixed
//! order, the same on every rank.
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

/// Pieces go through the pipeline: about 1/16 of the buffer (a short pipeline fill), between
/// these bounds (per-piece latency below, memory and fill time above).
const PIECE_BYTES: (usize, usize) = (1 << 20, 4 << 20);

impl Hierarchy {
    /// All-reduce of `buf` over the whole group (`world_size` ranks) through the sub-groups.
    pub(crate) fn all_reduce<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        world_size: usize,
    ) -> Result<(), CommError> {
        // Avg is a sum divided once at the end.
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let l = self.local.size();
        let piece_bytes = (std::mem::size_of_val(buf) / 16).clamp(PIECE_BYTES.0, PIECE_BYTES.1);
        // A multiple of the local size: every piece but the last splits evenly into shards and
        // is reduced and gathered in place; only a ragged last piece needs a padded copy.
        let per_piece = (piece_bytes / std::mem::size_of::<T>() / l).max(1) * l;
        let mut pieces: Vec<&mut [T]> = buf.chunks_mut(per_piece).collect();
        // Local thread: reduce-scatter piece k+1 before gathering piece k back; the cross
        // thread all-reduces each piece's shard as soon as it is reduced.
        let (to_cross, cross_in) = std::sync::mpsc::channel::<(usize, Vec<T>)>();
        let (to_local, local_in) = std::sync::mpsc::channel::<(usize, Vec<T>)>();
        std::thread::scope(|scope| {
            let cross = scope.spawn(move || -> Result<(), CommError> {
                for (k, mut shard) in cross_in {
                    self.cross.all_reduce(&mut shard, inner)?;
                    if to_local.send((k, shard)).is_err() {
                        break;
                    }
                }
                Ok(())
            });
            let mut local = || -> Result<(), CommError> {
                let n = pieces.len();
                let mut gathered = 0;
                for k in 0..=n {
                    if k < n {
                        let shard_len = pieces[k].len().div_ceil(l);
                        let mut shard = vec![T::zeroed(); shard_len];
                        if pieces[k].len() == shard_len * l {
                            self.local.reduce_scatter(pieces[k], &mut shard, inner)?;
                        } else {
                            // Padding elements only meet other padding.
                            let mut padded = pieces[k].to_vec();
                            padded.resize(shard_len * l, T::zeroed());
                            self.local.reduce_scatter(&padded, &mut shard, inner)?;
                        }
                        if to_cross.send((k, shard)).is_err() {
                            return Ok(()); // the cross thread failed; its error is returned
                        }
                    }
                    // Gather the oldest pieces in flight: up to piece k-1 while piece k crosses
                    // (all of them once every piece is sent).
                    while gathered < k {
                        let Ok((j, shard)) = local_in.recv() else { return Ok(()) };
                        let piece = &mut pieces[j];
                        if piece.len() == shard.len() * l {
                            self.local.all_gather(&shard, piece)?;
                        } else {
                            let mut padded = vec![T::zeroed(); shard.len() * l];
                            self.local.all_gather(&shard, &mut padded)?;
                            let len = piece.len();
                            piece.copy_from_slice(&padded[..len]);
                        }
                        gathered += 1;
                    }
                }
                Ok(())
            };
            let local_result = local();
            drop(to_cross);
            let cross_result = cross.join().unwrap_or_else(|_| {
                Err(CommError::invalid("all_reduce", "the cross-host thread panicked"))
            });
            local_result.and(cross_result)
        })?;
        if op == ReduceOp::Avg {
            buf.iter_mut().for_each(|x| *x = x.div_count(world_size));
        }
        Ok(())
    }
}
