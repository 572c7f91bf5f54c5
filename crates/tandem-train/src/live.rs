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
//! // Each step starts with `live.regroup_wanted()?` (a rank waits to join: regroup now); a step
//! // that fails with `is_peer_failure` puts the loader back where it began; then:
//! let change = live.regroup(&mut TrainingState::new(&ddp, &mut opt).loader(&mut loader).step(step))?;
//! ```
use std::sync::Arc;

use tandem_ckpt::TrainingCheckpoint;
use tandem_comm::live::{Generation, LiveGroup, LiveOptions};
use tandem_comm::{Collectives, CommError, ProcessGroup};

use crate::error::{comm, Context};
use crate::state::{apply_checkpoint, sampler_state_from_value, to_value, Restore, TrainingState};
use crate::{Result, TrainError};

pub use tandem_comm::live::is_peer_failure;

pub use crate::live_entries::Entries;
pub use crate::live_part::{
    exchange_mirror, owned_by, regroup, runs, Fill, Mirrored, PartHeader, RankPart, RegroupCounts,
};

/// How many regroups one call tries while members keep failing (a source that dies while it
/// sends its state, say) before giving up.
const MAX_REGROUPS: usize = 8;

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
        write!(f, "; state of member {} at step {}", self.source, self.step)
    }
}

/// A rank's handle on a live job (see the module docs).
pub struct LiveTraining {
    live: Arc<LiveGroup>,
    /// A replacement has the running world's state still to receive ([`LiveTraining::start`]).
    pending_start: std::sync::atomic::AtomicBool,
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
        Ok(LiveTraining { live, pending_start: replacement.into() })
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
        let gen = self.live.join_running().map_err(comm("live recovery: joining"))?;
        let change = match self.adopt(&gen, &[], state) {
            Err(e) if e.is_peer_failure() => self.regroup(state)?,
            other => other?,
        };
        // From now on this process holds the state like the others.
        self.live.holds_state().map_err(comm("live recovery: after joining"))?;
        Ok(Some(change))
    }

    /// Whether the world should regroup at this step boundary (a rank is waiting to join). A
    /// collective: every rank calls it at the same point of each step. An `Err` that
    /// [`is_peer_failure`] is a failure like any other step's.
    pub fn regroup_wanted(&self) -> Result<bool, CommError> {
        self.live.regroup_wanted()
    }

    /// Regroups — after a step failed on a peer's death, or when [`regroup_wanted`] said so —
    /// and brings `state` to the world's: the rank furthest along ([`LiveState::progress`])
    /// sends its state to every other, and every rank then enters the new world (a loader is
    /// resharded: the rest of the epoch split again). The state must stand where the next
    /// step starts (after a failed step, put the loader back to where that step began).
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

    /// Moves the state of `gen`'s source to every rank, then every rank enters the world.
    /// What changed is the source's view (members lost and joined since its last world), sent
    /// with the state: every rank reports the same change, a replacement too.
    fn adopt(
        &self,
        gen: &Generation,
        before: &[usize],
        state: &mut impl LiveState,
    ) -> Result<WorldChange> {
        let group = &gen.group;
        let source = gen.source;
        let mut bytes = Vec::new();
        if group.rank() == source {
            bytes = state.save(group.size())?;
            let change = WorldChange {
                generation: gen.number,
                members: gen.members.clone(),
                lost: gen.lost_since(before),
                // (The source held the state in the world before: it is never joining.)
                joined: gen.joined_since(before),
                source: gen.members[source],
                step: gen.progress[source],
            };
            push_record(&mut bytes, &change, "the world's change")?;
        }
        if group.size() > 1 {
            group
                .broadcast_bytes(&mut bytes, source)
                .map_err(comm("live recovery: sending the training state"))?;
        }
        let change: WorldChange = pop_record(&mut bytes, "the world's change")?;
        if group.rank() == source {
            state.enter_world(group.rank(), group.size())?;
        } else {
            state.load(bytes, group.rank(), group.size())?;
        }
        state.reshard(group)?;
        Ok(change)
    }
}

