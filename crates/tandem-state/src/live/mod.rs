//! Keep training through a rank's death in your own loop, under `tandem run --live-recovery`:
//! the survivors regroup, take the state of the rank furthest along, redo at most the step that
//! failed, and go on over the new world; a restarted rank joins at a step boundary and receives
//! the whole training state from a healthy peer over the group — no checkpoint file involved.
//! (The membership protocol is [`tandem_comm::live`]'s; this module moves the training state.)
//!
//! The loop's shape (`examples/live_recovery.rs` in the repository is the whole program):
//!
//! ```ignore
//! let live = LiveTraining::connect()?;                       // under tandem run --live-recovery
//! let ddp = Ddp::from_varmap(&varmap, &live.collectives(), live.ddp_options(DdpOptions::default()))?;
//! let (rank, world) = live.rank_and_size();                  // for the sampler
//! // ... optimizer, loader ...
//! live.start(&mut TrainingState::new(&ddp, &mut opt).loader(&mut loader))?; // a replacement gets the state
//! // Each step starts with `live.regroup_wanted()?` (a rank waits to join: regroup now) and
//! // ends with the state each rank holds alone mirrored when due (ZeRO's shards, the parts):
//! live.after_step(&mut TrainingState::new(&ddp, &mut opt).part(&mut head).step(step))?;
//! // A step that fails with `is_peer_failure` puts the loader back where it began; then:
//! let change = live.regroup(&mut TrainingState::new(&ddp, &mut opt).part(&mut head).loader(&mut loader).step(step))?;
//! ```
//!
//! The `Trainer` (tandem-train) goes through the same calls with its recipe's state
//! (`live/trainer.rs`: its outer loop and the record that travels with the state), so a loop
//! of your own keeps ZeRO's shards and a PartialFC head's rows through a regroup exactly as it
//! does.
mod entries;
mod parts;

use std::sync::{Arc, Mutex};

use tandem_ckpt::TrainingCheckpoint;
use tandem_comm::live::{Generation, LiveGroup, LiveOptions};
use tandem_comm::{Collectives, CommError, ProcessGroup};

use crate::error::{comm, Context};
pub use crate::rank_state::RegroupCounts;
use crate::rank_state::{MirrorCost, Resplit};
use crate::state::{apply_checkpoint, sampler_state_from_value, to_value, Restore, TrainingState};
use crate::{Result, TrainError};
use parts::LiveParts;

pub use tandem_comm::live::is_peer_failure;

pub use crate::rank_state::elements::{Block, Elements};
pub use crate::rank_state::part::{
    exchange_mirror, owned_by, regroup, runs, Fill, Mirrored, PartHeader, RankPart,
};
pub use entries::Entries;

/// How many regroups one call tries while members keep failing (a source that dies while it
/// sends its state, say) before giving up.
const MAX_REGROUPS: usize = 8;

/// A live regroup, as the new world's rank 0 reports it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Regroup {
    /// Seconds since the Unix epoch when the world had re-formed.
    pub at_unix_s: f64,
    /// [`Regroup::JOINED`], or the failure that broke the old world.
    pub cause: String,
    pub change: WorldChange,
    /// Steps the world takes again (the one in flight when a rank died, unless the state's
    /// source had finished it).
    pub redone: u64,
    /// How the state each rank holds alone was re-split, if the recipe has such state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resplit: Option<Resplit>,
}

impl Regroup {
    /// The cause of a regroup that lets a replacement join the running world.
    pub const JOINED: &'static str = "a rank joins";

    /// Whether a replacement joined (not a failure).
    pub fn is_join(&self) -> bool {
        self.cause == Regroup::JOINED
    }

    /// Whether any process joined: a join, or a failure's regroup that took in a replacement
    /// already waiting (it may hold the slot of the member lost).
    pub fn has_joiner(&self) -> bool {
        self.is_join() || !self.change.joined.is_empty()
    }
}

/// What a regroup changed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorldChange {
    pub generation: u64,
    /// Member slots of the new world, in rank order.
    pub members: Vec<usize>,
    /// Members of the previous world that are gone.
    pub lost: Vec<usize>,
    /// Members new in this world (replacements, or members that were left out and came back).
    pub joined: Vec<usize>,
    /// The member whose state everyone took, and its step.
    pub source: usize,
    pub step: u64,
    /// How the state each rank holds alone was re-split (the first part that moved).
    #[serde(default)]
    pub resplit: Option<Resplit>,
    /// A restart: every member of the world before died, and the state with them; the source
    /// started the job again from this checkpoint (or from the beginning, which it names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarted_from: Option<String>,
}

