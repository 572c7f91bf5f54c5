//! State that each rank holds alone, keyed by parameter index (ZeRO-1's optimizer shards),
//! through a live regroup — the same two parts as the PartialFC head's
//! ([`face::live_head`](crate::face::live_head)):
//!
//! - **the mirror**: every `K` steps each rank sends its entries (its parameters' optimizer
//!   state, as a `.pt` image) to the next rank of the ring, which keeps them;
//! - **the re-split**: after the world re-forms, every rank announces which parameters' entries it
//!   holds and as of which step (its own, its mirror's); every rank computes the same plan from
//!   the new partition (each entry from its newest holder, own before mirror, then the receiver
//!   itself, then the lowest rank) and the entries move point to point in one global order.
//!   A parameter nobody holds (two neighbours lost at once) starts with fresh optimizer state,
//!   counted; the parameters themselves are replicated and never lost.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tandem_ckpt::Value;
use tandem_comm::{CommError, ProcessGroup};

/// Bound on a rank's announcement (indices and steps) and on one entry message.
const MAX_ANNOUNCEMENT: usize = 16 << 20;

/// Entries (parameter index → its optimizer state) held as of `step`.
#[derive(Clone, Debug, PartialEq)]
pub struct Entries {
    pub step: u64,
    pub entries: Vec<(usize, Value)>,
}

impl Entries {
    /// The `state` dict of a torch-layout optimizer state dict (integer keys) as of `step`.
    pub fn from_state(state: &Value, step: u64) -> Entries {
        let entries = match state {
            Value::Dict(items) => items
                .iter()
                .filter_map(|(k, v)| Some((usize::try_from(k.as_int()?).ok()?, v.clone())))
                .collect(),
            _ => Vec::new(),
        };
        Entries { step, entries }
    }

    fn to_bytes(&self, which: &[usize]) -> Result<Vec<u8>, EntriesError> {
        let items = self
            .entries
            .iter()
            .filter(|(i, _)| which.contains(i))
            .map(|(i, v)| (Value::Int(*i as i64), v.clone()))
            .collect();
        let v = Value::dict_from([
            ("step", Value::Int(self.step as i64)),
            ("state", Value::Dict(items)),
        ]);
        tandem_ckpt::to_pt_bytes(&v).map_err(|e| EntriesError::Format(e.to_string()))
    }

    fn from_bytes(what: &str, bytes: Vec<u8>) -> Result<Entries, EntriesError> {
        let v = tandem_ckpt::pt::load_from_bytes(what, bytes, false)
            .map_err(|e| EntriesError::Format(e.to_string()))?;
        let step = v.get("step").and_then(Value::as_int).unwrap_or(0).max(0) as u64;
        Ok(Entries::from_state(v.get("state").unwrap_or(&Value::None), step))
    }
}

/// How the re-split went, summed over the world.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryCounts {
    pub kept: u64,
    pub moved: u64,
    pub from_mirror: u64,
    /// Parameters whose optimizer state nobody held: they start afresh.
    pub fresh: u64,
    /// Steps of optimizer state lost, summed over the parameters (`params x steps`).
    pub stale_param_steps: u64,
    pub bytes_sent: u64,
}

impl std::fmt::Display for EntryCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "optimizer shards: {} parameters' state kept, {} moved, {} restored from mirrors, {} started afresh; {} parameter-steps of state lost; {} KiB moved",
            self.kept,
            self.moved,
            self.from_mirror,
            self.fresh,
            self.stale_param_steps,
            self.bytes_sent.div_ceil(1024)
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EntriesError {
    #[error("re-splitting the optimizer shards: {what}")]
    Comm {
        what: String,
        #[source]
        source: CommError,
    },
    #[error("re-splitting the optimizer shards: {0}")]
    Format(String),
}

fn comm(what: String) -> impl FnOnce(CommError) -> EntriesError {
    move |source| EntriesError::Comm { what, source }
}

