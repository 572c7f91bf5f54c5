//! The PartialFC head through a live regroup (`tandem run --live-recovery`): a rank's class
//! centres live on that rank alone, so a dead rank would take them with it. Two things keep them:
//!
//! - **The buddy mirror.** Every `K` steps each rank sends its rows (centres and their optimizer
//!   state) to the next rank of the ring (`r + 1 mod W`), which keeps them in memory: a rank's
//!   death loses at most the `K - 1` newest steps of its rows' training (none at `K = 1`). Cost:
//!   one shard sent and one received per `K` steps, and one shard of memory.
//! - **The regroup plan.** After the world re-forms, every rank announces the row blocks it holds
//!   (its own shard, at its own step; its mirror, at the mirror's step) and every rank computes the
//!   same plan: each class of the new split comes from the newest block that holds it (own rows
//!   before a mirror, then the lowest rank), point to point in one global order (deadlock-free);
//!   classes no block holds (two neighbours lost at once) come from the caller's fallback (the
//!   last checkpoint, else the initial centres), and are counted.
//!
//! Row blocks travel as f32: the centres, then each optimizer row tensor (`momentum_buffer`;
//! AdamW's `exp_avg`, `exp_avg_sq`) in name order. A block without optimizer state (before the
//! first step) gives zeros, which is what SGD's and AdamW's first update assume.
use std::ops::Range;

use serde::{Deserialize, Serialize};
use tandem_comm::{CommError, ProcessGroup};
use tandem_partial_fc::ClassSplit;

use crate::checkpoint::CheckpointError;
use crate::live_entries::{in_ring_order, preference, Preference};

/// Rows `start..start + len` of the head as of `step`: centres and the optimizer's row tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct RowBlock {
    pub start: usize,
    pub len: usize,
    pub step: u64,
    /// `[len, embedding]`, row-major.
    pub weight: Vec<f32>,
    /// The optimizer's row tensors by name (sorted by name), each `[len, embedding]`.
    pub state: Vec<(String, Vec<f32>)>,
}

impl RowBlock {
    fn classes(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    /// Rows `classes` (inside this block) as one f32 message: centres, then each state tensor.
    fn message(&self, classes: &Range<usize>, e: usize) -> Vec<f32> {
        let rows = (classes.start - self.start) * e..(classes.end - self.start) * e;
        let mut out = Vec::with_capacity(rows.len() * (1 + self.state.len()));
        out.extend_from_slice(&self.weight[rows.clone()]);
        for (_, t) in &self.state {
            out.extend_from_slice(&t[rows.clone()]);
        }
        out
    }

    /// Bytes of the rows (what a mirror costs to send and to hold).
    pub fn bytes(&self) -> usize {
        4 * (self.weight.len() + self.state.iter().map(|(_, t)| t.len()).sum::<usize>())
    }
}

/// What one rank holds, as it announces it to the others.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Held {
    start: usize,
    len: usize,
    step: u64,
    /// The rank's own shard (true) or its mirror of a neighbour's.
    own: bool,
    keys: Vec<String>,
}

/// Where one piece of a new shard comes from.
#[derive(Clone, Debug, PartialEq)]
enum Source {
    /// Block `block` of rank `rank`'s announcement.
    Rank { rank: usize, block: usize },
    /// No rank holds these classes.
    Fallback,
}

#[derive(Clone, Debug, PartialEq)]
struct Piece {
    classes: Range<usize>,
    dst: usize,
    from: Source,
}

/// How a rank's new shard was assembled (summed over the world by [`regroup_rows`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegroupCounts {
    /// Rows a rank already held as its own.
    pub kept: u64,
    /// Rows received from the rank that owned them.
    pub moved: u64,
    /// Rows restored from a mirror (the owner is gone).
    pub from_mirror: u64,
    /// Rows from the fallback (the last checkpoint, or the initial centres).
    pub reloaded: u64,
    /// Rows whose source was older than the world's step (steps of head training they lost,
    /// summed over those rows: `rows x steps`).
    pub stale_row_steps: u64,
    /// Bytes sent point to point.
    pub bytes_sent: u64,
}

