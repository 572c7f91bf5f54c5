//! State that each rank holds alone — ZeRO-1's optimizer shards, PartialFC's class rows, Fsdp's
//! shards — kept through a live regroup (`tandem run --live-recovery`), written once for every
//! such part:
//!
//! - **The buddy mirror.** Every `K` steps each rank sends its part to the next rank of the ring
//!   (`r + 1 mod W`), which keeps it in memory: a rank's death loses at most the `K - 1` newest
//!   steps of its part's training (none at `K = 1`). Cost: one part sent and one received per
//!   `K` steps, and one part of memory.
//! - **The re-split.** After the world re-forms, every rank announces the key ranges it holds
//!   (its own part, at its step; its mirror, at the mirror's step) and every rank computes the
//!   same plan from the ranges the new world wants: each piece from the newest holder (its own
//!   part before a mirror, then the receiving rank itself, then the lowest rank), point to point
//!   in one global order — deadlock-free, as every rank walks the same list. Keys nobody holds
//!   (two neighbours lost at once) come from the caller's `fill` (the last checkpoint) or start
//!   afresh, and are counted.
//!
//! A part covers ranges of keys `0..keys` (parameter indices, class rows); [`RankPart`] says how
//! its keys travel and how a new part is put together from pieces. [`Mirrored`] is what a recipe
//! keeps: the mirror, whether it holds a part, as of which step, and what the mirrors cost.
use std::ops::Range;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tandem_comm::{CommError, ProcessGroup};

use super::{MirrorCost, RegroupCounts};
use crate::error::{bail, Context};
use crate::{Result, TrainError};

/// Bound on one rank's announcement and on a part's header (ranges and labels).
const MAX_HEADER: usize = 16 << 20;
/// Bound on the labels a part carries, and on each one's length.
const MAX_LABELS: usize = 64;
const MAX_LABEL_LEN: usize = 256;

/// A part as it is announced and sent: the keys it covers, the step it is as of, and the
/// names of what every key carries (the optimizer's row tensors; empty where a key carries one
/// opaque value).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartHeader {
    /// Key ranges `[start, end)`, ascending and disjoint.
    pub ranges: Vec<(usize, usize)>,
    pub step: u64,
    /// Sorted.
    pub labels: Vec<String>,
}

impl PartHeader {
    fn ranges(&self) -> Vec<Range<usize>> {
        self.ranges.iter().map(|&(s, e)| s..e).collect()
    }

    fn holds(&self, piece: &Range<usize>) -> bool {
        self.ranges.iter().any(|&(s, e)| s <= piece.start && piece.end <= e)
    }

    /// Checks what a peer sent before it is used: ranges inside `0..keys`, ascending and
    /// disjoint; labels bounded.
    fn check(&self, keys: usize) -> Result<()> {
        let mut end = 0;
        for &(s, e) in &self.ranges {
            if s < end || s >= e || e > keys {
                bail!("keys {s}..{e} are not ascending, disjoint ranges inside 0..{keys}");
            }
            end = e;
        }
        if self.labels.len() > MAX_LABELS || self.labels.iter().any(|l| l.len() > MAX_LABEL_LEN) {
            bail!("{} labels, at most {MAX_LABELS} allowed", self.labels.len());
        }
        Ok(())
    }
}

/// The ranges of ascending `keys`, each run of consecutive keys one range.
pub fn runs(keys: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for k in keys {
        match out.last_mut() {
            Some(r) if r.end == k => r.end += 1,
            _ => out.push(k..k + 1),
        }
    }
    out
}

/// State one rank holds alone over ranges of keys, that a live regroup must not lose.
pub trait RankPart: Sized {
    /// What the part is, in errors (`the PartialFC head's rows`).
    const WHAT: &'static str;

    /// The keys held, as of which step, and what each key carries.
    fn header(&self) -> PartHeader;

    /// Keys `keys` (inside this part's ranges) as one message.
    fn encode(&self, keys: &[Range<usize>]) -> Result<Vec<u8>>;

    /// The part [`RankPart::encode`] wrote, as `header` describes it (a peer's bytes: check
    /// them).
    fn decode(header: &PartHeader, bytes: Vec<u8>) -> Result<Self>;

    /// Keys `keys` of this part, without a trip through bytes.
    fn take(&self, keys: &Range<usize>) -> Result<Self>;

