//! Live recovery: a world whose membership changes while the job goes on. A rank that dies
//! costs the others one regroup, not a restart; a replacement joins the running job at a step
//! boundary.
//!
//! Every process holds a member *slot* (its `RANK` when the launcher started it, kept by a
//! replacement) and is a client of a store that outlives any worker: the live launcher's
//! (`TANDEM_LIVE_STORE=host:port`), or an etcd cluster (`TANDEM_LIVE_STORE=etcd` with
//! `TANDEM_RDZV_ENDPOINTS`, keys under `tandem/<TANDEM_RDZV_ID>/live/`), which no host's loss
//! takes down. A process announces it is alive with a key owned by its store
//! connection, which the store drops when the process dies. The world runs in *generations*:
//! generation `t` is a list of member slots (rank `r` of the generation is `members[r]`) with a
//! ProcessGroup of its own. To regroup, a process leaves its generation (aborting its
//! transports, so that any peer still inside a collective of it fails at once and comes too),
//! announces itself ready for generation `t` with its progress (completed steps), and waits for
//! the generation to be committed. The ready member with the lowest slot proposes: once every
//! member still alive is ready (or the arrival timeout passed) it commits the ready and alive
//! members with a compare-and-set, which exactly one proposal wins — two failures close
//! together, a proposer that dies while proposing, or a member that dies while the new group
//! connects all end in a later generation that every survivor agrees on, or in an error that
//! names the reason (too few ranks left, the store unreachable). The committed record also
//! names the *source*: the member furthest along, whose training state the others take.
//!
//! When every member of a generation has died (the training state with them: all failed in
//! one collective before the first step, say, or every host was lost), the members alive —
//! replacements, all of them — form a *restart* generation: the lowest proposes once every
//! slot is ready or the arrival timeout passed, and its source starts the job again from the
//! newest checkpoint (or from the beginning), as a restart without live recovery would. A job
//! whose members finished marks the store `over`, so that a replacement arriving after the end
//! is told so instead of starting the job again.
//!
//! At step boundaries [`LiveGroup::regroup_wanted`] asks (rank 0 reads the store, a one-byte
//! all-reduce tells everyone) whether a process is waiting to join; a failed collective is
//! the other way in. The store keys live under `live/`:
//!
//! ```text
//! live/alive/{m}           owned by member m's store connection
//! live/wanted              counter: a regroup is wanted (joiners, excluded members, failures)
//! live/committed           the newest committed generation
//! live/g{t}/ready/{m}      member m's progress, ready for generation t
//! live/g{t}/members        "members=0,2,3 source=1 progress=40,41,40 wanted=2" (or "error=...";
//!                          a restart generation adds "restart=0,1,2,3": the members that died)
//! live/over                the members finished the job (at generation t)
//! live/g{t}/pg/...         generation t's ProcessGroup rendezvous
//! ```
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::dyn_collectives::{Collectives, CommSource};
use crate::element::ReduceOp;
use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::store::Store;

mod options;
pub use options::{
    LiveJobState, LiveOptions, LiveStoreAt, LIVE_ARRIVAL_VAR, LIVE_MIN_WORLD_VAR,
    LIVE_REPLACEMENT_VAR, LIVE_STORE_VAR,
};

/// An alive key's role: a member holding the training state, or a replacement that has not
/// received it yet (it never proposes a generation and is never its state's source).
const HOLDER: &str = "holder";
const JOINER: &str = "joiner";
/// The key a finished job's members set (see [`LiveGroup::finish`]).
pub(crate) const OVER: &str = "over";

/// How often a waiting member looks at the store.
const POLL: Duration = Duration::from_millis(5);
/// How often rank 0 asks the store whether someone wants to join, at most.
const WANTED_POLL: Duration = Duration::from_millis(50);
/// Generations tried before a regroup gives up (each failed one lost a member meanwhile).
const MAX_ATTEMPTS: usize = 8;