impl std::fmt::Display for WorldChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "generation {}: {} rank(s) {:?}",
            self.generation,
            self.members.len(),
            self.members
        )?;
        if !self.lost.is_empty() {
            write!(f, ", lost {:?}", self.lost)?;
        }
        if !self.joined.is_empty() {
            write!(f, ", joined {:?}", self.joined)?;
        }
        write!(f, "; state of member {} at step {}", self.source, self.step)?;
        if let Some(from) = &self.restarted_from {
            write!(f, " (every member of the world before had died: restarted from {from})")?;
        }
        Ok(())
    }
}

/// A rank's handle on a live job (see the module docs).
pub struct LiveTraining {
    live: Arc<LiveGroup>,
    /// A replacement has the running world's state still to receive ([`LiveTraining::start`]).
    pending_start: std::sync::atomic::AtomicBool,
    /// What the state's parts keep between steps (a sharded optimizer's mirror).
    parts: Mutex<LiveParts>,
}

impl LiveTraining {
    /// Connects to the live job `tandem run --live-recovery` started this process in: an
    /// original member forms the first world with the others; a replacement only connects
    /// (it joins in [`LiveTraining::start`], once its model is built).
    pub fn connect() -> Result<LiveTraining> {
        let opts = LiveOptions::from_env()
            .map_err(comm("live recovery: reading the job's settings"))?
            .ok_or(TrainError::NotLive { var: tandem_comm::live::LIVE_STORE_VAR })?;
        Self::connect_with(opts)
    }

    /// [`LiveTraining::connect`] with explicit options.
    pub fn connect_with(opts: LiveOptions) -> Result<LiveTraining> {
        let replacement = opts.replacement;
        let live = Arc::new(LiveGroup::connect(opts).map_err(comm("live recovery: connecting"))?);
        let parts = Mutex::new(LiveParts::new());
        Ok(LiveTraining { live, pending_start: replacement.into(), parts })
    }

    /// A sharded optimizer's (ZeRO-1's) entries are mirrored to the next rank every `every`
    /// steps (1 by default): a rank's death loses at most `every - 1` steps of them. Set before
    /// [`LiveTraining::start`].
    pub fn mirror_every(self, every: u64) -> Self {
        self.lock_parts().set_mirror_every(every);
        self
    }

    /// Where the run's checkpoints are (`save_state`'s directory): after two neighbours die at
    /// once, what neither held any more (their PartialFC rows) is read from the newest one
    /// instead of starting afresh.
    pub fn checkpoints(self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.lock_parts().set_checkpoints(dir.into());
        self
    }

    fn lock_parts(&self) -> std::sync::MutexGuard<'_, LiveParts> {
        // (A panic while holding it leaves nothing half-done that a later call trusts.)
        self.parts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this process is in the world (a replacement is not until [`LiveTraining::start`]
    /// joined it).
    pub fn has_joined(&self) -> bool {
        self.live.has_joined()
    }

    /// Whether this process replaces a member that died.
    pub fn is_replacement(&self) -> bool {
        self.live.options().replacement
    }

    /// The current world's process group (changes at every regroup: fetch it again after one).
    pub fn group(&self) -> ProcessGroup {
        self.live.group()
    }

    /// The rank and size a sampler should use now (before a replacement joins: its launch slot
    /// and world size; `start` reshards the loader in any case).
    pub fn rank_and_size(&self) -> (usize, usize) {
        let c = self.live.collectives();
        (c.rank(), c.size())
    }

    /// Collectives that follow every regroup: build `Ddp` (and SyncBatchNorm) on this.
    pub fn collectives(&self) -> Arc<dyn Collectives> {
        self.live.collectives()
    }

    /// `Ddp` options for this process: a replacement skips Ddp's construction-time check and
    /// broadcast (the running ranks are not constructing anything; its parameters come with
    /// the training state in `start`).
    pub fn ddp_options(&self, mut opts: tandem_ddp::DdpOptions) -> tandem_ddp::DdpOptions {
        if self.is_replacement() {
            opts.sync_on_init = false;
        }
        opts
    }

    /// The current generation (member slots, progress, source).
    pub fn generation(&self) -> Arc<Generation> {
        self.live.generation()
    }

    /// Call once, after building model, optimizer and loader and before the first step. An
    /// original member does nothing; a replacement joins the running world, which regroups at
    /// its next step boundary, and receives the whole training state from the rank furthest
    /// along. `Some` change for a replacement.
    pub fn start(&self, state: &mut impl LiveState) -> Result<Option<WorldChange>> {
        if !self.pending_start.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Ok(None);
        }
        // A replacement holds no shard of a sharded optimizer until it joins (an original
        // member's is tracked at its first step or regroup).
        state.with_state(&mut |s| {
            self.lock_parts().track(s, false);
            Ok(())
        })?;
        let gen = self.live.join_running().map_err(comm("live recovery: joining"))?;
        let change = match self.adopt(&gen, &[], state) {
            Err(e) if e.is_peer_failure() => self.regroup(state)?,
            other => other?,
        };
        // From now on this process holds the state like the others.
        self.live.holds_state().map_err(comm("live recovery: after joining"))?;
        Ok(Some(change))
    }