    /// This rank's new part: `want` from `pieces` (in key order; keys no piece covers start
    /// afresh), as of `step`, carrying every label of the world (`labels`).
    fn assemble(
        want: &[Range<usize>],
        step: u64,
        labels: &[String],
        pieces: Vec<Self>,
    ) -> Result<Self>;
}

/// What `P` was doing, as the context of its failure.
fn of<P: RankPart>(what: impl std::fmt::Display) -> String {
    format!("{}: {what}", P::WHAT)
}

fn invalid<P: RankPart>(what: impl std::fmt::Display) -> TrainError {
    TrainError::Invalid(of::<P>(what))
}

fn comm<P: RankPart>(what: &str) -> impl FnOnce(CommError) -> TrainError {
    crate::error::comm(of::<P>(what))
}

/// What fills keys no rank holds: `Some` part covering exactly them, or `None` (fresh state).
pub type Fill<'a, P> = dyn FnMut(Range<usize>) -> Result<Option<P>> + 'a;

fn send_bytes<P: RankPart>(
    group: &ProcessGroup,
    bytes: &[u8],
    to: usize,
    what: &str,
) -> Result<()> {
    let fail = || format!("{what} to rank {to}");
    group.send(&[bytes.len() as i64], to).map_err(comm::<P>(&fail()))?;
    group.send(bytes, to).map_err(comm::<P>(&fail()))
}

/// A length-prefixed message from `from`, its length bounded by `limit` and by the memory
/// the host has free before anything is allocated.
fn recv_bytes<P: RankPart>(
    group: &ProcessGroup,
    from: usize,
    limit: usize,
    what: &str,
) -> Result<Vec<u8>> {
    let fail = || format!("{what} from rank {from}");
    let mut len = [0i64];
    group.recv(&mut len, from).map_err(comm::<P>(&fail()))?;
    let available = tandem_comm::procfs::mem_available().unwrap_or(u64::MAX);
    let len = usize::try_from(len[0])
        .ok()
        .filter(|&n| n <= limit && (n as u64) <= available)
        .ok_or_else(|| {
            invalid::<P>(format!(
                "rank {from} announced {} bytes (at most {limit}; {available} bytes are free)",
                len[0]
            ))
        })?;
    let mut buf = vec![0u8; len];
    group.recv(&mut buf, from).map_err(comm::<P>(&fail()))?;
    Ok(buf)
}

/// One ring step — send to the next rank, receive from the previous — in an order that cannot
/// wait on itself: even ranks send first, odd ranks receive first (in an odd ring the last,
/// even rank sends to rank 0, which receives once its own send is taken).
fn in_ring_order<T, E>(
    me: usize,
    send: impl FnOnce() -> Result<(), E>,
    recv: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    if me.is_multiple_of(2) {
        send()?;
        recv()
    } else {
        let got = recv()?;
        send()?;
        Ok(got)
    }
}

/// Sends `own` to the next rank of the ring and returns the previous rank's part (a
/// collective). `None` in a world of one. `keys` bounds the key ranges a peer may announce.
pub fn exchange_mirror<P: RankPart>(
    group: &ProcessGroup,
    own: &P,
    keys: usize,
) -> Result<Option<P>> {
    Ok(exchange_counted(group, own, keys)?.map(|(p, _)| p))
}

/// [`exchange_mirror`], with the bytes this rank sent.
fn exchange_counted<P: RankPart>(
    group: &ProcessGroup,
    own: &P,
    keys: usize,
) -> Result<Option<(P, usize)>> {
    let got = exchange_parts(group, own, keys, true, true)?;
    Ok(got.and_then(|(p, n)| Some((p?, n))))
}

/// The ring exchange of [`exchange_mirror`]; what a re-split already put in place is left out:
/// with `send_own` false this rank sends nothing (the next rank holds its part), with `receive`
/// false it receives nothing (it holds the previous rank's; `None` for it then). Returns the
/// previous rank's part and the bytes sent; `None` in a world of one.
fn exchange_parts<P: RankPart>(
    group: &ProcessGroup,
    own: &P,
    keys: usize,
    send_own: bool,
    receive: bool,
) -> Result<Option<(Option<P>, usize)>> {
    let (me, world) = (group.rank(), group.size());
    if world < 2 {
        return Ok(None);
    }
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let header = own.header();
    let bytes = match send_own {
        true => own.encode(&header.ranges()).with_context(|| P::WHAT)?,
        false => Vec::new(),
    };
    let header_bytes = serde_json::to_vec(&header).with_context(|| P::WHAT)?;
    let send = || {
        if !send_own {
            return Ok(());
        }
        send_bytes::<P>(group, &header_bytes, next, "sending this rank's part")?;
        send_bytes::<P>(group, &bytes, next, "sending this rank's part")
    };
    let recv = || {
        if !receive {
            return Ok(None);
        }
        let what = "receiving the previous rank's part";
        let h = recv_bytes::<P>(group, prev, MAX_HEADER, what)?;
        let h: PartHeader = serde_json::from_slice(&h)
            .with_context(|| of::<P>(format!("rank {prev}'s mirror header")))?;
        h.check(keys).with_context(|| of::<P>(format!("rank {prev}'s mirror")))?;
        let bytes = recv_bytes::<P>(group, prev, usize::MAX, what)?;
        P::decode(&h, bytes).map(Some).with_context(|| of::<P>(format!("rank {prev}'s mirror")))
    };
    let got = in_ring_order(me, send, recv)?;
    Ok(Some((got, bytes.len())))
}