/// One committed generation of the world.
#[derive(Debug)]
pub struct Generation {
    pub number: u64,
    /// Member slots in rank order: rank `r` of this generation is member `members[r]`.
    pub members: Vec<usize>,
    /// Each rank's progress (completed steps) as it reported it when it became ready.
    pub progress: Vec<u64>,
    /// The rank whose training state every rank takes: the one furthest along (the lowest
    /// rank among equals).
    pub source: usize,
    /// Member slots whose process joins with this generation (a replacement, which may take
    /// the slot of a member lost in the same regroup).
    pub joining: Vec<usize>,
    /// The generation's process group; this process is rank `group.rank()` in it.
    pub group: ProcessGroup,
    /// A restart generation: every member of the generation before died (these slots), and
    /// the training state with them; its source starts again from the newest checkpoint.
    pub restart: Option<Vec<usize>>,
    /// `live/wanted` when the generation was committed: a larger value asks for a regroup.
    wanted_at: i64,
}

impl Generation {
    /// Members of this generation that were not in `before`, or whose process is new
    /// (joiners).
    pub fn joined_since(&self, before: &[usize]) -> Vec<usize> {
        let new = |m: &usize| !before.contains(m) || self.joining.contains(m);
        self.members.iter().copied().filter(new).collect()
    }
    /// Members of `before` not in this generation, or whose process a replacement took over
    /// (lost).
    pub fn lost_since(&self, before: &[usize]) -> Vec<usize> {
        let gone = |m: &usize| !self.members.contains(m) || self.joining.contains(m);
        before.iter().copied().filter(gone).collect()
    }
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "generation {}: {} rank(s), members {:?}, state from member {} (step {})",
            self.number,
            self.members.len(),
            self.members,
            self.members[self.source],
            self.progress[self.source]
        )
    }
}

/// A committed generation's record, as the store holds it.
#[derive(Debug, PartialEq, Eq)]
struct Record {
    members: Vec<usize>,
    progress: Vec<u64>,
    source: usize,
    wanted: i64,
    /// Members that joined (ready without progress).
    joining: Vec<usize>,
    /// A restart generation: the members of the one before, which all died.
    restart: Option<Vec<usize>>,
}

impl Record {
    fn encode(&self) -> String {
        let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let members: Vec<u64> = self.members.iter().map(|&m| m as u64).collect();
        let joining: Vec<u64> = self.joining.iter().map(|&m| m as u64).collect();
        let mut text = format!(
            "members={} source={} progress={} wanted={} joining={}",
            list(&members),
            self.source,
            list(&self.progress),
            self.wanted,
            list(&joining)
        );
        if let Some(dead) = &self.restart {
            let dead: Vec<u64> = dead.iter().map(|&m| m as u64).collect();
            text.push_str(&format!(" restart={}", list(&dead)));
        }
        text
    }

    /// The record, or the error a proposer committed instead (`error=...`).
    fn decode(text: &str) -> Result<Result<Record, String>, String> {
        if let Some(why) = text.strip_prefix("error=") {
            return Ok(Err(why.to_string()));
        }
        let field = |name: &str| {
            text.split(' ')
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
                .ok_or_else(|| format!("no `{name}` in {text:?}"))
        };
        let numbers = |name: &str| -> Result<Vec<u64>, String> {
            let v = field(name)?;
            if v.is_empty() {
                return Ok(Vec::new());
            }
            v.split(',')
                .map(|n| n.parse().map_err(|_| format!("bad `{name}` in {text:?}")))
                .collect()
        };
        let members: Vec<usize> = numbers("members")?.into_iter().map(|m| m as usize).collect();
        let progress = numbers("progress")?;
        let source: usize =
            field("source")?.parse().map_err(|_| format!("bad `source` in {text:?}"))?;
        let wanted: i64 =
            field("wanted")?.parse().map_err(|_| format!("bad `wanted` in {text:?}"))?;
        // (Absent: nobody joins.)
        let joining = match field("joining") {
            Ok(_) => numbers("joining")?.into_iter().map(|m| m as usize).collect(),
            Err(_) => Vec::new(),
        };
        let restart = match field("restart") {
            Ok(_) => Some(numbers("restart")?.into_iter().map(|m| m as usize).collect()),
            Err(_) => None,
        };
        if members.is_empty()
            || progress.len() != members.len()
            || source >= members.len()
            || joining.iter().any(|m| !members.contains(m))
        {
            return Err(format!("inconsistent record {text:?}"));
        }
        Ok(Ok(Record { members, progress, source, wanted, joining, restart }))
    }
}