/// Which of several copies of the same state a re-split takes, compared as a tuple: the newer
/// step, then the holder's own copy before a mirror, then the receiving rank itself (nothing to
/// send), then the lower rank.
pub(crate) type Preference = (u64, bool, bool, std::cmp::Reverse<usize>);

pub(crate) fn preference(step: u64, own: bool, receiver: bool, rank: usize) -> Preference {
    (step, own, receiver, std::cmp::Reverse(rank))
}

/// What a rank announces: per parameter it holds, the step and whether it is its own.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Held {
    /// (parameter, step, own)
    items: Vec<(usize, u64, bool)>,
}

/// Sends `own` to the next rank of the ring and returns the previous rank's (a collective;
/// even ranks send first, odd ranks receive first). `None` in a world of one.
pub fn exchange_mirror(
    group: &ProcessGroup,
    own: &Entries,
) -> Result<Option<Entries>, EntriesError> {
    let (me, world) = (group.rank(), group.size());
    if world < 2 {
        return Ok(None);
    }
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let all: Vec<usize> = own.entries.iter().map(|(i, _)| *i).collect();
    let bytes = own.to_bytes(&all)?;
    let send = || send_bytes(group, &bytes, next, "sending this rank's optimizer shard");
    let recv = || recv_bytes(group, prev, "receiving the previous rank's optimizer shard");
    let got = in_ring_order(me, send, recv)?;
    Ok(Some(Entries::from_bytes(&format!("rank {prev}'s mirrored shard"), got)?))
}