/// What a re-split already put where the mirror taken right after it would: the previous
/// rank's new part, when this rank sent every piece of it (kept here as its mirror instead of
/// coming back over the network), and whether the next rank sent this rank every piece of its
/// new part (it keeps them likewise). Every rank reads both from the same plan.
pub(crate) struct SentAsMirror<P> {
    prev: Option<P>,
    next_has_mine: bool,
}

impl<P> SentAsMirror<P> {
    fn none() -> Self {
        SentAsMirror { prev: None, next_has_mine: false }
    }
}

/// What one rank holds, as it announces it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Held {
    header: PartHeader,
    /// The rank's own part (true) or its mirror of a neighbour's.
    own: bool,
}

/// Where one piece of a new part comes from: block `block` of rank `rank`'s announcement, or
/// nobody.
type Source = Option<(usize, usize)>;

#[derive(Clone, Debug, PartialEq)]
struct Piece {
    keys: Range<usize>,
    dst: usize,
    from: Source,
}

/// Which of several copies of the same keys a re-split takes, compared as a tuple: the newer
/// step, then the holder's own copy before a mirror, then the receiving rank itself (nothing to
/// send), then the lower rank.
type Preference = (u64, bool, bool, std::cmp::Reverse<usize>);

/// The plan: for every rank of the new world, pieces covering what it wants, in key order.
/// Every rank computes the same plan from the same announcements.
fn plan(held: &[Vec<Held>], want: &dyn Fn(usize) -> Vec<Range<usize>>) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    for dst in 0..held.len() {
        for wanted in want(dst) {
            // Cut points: the wanted range's ends and every held boundary inside it.
            let mut cuts = vec![wanted.start, wanted.end];
            for (s, e) in held.iter().flatten().flat_map(|h| h.header.ranges.iter().copied()) {
                cuts.extend([s, e].into_iter().filter(|c| wanted.contains(c)));
            }
            cuts.sort_unstable();
            cuts.dedup();
            for w in cuts.windows(2) {
                let keys = w[0]..w[1];
                let from = best_source(held, &keys, dst);
                match pieces.last_mut() {
                    Some(last)
                        if last.dst == dst && last.from == from && last.keys.end == keys.start =>
                    {
                        last.keys.end = keys.end
                    }
                    _ => pieces.push(Piece { keys, dst, from }),
                }
            }
        }
    }
    pieces
}

fn best_source(held: &[Vec<Held>], keys: &Range<usize>, dst: usize) -> Source {
    let mut best: Option<(Preference, (usize, usize))> = None;
    for (rank, blocks) in held.iter().enumerate() {
        for (block, h) in blocks.iter().enumerate() {
            if h.header.holds(keys) {
                let key = (h.header.step, h.own, rank == dst, std::cmp::Reverse(rank));
                if best.as_ref().is_none_or(|(k, _)| key > *k) {
                    best = Some((key, (rank, block)));
                }
            }
        }
    }
    best.map(|(_, s)| s)
}

/// This rank's part of the new world (`group`), from what every rank holds (`own` and
/// `mirror`); a collective. `want(rank)` is what each rank of the new world is to hold (every
/// rank computes the same), `keys` bounds what a peer may announce, `step` is the world's (the
/// one staleness is counted against), and `fill` gives keys nobody holds. Returns the new part
/// and the world's counts.
pub fn regroup<P: RankPart>(
    group: &ProcessGroup,
    step: u64,
    keys: usize,
    own: Option<&P>,
    mirror: Option<&P>,
    want: &dyn Fn(usize) -> Vec<Range<usize>>,
    fill: &mut Fill<'_, P>,
) -> Result<(P, RegroupCounts)> {
    let (part, counts, _) = resplit(group, step, keys, own, mirror, want, fill, false)?;
    Ok((part, counts))
}