/// A process group that re-forms when members die or join (see the module docs). Cheap to
/// share; [`LiveGroup::collectives`] gives a [`Collectives`] handle that always uses the
/// current generation, so a `Ddp` built on it follows every regroup.
pub struct LiveGroup {
    store: Store,
    opts: LiveOptions,
    local_ip: IpAddr,
    /// `None` for a replacement until it joins the running world.
    current: RwLock<Option<Arc<Generation>>>,
    last_wanted_poll: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for LiveGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.current.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(g) => {
                write!(f, "LiveGroup(member {} of {}, {g})", self.opts.member, self.opts.slots)
            }
            None => write!(
                f,
                "LiveGroup(member {} of {}, not joined)",
                self.opts.member, self.opts.slots
            ),
        }
    }
}

/// (Re)writes `member`'s alive key, owned by this process's store connection, with its `role`.
fn announce_alive(store: &Store, member: usize, role: &str) -> Result<(), CommError> {
    let me = format!("{role} pid {} on {}", std::process::id(), crate::net::hostname());
    store.set_owned(&format!("alive/{member}"), me.as_bytes())
}

fn live_error(reason: impl Into<String>) -> CommError {
    CommError::rendezvous("live", reason)
}

impl LiveGroup {
    /// Connects to the live world's store and announces this member alive. An original member
    /// (not a replacement) also forms the job's first generation with the others (it waits for
    /// every slot, up to `init_timeout`); a replacement joins the running world later, with
    /// [`LiveGroup::join_running`], once it has built what it trains — the running ranks wait
    /// for it only from then on.
    pub fn connect(opts: LiveOptions) -> Result<LiveGroup, CommError> {
        let store = opts.store.connect(
            &opts.init.run_id,
            opts.init.secret.as_ref(),
            opts.init.init_timeout,
            LIVE_STORE_VAR,
        )?;
        let local_ip = store.local_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        announce_alive(&store, opts.member, if opts.replacement { JOINER } else { HOLDER })?;
        let first = if opts.replacement {
            None
        } else {
            Some(Arc::new(Self::form(&store, &opts, local_ip, None, 0)?))
        };
        Ok(LiveGroup {
            store,
            opts,
            local_ip,
            current: RwLock::new(first),
            last_wanted_poll: Mutex::new(None),
        })
    }

    /// [`LiveGroup::connect`], then for a replacement [`LiveGroup::join_running`] at once (for
    /// callers that have nothing to build first, like the tests).
    pub fn join(opts: LiveOptions) -> Result<LiveGroup, CommError> {
        let live = Self::connect(opts)?;
        if live.current.read().unwrap_or_else(|p| p.into_inner()).is_none() {
            live.join_running()?;
        }
        Ok(live)
    }