/// One ring step — send to the next rank, receive from the previous — in an order that cannot
/// wait on itself: even ranks send first, odd ranks receive first (in an odd ring the last,
/// even rank sends to rank 0, which receives once its own send is taken).
pub(crate) fn in_ring_order<T, E>(
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

fn send_bytes(
    group: &ProcessGroup,
    bytes: &[u8],
    to: usize,
    what: &str,
) -> Result<(), EntriesError> {
    group.send(&[bytes.len() as i64], to).map_err(comm(format!("{what} to rank {to}")))?;
    group.send(bytes, to).map_err(comm(format!("{what} to rank {to}")))
}

fn recv_bytes(group: &ProcessGroup, from: usize, what: &str) -> Result<Vec<u8>, EntriesError> {
    let mut len = [0i64];
    group.recv(&mut len, from).map_err(comm(format!("{what} from rank {from}")))?;
    // Bounded by what the host can hold before anything is allocated.
    let available = tandem_comm::procfs::mem_available().unwrap_or(u64::MAX);
    let len =
        usize::try_from(len[0]).ok().filter(|&n| (n as u64) <= available).ok_or_else(|| {
            EntriesError::Format(format!(
                "rank {from} announced {} bytes ({available} bytes are available)",
                len[0]
            ))
        })?;
    let mut buf = vec![0u8; len];
    group.recv(&mut buf, from).map_err(comm(format!("{what} from rank {from}")))?;
    Ok(buf)
}

/// This rank's entries of the new world (`group`) under the partition `owner` (parameter →
/// new rank), from what every rank holds; a collective. `step` is the world's. Returns the
/// entries (parameter index → state) and the world's counts.
pub fn regroup_entries(
    group: &ProcessGroup,
    step: u64,
    own: Option<&Entries>,
    mirror: Option<&Entries>,
    owner: &[usize],
) -> Result<(Vec<(usize, Value)>, EntryCounts), EntriesError> {
    let me = group.rank();
    let mut held = Held { items: Vec::new() };
    for (e, is_own) in [(own, true), (mirror, false)] {
        if let Some(e) = e {
            held.items.extend(e.entries.iter().map(|(i, _)| (*i, e.step, is_own)));
        }
    }
    let bytes = serde_json::to_vec(&held).map_err(|e| EntriesError::Format(e.to_string()))?;
    let all = group
        .all_gather_bytes_at_most(&bytes, MAX_ANNOUNCEMENT)
        .map_err(comm("announcing the optimizer state each rank holds".into()))?;
    // Per parameter: the best holder so far (its preference, rank, and whether its own).
    let mut best: BTreeMap<usize, (Preference, usize, bool)> = BTreeMap::new();
    for (r, b) in all.iter().enumerate() {
        let h: Held = serde_json::from_slice(b)
            .map_err(|e| EntriesError::Format(format!("rank {r}'s announcement: {e}")))?;
        for (i, s, is_own) in h.items {
            let Some(&dst) = owner.get(i) else {
                return Err(EntriesError::Format(format!(
                    "rank {r} announces parameter {i} of {}",
                    owner.len()
                )));
            };
            let key = preference(s, is_own, r == dst, r);
            if best.get(&i).is_none_or(|(k, _, _)| key > *k) {
                best.insert(i, (key, r, is_own));
            }
        }
    }
    // Transfers in one global order: by (source, destination), each a single message.
    let mut transfers: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
    let mut counts = EntryCounts::default();
    for (i, &dst) in owner.iter().enumerate() {
        match best.get(&i) {
            Some(((s, ..), src, is_own)) => {
                transfers.entry((*src, dst)).or_default().push(i);
                if dst == me {
                    match (*src == me && *is_own, *is_own) {
                        (true, _) => counts.kept += 1,
                        (false, true) => counts.moved += 1,
                        (false, false) => counts.from_mirror += 1,
                    }
                    counts.stale_param_steps += step.saturating_sub(*s);
                }
            }
            None if dst == me => counts.fresh += 1,
            None => {}
        }
    }
    let holding = |src_own: bool| if src_own { own } else { mirror };
    let mut mine: Vec<(usize, Value)> = Vec::new();
    for ((src, dst), params) in &transfers {
        if *src != me && *dst != me {
            continue;
        }
        // Which of this source's two blocks each parameter comes from.
        let from_own: Vec<usize> = params.iter().copied().filter(|i| best[i].2).collect();
        let from_mirror: Vec<usize> = params.iter().copied().filter(|i| !best[i].2).collect();
        for (which, is_own) in [(from_own, true), (from_mirror, false)] {
            if which.is_empty() {
                continue;
            }
            if *src == me && *dst == me {
                let e = holding(is_own).map(|e| e.entries.clone()).unwrap_or_default();
                mine.extend(e.into_iter().filter(|(i, _)| which.contains(i)));
            } else if *src == me {
                let e = holding(is_own).ok_or_else(|| {
                    EntriesError::Format("a block this rank announced is gone".into())
                })?;
                let bytes = e.to_bytes(&which)?;
                counts.bytes_sent += bytes.len() as u64;
                send_bytes(group, &bytes, *dst, "sending optimizer state")?;
            } else {
                let bytes = recv_bytes(group, *src, "receiving optimizer state")?;
                let got = Entries::from_bytes(&format!("rank {src}'s optimizer state"), bytes)?;
                mine.extend(got.entries.into_iter().filter(|(i, _)| which.contains(i)));
            }
        }
    }
    mine.sort_by_key(|(i, _)| *i);
    let c = serde_json::to_vec(&counts).map_err(|e| EntriesError::Format(e.to_string()))?;
    let all = group
        .all_gather_bytes_at_most(&c, 4096)
        .map_err(comm("summing the re-split's counts".into()))?;
    let mut total = EntryCounts::default();
    for b in all {
        let c: EntryCounts =
            serde_json::from_slice(&b).map_err(|e| EntriesError::Format(e.to_string()))?;
        total.kept += c.kept;
        total.moved += c.moved;
        total.from_mirror += c.from_mirror;
        total.fresh += c.fresh;
        total.stale_param_steps += c.stale_param_steps;
        total.bytes_sent += c.bytes_sent;
    }
    Ok((mine, total))
}