impl RegroupCounts {
    fn add(&mut self, o: &RegroupCounts) {
        self.kept += o.kept;
        self.moved += o.moved;
        self.from_mirror += o.from_mirror;
        self.reloaded += o.reloaded;
        self.stale_row_steps += o.stale_row_steps;
        self.bytes_sent += o.bytes_sent;
    }
}

impl std::fmt::Display for RegroupCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "head rows: {} kept, {} moved, {} restored from mirrors, {} reloaded; {} row-steps of head training lost; {} KiB moved",
            self.kept,
            self.moved,
            self.from_mirror,
            self.reloaded,
            self.stale_row_steps,
            self.bytes_sent.div_ceil(1024)
        )
    }
}

/// The plan: for every rank of the new world, pieces covering its split in class order.
/// Every rank computes the same plan from the same announcements.
fn plan(held: &[Vec<Held>], classes: usize) -> Vec<Piece> {
    let world = held.len();
    let mut pieces: Vec<Piece> = Vec::new();
    for dst in 0..world {
        let want = ClassSplit::new(classes, world, dst);
        let want = want.start..want.start + want.len;
        // Cut points: the wanted range's ends and every block boundary inside it.
        let mut cuts = vec![want.start, want.end];
        for blocks in held {
            for b in blocks {
                for c in [b.start, b.start + b.len] {
                    if want.contains(&c) {
                        cuts.push(c);
                    }
                }
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let piece = w[0]..w[1];
            let from = best_source(held, &piece, dst);
            match pieces.last_mut() {
                Some(last)
                    if last.dst == dst && last.from == from && last.classes.end == piece.start =>
                {
                    last.classes.end = piece.end
                }
                _ => pieces.push(Piece { classes: piece, dst, from }),
            }
        }
    }
    pieces
}

/// The newest block holding all of `piece`; own rows before a mirror at the same step, the
/// receiving rank itself before others (nothing to send), then the lowest rank.
fn best_source(held: &[Vec<Held>], piece: &Range<usize>, dst: usize) -> Source {
    let mut best: Option<(Preference, Source)> = None;
    for (rank, blocks) in held.iter().enumerate() {
        for (block, b) in blocks.iter().enumerate() {
            if b.start <= piece.start && piece.end <= b.start + b.len {
                let key = preference(b.step, b.own, rank == dst, rank);
                if best.as_ref().is_none_or(|(k, _)| key > *k) {
                    best = Some((key, Source::Rank { rank, block }));
                }
            }
        }
    }
    best.map_or(Source::Fallback, |(_, s)| s)
}

/// Assembles this rank's shard of the new world (`group`) from what every rank holds (`own`
/// and `mirror`), a collective. `fallback(classes)` gives rows no rank holds. `step` is the
/// world's step (the source's), against which staleness is counted. Returns the new shard and
/// the world's counts.
pub fn regroup_rows(
    group: &ProcessGroup,
    classes: usize,
    embedding: usize,
    step: u64,
    own: Option<&RowBlock>,
    mirror: Option<&RowBlock>,
    fallback: &mut dyn FnMut(Range<usize>) -> Result<RowBlock, CheckpointError>,
) -> Result<(RowBlock, RegroupCounts), RegroupError> {
    let (me, world) = (group.rank(), group.size());
    let mine: Vec<(&RowBlock, bool)> =
        own.map(|b| (b, true)).into_iter().chain(mirror.map(|b| (b, false))).collect();
    let announce: Vec<Held> = mine
        .iter()
        .map(|(b, own)| Held {
            start: b.start,
            len: b.len,
            step: b.step,
            own: *own,
            keys: b.state.iter().map(|(k, _)| k.clone()).collect(),
        })
        .collect();
    let bytes = serde_json::to_vec(&announce).map_err(|e| RegroupError::Plan(e.to_string()))?;
    let all = group
        .all_gather_bytes_at_most(&bytes, 1 << 20)
        .map_err(|e| RegroupError::comm("announcing the head rows each rank holds", e))?;
    let mut held = Vec::with_capacity(world);
    for (r, b) in all.iter().enumerate() {
        let h: Vec<Held> = serde_json::from_slice(b)
            .map_err(|e| RegroupError::Plan(format!("rank {r}'s announcement: {e}")))?;
        for x in &h {
            if x.start.checked_add(x.len).is_none_or(|end| end > classes) {
                return Err(RegroupError::Plan(format!(
                    "rank {r} announces classes {}..+{} of a head of {classes}",
                    x.start, x.len
                )));
            }
        }
        held.push(h);
    }
    // The optimizer's row tensors: the names any block has (a block without gives zeros).
    let mut keys: Vec<String> = held.iter().flatten().flat_map(|h| h.keys.clone()).collect();
    keys.sort();
    keys.dedup();
    let pieces = plan(&held, classes);
    let want = ClassSplit::new(classes, world, me);
    let e = embedding;
    let mut out = RowBlock {
        start: want.start,
        len: want.len,
        step,
        weight: vec![0.0; want.len * e],
        state: keys.iter().map(|k| (k.clone(), vec![0.0; want.len * e])).collect(),
    };
    let mut counts = RegroupCounts::default();
    for p in &pieces {
        let rows = p.classes.len();
        match &p.from {
            Source::Rank { rank, block } => {
                let h = &held[*rank][*block];
                if p.dst == me {
                    let n = rows * e * (1 + h.keys.len());
                    let data = if *rank == me {
                        mine[*block].0.message(&p.classes, e)
                    } else {
                        let mut buf = vec![0f32; n];
                        group.recv(&mut buf, *rank).map_err(|err| {
                            RegroupError::comm(
                                &format!("receiving head rows from rank {rank}"),
                                err,
                            )
                        })?;
                        buf
                    };
                    place(&mut out, &p.classes, &h.keys, &data, e);
                    let c = &mut counts;
                    match (*rank == me && h.own, h.own) {
                        (true, _) => c.kept += rows as u64,
                        (false, true) => c.moved += rows as u64,
                        (false, false) => c.from_mirror += rows as u64,
                    }
                    c.stale_row_steps += rows as u64 * step.saturating_sub(h.step);
                } else if *rank == me {
                    let data = mine[*block].0.message(&p.classes, e);
                    group.send(&data, p.dst).map_err(|err| {
                        RegroupError::comm(&format!("sending head rows to rank {}", p.dst), err)
                    })?;
                    counts.bytes_sent += 4 * data.len() as u64;
                }
            }
            Source::Fallback if p.dst == me => {
                let b = fallback(p.classes.clone()).map_err(RegroupError::Fallback)?;
                if b.classes() != p.classes {
                    return Err(RegroupError::Plan(format!(
                        "rows no rank holds: asked for classes {:?}, got {:?}",
                        p.classes,
                        b.classes()
                    )));
                }
                let names: Vec<String> = b.state.iter().map(|(k, _)| k.clone()).collect();
                place(&mut out, &p.classes, &names, &b.message(&p.classes, e), e);
                counts.reloaded += rows as u64;
                counts.stale_row_steps += rows as u64 * step.saturating_sub(b.step);
            }
            Source::Fallback => {}
        }
    }
    // The world's counts, for the regroup's line.
    let mine_counts = serde_json::to_vec(&counts).map_err(|e| RegroupError::Plan(e.to_string()))?;
    let all = group
        .all_gather_bytes_at_most(&mine_counts, 4096)
        .map_err(|e| RegroupError::comm("summing the regroup's counts", e))?;
    let mut total = RegroupCounts::default();
    for b in all {
        let c: RegroupCounts =
            serde_json::from_slice(&b).map_err(|e| RegroupError::Plan(e.to_string()))?;
        total.add(&c);
    }
    Ok((out, total))
}

/// Writes a piece's message (centres, then the tensors `keys` in order) into `out`'s rows;
/// state tensors the message lacks stay zero.
fn place(out: &mut RowBlock, classes: &Range<usize>, keys: &[String], data: &[f32], e: usize) {
    let n = classes.len() * e;
    let at = (classes.start - out.start) * e;
    out.weight[at..at + n].copy_from_slice(&data[..n]);
    for (i, k) in keys.iter().enumerate() {
        if let Some((_, t)) = out.state.iter_mut().find(|(name, _)| name == k) {
            t[at..at + n].copy_from_slice(&data[(i + 1) * n..(i + 2) * n]);
        }
    }
}

/// The ring exchange of the buddy mirror (a collective): sends `own` to rank `r + 1` and
/// returns rank `r - 1`'s block. Even ranks send first, odd ranks receive first, so the ring
/// never waits on itself. `None` in a world of one. What arrives is bounded by the head's shape
/// (`classes` x `embedding`) before anything is allocated.
pub fn exchange_mirror(
    group: &ProcessGroup,
    own: &RowBlock,
    classes: usize,
    embedding: usize,
) -> Result<Option<RowBlock>, RegroupError> {
    let (me, world) = (group.rank(), group.size());
    if world < 2 {
        return Ok(None);
    }
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let names = own.state.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join("\n");
    let send = || -> Result<(), RegroupError> {
        let fail = |e| RegroupError::comm(&format!("sending this rank's rows to rank {next}"), e);
        let header = [own.start, own.len, own.step as usize, own.state.len(), names.len()];
        group.send(&header.map(|v| v as i64), next).map_err(fail)?;
        group.send(&own.message(&own.classes(), embedding), next).map_err(fail)?;
        group.send(names.as_bytes(), next).map_err(fail)
    };
    let recv = || -> Result<RowBlock, RegroupError> {
        let fail = |e| RegroupError::comm(&format!("receiving rank {prev}'s rows"), e);
        let mut h = [0i64; 5];
        group.recv(&mut h, prev).map_err(fail)?;
        let [start, len, step, nkeys, names_len] =
            h.map(|v| usize::try_from(v).unwrap_or(usize::MAX));
        if start.checked_add(len).is_none_or(|end| end > classes) || nkeys > 8 || names_len > 4096 {
            return Err(RegroupError::Plan(format!(
                "rank {prev} sent a mirror header {h:?} that does not fit a head of {classes} classes"
            )));
        }
        let n = len * embedding;
        let mut data = vec![0f32; n * (1 + nkeys)];
        group.recv(&mut data, prev).map_err(fail)?;
        let mut names = vec![0u8; names_len];
        group.recv(&mut names, prev).map_err(fail)?;
        let names = String::from_utf8(names)
            .map_err(|_| RegroupError::Plan(format!("rank {prev} sent non-UTF-8 state names")))?;
        let names: Vec<String> =
            if nkeys == 0 { Vec::new() } else { names.split('\n').map(String::from).collect() };
        if names.len() != nkeys {
            return Err(RegroupError::Plan(format!(
                "rank {prev} sent {} state names for {nkeys} tensors",
                names.len()
            )));
        }
        let mut chunks = data.chunks_exact(n.max(1)).map(<[f32]>::to_vec);
        let weight = if n == 0 { Vec::new() } else { chunks.next().unwrap_or_default() };
        let state = names
            .into_iter()
            .map(|k| (k, if n == 0 { Vec::new() } else { chunks.next().unwrap_or_default() }))
            .collect();
        Ok(RowBlock { start, len, step: step as u64, weight, state })
    };
    Ok(Some(in_ring_order(me, send, recv)?))
}

/// Why the head could not be regrouped.
#[derive(Debug, thiserror::Error)]
pub enum RegroupError {
    #[error("regrouping the PartialFC head: {what}")]
    Comm {
        what: String,
        #[source]
        source: CommError,
    },
    #[error("regrouping the PartialFC head: {0}")]
    Plan(String),
    #[error("regrouping the PartialFC head: reading rows no rank holds")]
    Fallback(#[source] CheckpointError),
}

impl RegroupError {
    fn comm(what: &str, source: CommError) -> Self {
        RegroupError::Comm { what: what.to_string(), source }
    }
}