    /// A replacement's way in: asks the running world to regroup and joins the generation it
    /// forms (with progress 0: the state comes from the running ranks). Returns it.
    pub fn join_running(&self) -> Result<Arc<Generation>, CommError> {
        // (`form` asks for the regroup, once it knows which generation it waits for.)
        let gen = Arc::new(Self::form(&self.store, &self.opts, self.local_ip, None, 0)?);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&gen));
        Ok(gen)
    }

    /// Declares that this process now holds the training state (a replacement, once it has
    /// received it): from now on it may propose a generation and be a state's source.
    pub fn holds_state(&self) -> Result<(), CommError> {
        announce_alive(&self.store, self.opts.member, HOLDER)
    }

    /// Marks the job over: its members finished (call once the world agreed the run is over). A
    /// replacement that arrives later is told so instead of starting the job again.
    pub fn finish(&self) -> Result<(), CommError> {
        let at = self.current.read().unwrap_or_else(|p| p.into_inner()).as_ref().map(|g| g.number);
        self.store.set(OVER, at.unwrap_or(0).to_string().as_bytes())
    }

    /// Whether this process has a generation yet (a replacement before `join_running` has not).
    pub fn has_joined(&self) -> bool {
        self.current.read().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// The current generation. Panics for a replacement that has not joined yet
    /// ([`LiveGroup::has_joined`]).
    pub fn generation(&self) -> Arc<Generation> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone().expect(
            "a replacement must join the running world (join_running) before using the group",
        )
    }

    /// The current generation's process group.
    pub fn group(&self) -> ProcessGroup {
        self.generation().group.clone()
    }

    pub fn member(&self) -> usize {
        self.opts.member
    }

    pub fn options(&self) -> &LiveOptions {
        &self.opts
    }

    /// A [`Collectives`] handle on whichever generation is current at each call.
    pub fn collectives(self: &Arc<Self>) -> Arc<dyn Collectives> {
        Arc::new(Current(Arc::clone(self)))
    }

    /// Whether the world should regroup at this step boundary (someone is waiting to join).
    /// A collective over the current generation: call it on every rank at the same point.
    /// A failure of that collective is reported as `Err` (the caller regroups then too).
    pub fn regroup_wanted(&self) -> Result<bool, CommError> {
        let gen = self.generation();
        let mut flag = [0u8];
        if gen.group.rank() == 0 {
            let mut last = self.last_wanted_poll.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_none_or(|t| t.elapsed() >= WANTED_POLL) {
                *last = Some(Instant::now());
                flag[0] = u8::from(self.store.add("wanted", 0)? > gen.wanted_at);
            }
        }
        if gen.group.size() > 1 {
            gen.group.all_reduce(&mut flag, ReduceOp::Max)?;
        }
        Ok(flag[0] != 0)
    }

    /// Leaves the current generation and forms the next one with every member that is alive
    /// and arrives, reporting `progress` (this process's completed steps). Returns the new
    /// generation (also the current one from now on).
    pub fn regroup(&self, progress: u64) -> Result<Arc<Generation>, CommError> {
        if !self.has_joined() {
            return self.join_running();
        }
        let old = self.generation();
        old.group.abort(&format!(
            "member {} left generation {} to regroup",
            self.opts.member, old.number
        ));
        // Peers still computing learn of the regroup at their next boundary check.
        let _ = self.store.add("wanted", 1);
        let next = Arc::new(Self::form(
            &self.store,
            &self.opts,
            self.local_ip,
            Some(old.number),
            progress,
        )?);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&next));
        Ok(next)
    }

    /// Agrees on the next generation after `after` (the newest committed one for a newcomer)
    /// and connects its group, trying later generations while members keep failing.
    fn form(
        store: &Store,
        opts: &LiveOptions,
        local_ip: IpAddr,
        after: Option<u64>,
        progress: u64,
    ) -> Result<Generation, CommError> {
        let mut last_error = String::new();
        let mut floor = after.unwrap_or(0);
        let mut left_out = false;
        for _ in 0..MAX_ATTEMPTS {
            let target = floor.max(committed(store)?) + 1;
            let first = after.is_none() && !opts.replacement && target == 1;
            if store.get_now(&format!("alive/{}", opts.member))?.is_none() {
                // Its alive key ran out while it could reach no member of an etcd store (a cut
                // link): the world went on without it, so it comes back as a joiner.
                announce_alive(store, opts.member, JOINER)?;
            }
            // A process that has not received the state reports no progress ("joiner").
            let ready = match committed_holder(store, opts)? {
                true => progress.to_string(),
                false => JOINER.to_string(),
            };
            store.set(&format!("g{target}/ready/{}", opts.member), ready.as_bytes())?;
            let newcomer = (after.is_none() && !first) || left_out;
            let record = match agree(store, opts, target, first, newcomer)? {
                Ok(record) => record,
                Err(why) => return Err(live_error(why)),
            };
            floor = target;
            let Some(rank) = record.members.iter().position(|&m| m == opts.member) else {
                // Committed without us (we arrived late): the next one asks for us.
                left_out = true;
                last_error =
                    format!("generation {target} was committed without member {}", opts.member);
                continue;
            };
            tracing::debug!(generation = target, members = ?record.members, "live: committed");
            match connect(store, opts, local_ip, target, rank, &record) {
                Ok(group) => {
                    tracing::debug!(generation = target, "live: connected");
                    // (The proposer sets it too; repeated here in case it died right after.)
                    if committed(store)? < target {
                        store.set("committed", target.to_string().as_bytes())?;
                    }
                    return Ok(Generation {
                        number: target,
                        members: record.members,
                        progress: record.progress,
                        source: record.source,
                        joining: record.joining,
                        group,
                        restart: record.restart,
                        wanted_at: record.wanted,
                    });
                }
                Err(e) => {
                    // A member died while the group connected: everyone here fails the same
                    // way (its keys never come) and regroups without it.
                    tracing::warn!(generation = target, %e, "live: connecting the generation failed; regrouping");
                    store.add("wanted", 1)?;
                    last_error = e.to_string();
                }
            }
        }
        Err(live_error(format!(
            "no generation could be formed in {MAX_ATTEMPTS} attempts (members kept failing); last: {last_error}"
        )))
    }
}