    /// After every completed step, on every rank (`state.step`: the steps completed): the
    /// state each rank holds alone — its parts (a PartialFC head's rows) and a sharded
    /// optimizer's entries — is mirrored to the next rank when due, so a rank's death does not
    /// lose it. A collective then; an `Err` that [`is_peer_failure`] is a failure like any
    /// other step's.
    pub fn after_step(&self, state: &mut TrainingState<'_>) -> Result<()> {
        self.lock_parts().after_step(&self.live.group(), state)
    }

    /// Call once the world agreed the run is over, on every rank (tandem-train's `Trainer`
    /// does): a replacement that arrives after the end is told the job is over instead of
    /// starting it again from its checkpoint (what it does when every member died).
    pub fn finish(&self) -> Result<()> {
        self.live.finish().map_err(comm("live recovery: marking the job over"))
    }

    /// What the mirrors of `state`'s parts and of a sharded optimizer cost this rank so far.
    pub fn mirror_costs(&self, state: &TrainingState<'_>) -> Vec<MirrorCost> {
        self.lock_parts().mirror_costs(state)
    }

    /// Whether the world should regroup at this step boundary (a rank is waiting to join). A
    /// collective: every rank calls it at the same point of each step. An `Err` that
    /// [`is_peer_failure`] is a failure like any other step's.
    pub fn regroup_wanted(&self) -> Result<bool, CommError> {
        self.live.regroup_wanted()
    }

    /// Regroups — after a step failed on a peer's death, or when [`regroup_wanted`] said so —
    /// and brings `state` to the world's: the rank furthest along ([`LiveState::progress`])
    /// sends its replicated state to every other, every rank enters the new world (a loader is
    /// resharded: the rest of the epoch split again), and the state each rank holds alone (its
    /// parts, a sharded optimizer's entries) is re-split over it, each piece from its newest
    /// holder or mirror. The state must stand where the next step starts (after a failed step,
    /// put the loader back to where that step began).
    ///
    /// [`regroup_wanted`]: LiveTraining::regroup_wanted
    pub fn regroup(&self, state: &mut impl LiveState) -> Result<WorldChange> {
        let before = if self.live.has_joined() {
            self.live.generation().members.clone()
        } else {
            Vec::new()
        };
        let mut last = None;
        for _ in 0..MAX_REGROUPS {
            let gen =
                self.live.regroup(state.progress()).map_err(comm("live recovery: regrouping"))?;
            match self.adopt(&gen, &before, state) {
                Err(e) if e.is_peer_failure() => last = Some(e.chain_text()),
                Ok(change) => {
                    self.live.holds_state().map_err(comm("live recovery: after regrouping"))?;
                    return Ok(change);
                }
                other => return other,
            }
        }
        Err(TrainError::Invalid(format!(
            "live recovery: members kept failing while the state moved ({MAX_REGROUPS} regroups); last: {}",
            last.unwrap_or_default()
        )))
    }