/// [`regroup`], and with `keep_sent` what it already put where the next mirror would
/// ([`SentAsMirror`]: a copy of the pieces this rank sent its predecessor, so only when asked).
#[allow(clippy::too_many_arguments)]
fn resplit<P: RankPart>(
    group: &ProcessGroup,
    step: u64,
    keys: usize,
    own: Option<&P>,
    mirror: Option<&P>,
    want: &dyn Fn(usize) -> Vec<Range<usize>>,
    fill: &mut Fill<'_, P>,
    keep_sent: bool,
) -> Result<(P, RegroupCounts, SentAsMirror<P>)> {
    let me = group.rank();
    let mine: Vec<(&P, Held)> = [(own, true), (mirror, false)]
        .into_iter()
        .filter_map(|(p, own)| p.map(|p| (p, Held { header: p.header(), own })))
        .collect();
    let announce: Vec<&Held> = mine.iter().map(|(_, h)| h).collect();
    let bytes = serde_json::to_vec(&announce).with_context(|| P::WHAT)?;
    let all = group
        .all_gather_bytes_at_most(&bytes, MAX_HEADER)
        .map_err(comm::<P>("announcing what each rank holds"))?;
    let mut held: Vec<Vec<Held>> = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        let h: Vec<Held> = serde_json::from_slice(b)
            .with_context(|| of::<P>(format!("rank {r}'s announcement")))?;
        for x in &h {
            x.header.check(keys).with_context(|| of::<P>(format!("rank {r}'s announcement")))?;
        }
        held.push(h);
    }
    // Every label any block carries (a block without one gives it as zeros).
    let mut labels: Vec<String> =
        held.iter().flatten().flat_map(|h| h.header.labels.iter().cloned()).collect();
    labels.sort();
    labels.dedup();
    let mut counts = RegroupCounts::default();
    let mut pieces: Vec<P> = Vec::new();
    let planned = plan(&held, want);
    for p in &planned {
        let n = p.keys.len() as u64;
        match p.from {
            Some((rank, block)) => {
                let h = &held[rank][block];
                if p.dst == me {
                    let piece = if rank == me {
                        mine[block].0.take(&p.keys).with_context(|| P::WHAT)?
                    } else {
                        let what = "receiving a piece";
                        let bytes = recv_bytes::<P>(group, rank, usize::MAX, what)?;
                        let header = PartHeader {
                            ranges: vec![(p.keys.start, p.keys.end)],
                            step: h.header.step,
                            labels: h.header.labels.clone(),
                        };
                        P::decode(&header, bytes)
                            .with_context(|| of::<P>(format!("rank {rank}'s piece")))?
                    };
                    pieces.push(piece);
                    match (rank == me && h.own, h.own) {
                        (true, _) => counts.kept += n,
                        (false, true) => counts.moved += n,
                        (false, false) => counts.from_mirror += n,
                    }
                    counts.stale_steps += n * step.saturating_sub(h.header.step);
                } else if rank == me {
                    let bytes = mine[block]
                        .0
                        .encode(std::slice::from_ref(&p.keys))
                        .with_context(|| P::WHAT)?;
                    send_bytes::<P>(group, &bytes, p.dst, "sending a piece")?;
                    counts.bytes_sent += bytes.len() as u64;
                }
            }
            None if p.dst == me => {
                let filled = fill(p.keys.clone()).map_err(|source| TrainError::Fill {
                    part: P::WHAT,
                    keys: p.keys.clone(),
                    source: Box::new(source),
                })?;
                match filled {
                    Some(part) => {
                        let header = part.header();
                        if header.ranges != [(p.keys.start, p.keys.end)] {
                            return Err(invalid::<P>(format!(
                                "keys no rank holds: asked for {:?}, got {:?}",
                                p.keys, header.ranges
                            )));
                        }
                        counts.reloaded += n;
                        counts.stale_steps += n * step.saturating_sub(header.step);
                        pieces.push(part);
                    }
                    None => counts.fresh += n,
                }
            }
            None => {}
        }
    }
    let part = P::assemble(&want(me), step, &labels, pieces).with_context(|| P::WHAT)?;
    let world = group.size();
    let sent = match keep_sent && world >= 2 {
        false => SentAsMirror::none(),
        true => {
            let (prev, next) = ((me + world - 1) % world, (me + 1) % world);
            let prev_part = match all_from(&planned, prev, me) {
                false => None,
                true => {
                    let mut taken = Vec::new();
                    for p in planned.iter().filter(|p| p.dst == prev) {
                        let block = p.from.map_or(0, |(_, block)| block);
                        taken.push(mine[block].0.take(&p.keys).with_context(|| P::WHAT)?);
                    }
                    let part = P::assemble(&want(prev), step, &labels, taken);
                    Some(part.with_context(|| P::WHAT)?)
                }
            };
            SentAsMirror { prev: prev_part, next_has_mine: all_from(&planned, me, next) }
        }
    };
    // The world's counts, for the regroup's report.
    let c = serde_json::to_vec(&counts).with_context(|| P::WHAT)?;
    let all = group
        .all_gather_bytes_at_most(&c, 4096)
        .map_err(comm::<P>("summing the re-split's counts"))?;
    let mut total = RegroupCounts::default();
    for b in all {
        let c: RegroupCounts = serde_json::from_slice(&b).with_context(|| P::WHAT)?;
        total.add(&c);
    }
    Ok((part, total, sent))
}