/// Whether this process's alive key says it holds the training state.
fn committed_holder(store: &Store, opts: &LiveOptions) -> Result<bool, CommError> {
    Ok(store
        .get_now(&format!("alive/{}", opts.member))?
        .is_some_and(|v| v.starts_with(HOLDER.as_bytes())))
}

/// The newest committed generation (0 before the first).
fn committed(store: &Store) -> Result<u64, CommError> {
    Ok(store
        .get_now("committed")?
        .and_then(|v| String::from_utf8_lossy(&v).trim().parse().ok())
        .unwrap_or(0))
}

/// Waits until generation `target` is committed, committing it when this member is the
/// proposer. `first`: the job's first generation, which waits for every slot.
///
/// Only members of the previous generation propose (all slots for the first): a joiner never
/// commits a world of its own while the members it is joining are busy with a step; they
/// include it at their next boundary. A member of the previous generation that is alive but
/// not ready within the arrival timeout (stalled) is left out.
///
/// A `newcomer` (a joiner, or a member committed out) asks the running world to regroup once
/// it is ready for `target`, and again every arrival timeout while nothing is committed: a
/// request that reached the store just before the running world committed `target - 1` was
/// counted in that commit, and the world would never come back for it.
fn agree(
    store: &Store,
    opts: &LiveOptions,
    target: u64,
    first: bool,
    newcomer: bool,
) -> Result<Result<Record, String>, CommError> {
    let members_key = format!("g{target}/members");
    let previous: Vec<usize> = match target - 1 {
        0 => (0..opts.slots).collect(),
        t => match store.get_now(&format!("g{t}/members"))? {
            Some(v) => match Record::decode(&String::from_utf8_lossy(&v)) {
                Ok(Ok(r)) => r.members,
                _ => (0..opts.slots).collect(),
            },
            None => (0..opts.slots).collect(),
        },
    };
    let alive_keys: Vec<String> = (0..opts.slots).map(|m| format!("alive/{m}")).collect();
    let ready_keys: Vec<String> = (0..opts.slots).map(|m| format!("g{target}/ready/{m}")).collect();
    // The first generation waits up to the init timeout for processes that are still
    // starting; later ones wait the arrival timeout for members still finishing a step.
    let patience = if first { opts.init.init_timeout } else { opts.arrival_timeout };
    // A joiner waits for the running world's next step boundary, however long its step is.
    let give_up = patience + opts.arrival_timeout + opts.init.init_timeout;
    let started = Instant::now();
    let mut asked: Option<Instant> = None;
    // Since when no member of the previous generation has held the state.
    let mut orphaned: Option<Instant> = None;
    let mut next_note = Duration::from_secs(1);
    loop {
        if let Some(v) = store.get_now(&members_key)? {
            let text = String::from_utf8_lossy(&v).to_string();
            return Record::decode(&text)
                .map_err(|why| live_error(format!("generation {target}: {why}")));
        }
        if newcomer && asked.is_none_or(|t| t.elapsed() >= opts.arrival_timeout) {
            store.add("wanted", 1)?;
            asked = Some(Instant::now());
        }
        let missing_ready = store.missing(&as_strs(&ready_keys))?;
        let is = |missing: &[String], key: &str| !missing.iter().any(|k| k == key);
        // Each member's role, read without waiting: its alive key is owned by its connection
        // and vanishes the moment it dies, so a waiting read could last the store timeout.
        let mut alive = Vec::new();
        let mut holders = Vec::new();
        for (m, key) in alive_keys.iter().enumerate() {
            let Some(role) = store.get_now(key)? else { continue };
            alive.push(m);
            // Members of the previous generation still alive and holding the state.
            if previous.contains(&m) && role.starts_with(HOLDER.as_bytes()) {
                holders.push(m);
            }
        }
        let ready: Vec<usize> =
            alive.iter().copied().filter(|&m| is(&missing_ready, &ready_keys[m])).collect();
        let waited = started.elapsed();
        if waited >= next_note {
            // (Once a second: who a regroup waits for, when one takes long.)
            tracing::debug!(
                generation = target,
                member = opts.member,
                ?ready,
                ?alive,
                ?holders,
                ?waited,
                "live: agreeing"
            );
            next_note += Duration::from_secs(1);
        }
        // Every member of the previous generation gone, and with them the state (the job not
        // over): a restart generation, proposed as the first one is — by the lowest ready
        // member, once every slot is ready or the arrival timeout passed since the state went.
        let restart = holders.is_empty();
        if restart {
            if let Some(at) = store.get_now(OVER)? {
                let at = String::from_utf8_lossy(&at).trim().to_string();
                return Ok(Err(format!(
                    "the job is over: its members finished it (generation {at}); there is \
                     nothing to join"
                )));
            }
        }
        let (proposer, everyone, waited_here, patience_here) = if restart {
            let since = *orphaned.get_or_insert_with(Instant::now);
            (
                ready.first().copied(),
                ready.len() == opts.slots,
                since.elapsed(),
                opts.arrival_timeout,
            )
        } else {
            orphaned = None;
            // Every holder of the previous generation (for the first: every slot). A joiner
            // that is ready comes along; one still starting does not hold the world.
            let everyone = if first {
                ready.len() == opts.slots
            } else {
                holders.iter().all(|m| ready.contains(m))
            };
            (ready.iter().copied().find(|m| holders.contains(m)), everyone, waited, patience)
        };
        if proposer == Some(opts.member) && (everyone || waited_here >= patience_here) {
            let proposal = propose(store, opts, &ready, target, restart.then_some(&previous[..]))?;
            let won = store.compare_set(&members_key, b"", proposal.as_bytes())?;
            if won == proposal.as_bytes() {
                store.set("committed", target.to_string().as_bytes())?;
            }
            continue; // read back the winner
        }
        // A proposer that died leaves `ready` without it: the next lowest takes over on its
        // own. Only a store that stops answering, or a world that never comes, ends the wait.
        if restart && waited > give_up + opts.arrival_timeout {
            return Err(live_error(format!(
                "generation {target}: every member of generation {} ({previous:?}) died and no \
                 restart was committed within {waited:?} (ready members {ready:?})",
                target - 1
            )));
        }
        if !restart && waited > give_up {
            return Err(live_error(format!(
                "generation {target} was not committed within {waited:?} (ready members \
                 {ready:?}, alive {alive:?}, previous generation {previous:?})"
            )));
        }
        std::thread::sleep(POLL);
    }
}