    /// Moves the state of `gen`'s source to every rank, every rank enters the world, and the
    /// parts re-split over it. What changed is the source's view (members lost and joined
    /// since its last world), sent with the state: every rank reports the same change, a
    /// replacement too.
    fn adopt(
        &self,
        gen: &Generation,
        before: &[usize],
        state: &mut impl LiveState,
    ) -> Result<WorldChange> {
        let group = &gen.group;
        let (source, rank, size) = (gen.source, group.rank(), group.size());
        let mut bytes = Vec::new();
        // A restart generation's source starts the job again from its newest checkpoint.
        let restarted_from = match (&gen.restart, rank == source) {
            (Some(_), true) => {
                let dir = self.lock_parts().checkpoints();
                Some(state.restart_from(dir.as_deref())?)
            }
            _ => None,
        };
        if rank == source {
            let record = state.record()?;
            // The replicated state only: what each rank holds alone moves in the re-split.
            state.with_state(&mut |s| {
                bytes = state_bytes(s, size)?;
                Ok(())
            })?;
            push_bytes(&mut bytes, &record);
            let change = WorldChange {
                generation: gen.number,
                members: gen.members.clone(),
                // (A restart's world before died whole.)
                lost: gen.restart.clone().unwrap_or_else(|| gen.lost_since(before)),
                // (The source held the state in the world before: it is never joining.)
                joined: gen.joined_since(before),
                source: gen.members[source],
                step: if restarted_from.is_some() {
                    state.progress()
                } else {
                    gen.progress[source]
                },
                resplit: None,
                restarted_from,
            };
            push_record(&mut bytes, &change, "the world's change")?;
        }
        if size > 1 {
            group
                .broadcast_bytes(&mut bytes, source)
                .map_err(comm("live recovery: sending the training state"))?;
        }
        tracing::debug!(generation = gen.number, bytes = bytes.len(), "live: the state moved");
        let mut change: WorldChange = pop_record(&mut bytes, "the world's change")?;
        let mut sent = None;
        if rank == source {
            state.with_state(&mut |s| enter_world(s, rank, size))?;
        } else {
            let record = pop_bytes(&mut bytes, "the loop's record")?;
            state.take_record(record)?;
            state.with_state(&mut |s| {
                let ck = load_state_bytes(s, std::mem::take(&mut bytes), (rank, size))?;
                sent = Some(ck.optimizer);
                Ok(())
            })?;
        }
        let mut parts = self.lock_parts();
        state.with_state(&mut |s| {
            change.resplit = parts.regroup(group, s, sent.take())?;
            Ok(())
        })?;
        drop(parts);
        tracing::debug!(generation = gen.number, "live: the parts re-split");
        state.regrouped(&change)?;
        Ok(change)
    }
}

/// `value` as TOML (which, unlike JSON, keeps a NaN loss): what travels beside the state.
#[doc(hidden)]
pub fn encode_record(value: &impl serde::Serialize, what: &str) -> Result<Vec<u8>> {
    let text = toml::to_string(value)
        .map_err(|e| TrainError::Invalid(format!("live recovery: {what}: {e}")))?;
    Ok(text.into_bytes())
}

/// The value [`encode_record`] wrote.
#[doc(hidden)]
pub fn decode_record<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    let bad = |why: String| TrainError::Invalid(format!("live recovery: {what}: {why}"));
    let text = std::str::from_utf8(bytes).map_err(|e| bad(e.to_string()))?;
    toml::from_str(text).map_err(|e| bad(e.to_string()))
}

/// Appends `value` to a regroup's `bytes` as a record ([`encode_record`]), its length after it.
#[doc(hidden)]
pub fn push_record(bytes: &mut Vec<u8>, value: &impl serde::Serialize, what: &str) -> Result<()> {
    push_bytes(bytes, &encode_record(value, what)?);
    Ok(())
}

/// Takes the value [`push_record`] appended off the end of `bytes`.
#[doc(hidden)]
pub fn pop_record<T: serde::de::DeserializeOwned>(bytes: &mut Vec<u8>, what: &str) -> Result<T> {
    decode_record(&pop_bytes(bytes, what)?, what)
}

/// Appends `extra` to a regroup's `bytes`, its length after it.
fn push_bytes(bytes: &mut Vec<u8>, extra: &[u8]) {
    bytes.extend_from_slice(extra);
    bytes.extend_from_slice(&(extra.len() as u64).to_le_bytes());
}

/// Takes the bytes [`push_bytes`] appended off the end of `bytes`.
fn pop_bytes(bytes: &mut Vec<u8>, what: &str) -> Result<Vec<u8>> {
    let bad = |why: String| TrainError::Invalid(format!("live recovery: {what}: {why}"));
    let at = bytes.len().checked_sub(8).ok_or_else(|| bad("missing".into()))?;
    let len = u64::from_le_bytes(bytes[at..].try_into().expect("8 bytes"));
    let start = usize::try_from(len)
        .ok()
        .and_then(|n| at.checked_sub(n))
        .ok_or_else(|| bad(format!("{len} bytes announced, {at} there")))?;
    let mut extra = bytes.split_off(start);
    extra.truncate(at - start);
    Ok(extra)
}