/// Whether rank `dst`'s new part comes, every piece of it, from rank `rank` (and has any).
fn all_from(planned: &[Piece], dst: usize, rank: usize) -> bool {
    let mut pieces = planned.iter().filter(|p| p.dst == dst).peekable();
    pieces.peek().is_some() && pieces.all(|p| p.from.is_some_and(|(r, _)| r == rank))
}

/// A recipe's part under live recovery: the mirror of the previous rank's part, whether this
/// rank holds a part of its own (a replacement holds none until it joins) and as of which step,
/// and what the mirrors cost.
pub struct Mirrored<P> {
    every: u64,
    mirror: Option<P>,
    /// Whether a re-split keeps what it sent for [`Mirrored::exchange_regrouped`].
    keep_sent: bool,
    /// What the last re-split already put in place, until the mirror after it.
    /// (Boxed: a `Mirrored` sits inside models' wrappers, which should stay small.)
    sent: Option<Box<SentAsMirror<P>>>,
    holds: bool,
    step: u64,
    taken: u64,
    secs: f64,
    bytes: u64,
}

impl<P: RankPart> Mirrored<P> {
    /// A mirror every `every` steps; `holds`: whether this rank starts with a part of its own.
    pub fn new(every: u64, holds: bool) -> Self {
        Mirrored {
            every: every.max(1),
            mirror: None,
            keep_sent: false,
            sent: None,
            holds,
            step: 0,
            taken: 0,
            secs: 0.0,
            bytes: 0,
        }
    }

    /// For a part whose mirror right after a regroup is exactly the re-split's result: each
    /// re-split keeps a copy of what this rank sent its predecessor when that is the whole of
    /// its new part, and [`Mirrored::exchange_regrouped`] sends nothing the re-split moved.
    /// (Off by default: a part that rebuilds its own after a re-split would hold the copy for
    /// nothing.)
    pub fn keeping_what_it_sends(mut self) -> Self {
        self.keep_sent = true;
        self
    }