fn as_strs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

/// The proposal for generation `target` with the `ready` members (alive, in slot order); a
/// restart generation's names the members that died (`restart`).
fn propose(
    store: &Store,
    opts: &LiveOptions,
    ready: &[usize],
    target: u64,
    restart: Option<&[usize]>,
) -> Result<String, CommError> {
    if ready.len() < opts.min_world {
        return Ok(format!(
            "error=only {} rank(s) are left (members {ready:?}) and the job needs at least {} \
             (tandem run --min-nproc); the job cannot go on",
            ready.len(),
            opts.min_world
        ));
    }
    // Progress of each ready member; a joiner has none (it is never the source).
    let mut progress = Vec::with_capacity(ready.len());
    for &m in ready {
        let v = store.get(&format!("g{target}/ready/{m}"))?;
        progress.push(String::from_utf8_lossy(&v).trim().parse::<u64>().ok());
    }
    // The furthest along; the lowest rank among equals.
    let top = progress.iter().flatten().copied().max().unwrap_or(0);
    let source = progress.iter().position(|&p| p == Some(top)).unwrap_or(0);
    let joining = ready.iter().zip(&progress).filter(|(_, p)| p.is_none()).map(|(&m, _)| m);
    let joining = joining.collect();
    let progress: Vec<u64> = progress.into_iter().map(|p| p.unwrap_or(0)).collect();
    let wanted = store.add("wanted", 0)?;
    let restart = restart.map(<[usize]>::to_vec);
    Ok(Record { members: ready.to_vec(), progress, source, wanted, joining, restart }.encode())
}