/// Appends `value` to a regroup's `bytes` as TOML (which, unlike JSON, keeps a NaN loss), its
/// length after it.
pub(crate) fn push_record(
    bytes: &mut Vec<u8>,
    value: &impl serde::Serialize,
    what: &str,
) -> Result<()> {
    let text = toml::to_string(value)
        .map_err(|e| TrainError::Invalid(format!("live recovery: {what}: {e}")))?;
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend_from_slice(&(text.len() as u64).to_le_bytes());
    Ok(())
}

/// Takes the value [`push_record`] appended off the end of `bytes`.
pub(crate) fn pop_record<T: serde::de::DeserializeOwned>(
    bytes: &mut Vec<u8>,
    what: &str,
) -> Result<T> {
    let bad = |why: String| TrainError::Invalid(format!("live recovery: {what}: {why}"));
    let at = bytes.len().checked_sub(8).ok_or_else(|| bad("missing".into()))?;
    let len = u64::from_le_bytes(bytes[at..].try_into().expect("8 bytes"));
    let start = usize::try_from(len)
        .ok()
        .and_then(|n| at.checked_sub(n))
        .ok_or_else(|| bad(format!("{len} bytes announced, {at} there")))?;
    let text = std::str::from_utf8(&bytes[start..at]).map_err(|e| bad(e.to_string()))?;
    let value = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
    bytes.truncate(start);
    Ok(value)
}

/// What a regroup moves from the rank furthest along to the others.
pub trait LiveState {
    /// Completed steps (the rank with the most is the source).
    fn progress(&self) -> u64;
    /// This rank's whole state as bytes, for a world of `world_size` (the source only).
    fn save(&mut self, world_size: usize) -> Result<Vec<u8>>;
    /// Every rank but the source: takes the source's state and becomes `rank` of `size`
    /// (the data resharded from the source's position).
    fn load(&mut self, bytes: Vec<u8>, rank: usize, size: usize) -> Result<()>;
    /// The source: becomes `rank` of `size` with its own state (the data resharded).
    fn enter_world(&mut self, rank: usize, size: usize) -> Result<()>;
    /// Every rank, after `load` or `enter_world`: re-splits over the new world `group` what
    /// each rank holds alone (a model-parallel head), a collective. Nothing by default.
    fn reshard(&mut self, _group: &ProcessGroup) -> Result<()> {
        Ok(())
    }
}

/// The library's training state moves whole: model, optimizer, scheduler, GradScaler, loader
/// position and counters, in the checkpoint format (`save_state`'s, in memory).
impl LiveState for TrainingState<'_> {
    fn progress(&self) -> u64 {
        self.step
    }
    fn save(&mut self, world_size: usize) -> Result<Vec<u8>> {
        state_bytes(self, world_size, false)
    }
    fn load(&mut self, bytes: Vec<u8>, rank: usize, size: usize) -> Result<()> {
        load_state_bytes(self, bytes, (rank, size), true).map(drop)
    }
    fn enter_world(&mut self, rank: usize, size: usize) -> Result<()> {
        if let Some(loader) = self.loader.as_deref_mut() {
            let position = loader.position();
            loader
                .reshard(rank, size, &position)
                .context("live recovery: resharding the loader")?;
        }
        Ok(())
    }
}

/// `state` as the bytes a regroup's source sends; a sharded optimizer's entries stay behind
/// with `entries_apart` (only its hyperparameters go).
pub(crate) fn state_bytes(
    state: &TrainingState<'_>,
    world_size: usize,
    entries_apart: bool,
) -> Result<Vec<u8>> {
    let value = to_value(state, world_size, entries_apart)?;
    tandem_ckpt::to_pt_bytes(&value).context("live recovery: encoding the training state")
}

/// Loads the source's `bytes` into `state` and moves its loader to `world` (rank, size) from
/// the source's position; the optimizer only with `optimizer`. Returns the checkpoint read.
pub(crate) fn load_state_bytes(
    state: &mut TrainingState<'_>,
    bytes: Vec<u8>,
    world: (usize, usize),
    optimizer: bool,
) -> Result<TrainingCheckpoint> {
    let decoding = "live recovery: decoding the training state";
    let value =
        tandem_ckpt::pt::load_from_bytes("the live state", bytes, true).context(decoding)?;
    let ck = TrainingCheckpoint::from_value(&value).context(decoding)?;
    // The loader is moved to the new world from the source's position instead; the GradScaler
    // comes as the source had it (a note about it would be the source's).
    let what = Restore { model: true, loader: false, optimizer };
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