    /// Whether a mirror is due after step `step`.
    pub fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.every)
    }

    /// The previous rank's part, as of the last exchange (none before the first, nor right
    /// after a regroup until the exchange that follows it).
    pub fn mirror(&self) -> Option<&P> {
        self.mirror.as_ref()
    }

    /// Whether this rank holds a part of its own, and as of which step.
    pub fn holds(&self) -> Option<u64> {
        self.holds.then_some(self.step)
    }

    /// This rank's part was updated by step `step`.
    pub fn stepped(&mut self, step: u64) {
        self.step = step;
    }

    /// Sends `own` to the next rank and keeps the previous rank's (a collective), timed from
    /// `clock`.
    pub fn exchange(
        &mut self,
        group: &ProcessGroup,
        own: &P,
        keys: usize,
        clock: Instant,
    ) -> Result<()> {
        self.sent = None;
        let got = exchange_counted(group, own, keys)?;
        self.bytes = got.as_ref().map_or(0, |(_, n)| *n as u64);
        self.mirror = got.map(|(p, _)| p);
        self.taken += 1;
        self.secs += clock.elapsed().as_secs_f64();
        Ok(())
    }

    /// [`Mirrored::exchange`] right after [`Mirrored::regroup`], for a part whose `own` is the
    /// part the re-split returned, unchanged: what the re-split already moved between the two
    /// neighbours is not sent again (a replacement that received its rows from its buddy sends
    /// none back; the buddy keeps what it sent as the mirror).
    pub fn exchange_regrouped(
        &mut self,
        group: &ProcessGroup,
        own: &P,
        keys: usize,
        clock: Instant,
    ) -> Result<()> {
        let Some(sent) = self.sent.take().map(|s| *s) else {
            return self.exchange(group, own, keys, clock);
        };
        let (send_own, receive) = (!sent.next_has_mine, sent.prev.is_none());
        if let Some((received, n)) = exchange_parts(group, own, keys, send_own, receive)? {
            if send_own {
                self.bytes = n as u64;
            }
            self.mirror = sent.prev.or(received);
        }
        self.taken += 1;
        self.secs += clock.elapsed().as_secs_f64();
        Ok(())
    }

    /// [`regroup`] with this rank's mirror; afterwards this rank holds its new part, as of
    /// `step`, and no mirror until the next exchange.
    pub fn regroup(
        &mut self,
        group: &ProcessGroup,
        step: u64,
        keys: usize,
        own: Option<&P>,
        want: &dyn Fn(usize) -> Vec<Range<usize>>,
        fill: &mut Fill<'_, P>,
    ) -> Result<(P, RegroupCounts)> {
        let mirror = self.mirror.as_ref();
        let (part, counts, sent) =
            resplit(group, step, keys, own, mirror, want, fill, self.keep_sent)?;
        self.holds = true;
        self.step = step;
        self.mirror = None;
        self.sent = self.keep_sent.then(|| Box::new(sent));
        Ok((part, counts))
    }

    /// What the mirrors cost this rank (`what`: what is mirrored).
    pub fn cost(&self, what: &str) -> MirrorCost {
        MirrorCost {
            what: what.into(),
            every: self.every,
            taken: self.taken,
            bytes_per_rank: self.bytes,
            mean_secs: self.secs / self.taken.max(1) as f64,
        }
    }
}

/// Runs of `owner`'s keys that rank `rank` owns (`owner[key]` is the key's rank).
pub fn owned_by(owner: &[usize], rank: usize) -> Vec<Range<usize>> {
    runs(owner.iter().enumerate().filter(|(_, &r)| r == rank).map(|(k, _)| k))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(ranges: &[(usize, usize)], step: u64, own: bool) -> Held {
        Held { header: PartHeader { ranges: ranges.to_vec(), step, labels: vec![] }, own }
    }

    #[test]
    fn runs_group_consecutive_keys() {
        assert_eq!(runs([0, 1, 2, 5, 7, 8]), vec![0..3, 5..6, 7..9]);
        assert_eq!(owned_by(&[0, 1, 1, 0, 1], 1), vec![1..3, 4..5]);
    }

    #[test]
    fn a_plan_takes_the_newest_own_copy_and_leaves_unheld_keys_to_the_fill() {
        // Rank 0 owns 0..4 at step 5 and mirrors 4..8 at step 3; rank 1 owns 6..8 at step 5.
        let world = vec![
            vec![held(&[(0, 4)], 5, true), held(&[(4, 8)], 3, false)],
            vec![held(&[(6, 8)], 5, true)],
        ];
        let want = |r: usize| runs(if r == 0 { 0..5 } else { 5..10 });
        let p = plan(&world, &want);
        let got: Vec<(Range<usize>, usize, Source)> =
            p.into_iter().map(|p| (p.keys, p.dst, p.from)).collect();
        assert_eq!(
            got,
            vec![
                (0..4, 0, Some((0, 0))),
                (4..5, 0, Some((0, 1))),
                (5..6, 1, Some((0, 1))),
                (6..8, 1, Some((1, 0))),
                (8..10, 1, None),
            ]
        );
    }

    #[test]
    fn a_peers_header_is_checked_before_use() {
        let h = |ranges: Vec<(usize, usize)>| PartHeader { ranges, step: 0, labels: vec![] };
        assert!(h(vec![(0, 2), (3, 4)]).check(4).is_ok());
        assert!(h(vec![(0, 2), (1, 4)]).check(4).is_err(), "overlapping");
        assert!(h(vec![(2, 2)]).check(4).is_err(), "empty");
        assert!(h(vec![(0, 5)]).check(4).is_err(), "past the keys");
        let labels = PartHeader { labels: vec!["x".into(); MAX_LABELS + 1], ..h(vec![]) };
        assert!(labels.check(4).is_err(), "too many labels");
    }
}