/// Connects generation `target`'s group (rank `rank` of `record.members`).
fn connect(
    store: &Store,
    opts: &LiveOptions,
    local_ip: IpAddr,
    target: u64,
    rank: usize,
    record: &Record,
) -> Result<ProcessGroup, CommError> {
    let mut init = opts.init.clone();
    // A member that died after the commit must not hold the others for long.
    init.init_timeout = init.init_timeout.min(opts.arrival_timeout.max(Duration::from_secs(5)));
    let scoped = store.with_prefix(&format!("g{target}/pg"));
    let name = format!("live{target}");
    let group = crate::group::build::build_group(
        Some(scoped),
        None,
        &name,
        rank,
        record.members.clone(),
        &init,
        local_ip,
        (None, None),
    )?;
    if group.size() > 1 && init.transport != Some(crate::TransportKind::Mpi) {
        crate::group::hierarchy::setup(&group, init.hierarchical)?;
    }
    Ok(group)
}

/// [`Collectives`] on the current generation (see [`LiveGroup::collectives`]).
struct Current(Arc<LiveGroup>);

impl Current {
    fn group(&self) -> ProcessGroup {
        self.0.group()
    }
}

impl Collectives for Current {
    // Before a replacement joins, its launch slot and world size (what a model wrapper built
    // then sees; its parameters arrive with the training state).
    fn rank(&self) -> usize {
        match self.0.has_joined() {
            true => self.group().rank(),
            false => self.0.opts.member,
        }
    }
    fn size(&self) -> usize {
        match self.0.has_joined() {
            true => self.group().size(),
            false => self.0.opts.slots,
        }
    }
    fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        Ok(self.group().all_reduce(buf, ReduceOp::Avg)?)
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        Ok(self.group().all_reduce(buf, ReduceOp::Sum)?)
    }
    fn all_reduce_sum_f16(&self, buf: &mut [f16]) -> Result<(), CommSource> {
        Ok(self.group().all_reduce(buf, ReduceOp::Sum)?)
    }
    fn all_reduce_sum_bf16(&self, buf: &mut [bf16]) -> Result<(), CommSource> {
        Ok(self.group().all_reduce(buf, ReduceOp::Sum)?)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommSource> {
        Ok(self.group().broadcast(buf, root)?)
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        Ok(self.group().all_gather_bytes(bytes)?)
    }
    fn generation(&self) -> u64 {
        match self.0.has_joined() {
            true => self.0.generation().number,
            false => 0,
        }
    }
}

/// Whether `e` (anywhere in its source chain) is a peer's failure that a regroup can recover
/// from: a peer that closed its connection, made no progress, or a group already broken by
/// one (not a caller error or a desync, which a regroup would repeat).
pub fn is_peer_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        // (A boxed CommError, as a library error enum may hold one, is the error itself.)
        let boxed = err.downcast_ref::<Box<CommError>>().map(|b| &**b);
        if let Some(c) = err.downcast_ref::<CommError>().or(boxed) {
            return matches!(
                c,
                CommError::Peer { .. }
                    | CommError::Timeout { .. }
                    | CommError::Broken { .. }
                    | CommError::QueueTimeout { .. }
            );
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_ones_are_named() {
        let r = Record {
            members: vec![0, 2, 3],
            progress: vec![40, 41, 0],
            source: 1,
            wanted: 2,
            joining: vec![3],
            restart: None,
        };
        let text = r.encode();
        assert_eq!(text, "members=0,2,3 source=1 progress=40,41,0 wanted=2 joining=3");
        assert_eq!(Record::decode(&text).unwrap().unwrap(), r);
        // A restart generation names the members that died.
        let r = Record { restart: Some(vec![0, 1, 2]), joining: vec![0, 2, 3], ..r };
        let text = r.encode();
        assert!(text.ends_with(" joining=0,2,3 restart=0,1,2"), "{text}");
        assert_eq!(Record::decode(&text).unwrap().unwrap(), r);
        assert_eq!(Record::decode("error=too few").unwrap().unwrap_err(), "too few");
        for bad in [
            "members=0,1 source=2 progress=1,1 wanted=0",
            "members= source=0 progress= wanted=0 joining=",
            "members=0,1 source=0 progress=1,1 wanted=0 joining=2",
            "source=0",
        ] {
            assert!(Record::decode(bad).is_err(), "{bad}");
        }
    }
}