/// What a regroup moves: a [`TrainingState`] (the model, the optimizer, the parts each rank
/// holds alone, the loader) — a user's own loop passes its `TrainingState` itself — and, for a
/// loop that keeps more (tandem-train's `Trainer` and its record of what it has done), that
/// record beside it.
pub trait LiveState {
    /// Completed steps (the rank with the most is the source).
    fn progress(&self) -> u64;
    /// Runs `f` on the training state the regroup moves, reads and re-splits.
    fn with_state(&mut self, f: &mut dyn FnMut(&mut TrainingState<'_>) -> Result<()>)
        -> Result<()>;
    /// The source: what travels beside the training state (none by default).
    fn record(&mut self) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    /// Every rank but the source, before it loads the state: the source's [`LiveState::record`].
    fn take_record(&mut self, _record: Vec<u8>) -> Result<()> {
        Ok(())
    }
    /// Every rank, once the state is the world's and the parts are re-split.
    fn regrouped(&mut self, _change: &WorldChange) -> Result<()> {
        Ok(())
    }
    /// The source of a restart generation (every member of the world before died, and the
    /// state with them): restores the newest checkpoint in `dir` (`LiveTraining::checkpoints`)
    /// and names it; with none, the state stays as built (the job starts from the beginning).
    fn restart_from(&mut self, dir: Option<&std::path::Path>) -> Result<String> {
        let Some(dir) = dir else { return Ok(FROM_THE_BEGINNING.into()) };
        let mut from = None;
        self.with_state(&mut |s| {
            from = crate::state::load_state(dir, s)?.map(|r| r.path.display().to_string());
            Ok(())
        })?;
        Ok(from.unwrap_or_else(|| {
            format!("{FROM_THE_BEGINNING} (no checkpoint in {})", dir.display())
        }))
    }
}

/// What a restart generation started from when no checkpoint was there.
#[doc(hidden)]
pub const FROM_THE_BEGINNING: &str = "the beginning";

/// A user's own loop: its training state moves as it is (model, optimizer, scheduler,
/// GradScaler, loader position and counters, in the checkpoint format), and its parts re-split.
impl LiveState for TrainingState<'_> {
    fn progress(&self) -> u64 {
        self.step
    }
    fn with_state(
        &mut self,
        f: &mut dyn FnMut(&mut TrainingState<'_>) -> Result<()>,
    ) -> Result<()> {
        f(self)
    }
}

/// The source: becomes `rank` of `size` with its own state (the loader resharded from its own
/// position).
fn enter_world(state: &mut TrainingState<'_>, rank: usize, size: usize) -> Result<()> {
    if let Some(loader) = state.loader.as_deref_mut() {
        let position = loader.position();
        loader.reshard(rank, size, &position).context("live recovery: resharding the loader")?;
    }
    Ok(())
}

/// `state`'s replicated part as the bytes a regroup's source sends: a sharded optimizer's
/// hyperparameters only, any other's state without the entries the parts hold (those move in
/// the re-split).
pub(crate) fn state_bytes(state: &TrainingState<'_>, world_size: usize) -> Result<Vec<u8>> {
    let value = to_value(state, world_size)?;
    tandem_ckpt::to_pt_bytes(&value).context("live recovery: encoding the training state")
}

/// Loads the source's `bytes` into `state` but the optimizer (the re-split loads it with the
/// entries held apart) and moves its loader to `world` (rank, size) from the source's
/// position. Returns the checkpoint read.
pub(crate) fn load_state_bytes(
    state: &mut TrainingState<'_>,
    bytes: Vec<u8>,
    world: (usize, usize),
) -> Result<TrainingCheckpoint> {
    let decoding = "live recovery: decoding the training state";
    let value =
        tandem_ckpt::pt::load_from_bytes("the live state", bytes, true).context(decoding)?;
    let ck = TrainingCheckpoint::from_value(&value).context(decoding)?;
    // The loader is moved to the new world from the source's position instead; the GradScaler
    // comes as the source had it (a note about it would be the source's).
    let what = Restore { model: state.has_replicated_model(), loader: false, optimizer: false };
    apply_checkpoint(state, &ck, std::path::Path::new("<live state>"), what)?;
    if let Some(loader) = state.loader.as_deref_mut() {
        let position = sampler_state_from_value(&ck.sampler)
            .context("live recovery: the live state's sampler position")?;
        loader
            .reshard(world.0, world.1, &position)
            .context("live recovery: resharding the loader")?;
    }
    Ok(ck)
}
