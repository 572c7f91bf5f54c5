//! Where a live job keeps its membership and how a worker learns it takes part: the store
//! (the live launcher's, or an etcd cluster), the job's state there as a launcher starting
//! again reads it, and the settings `tandem run --live-recovery` passes in the environment.
use std::time::Duration;

use super::as_strs;
use crate::auth::JobSecret;
use crate::env::{process_env, Env, InitOptions, StoreHost};
use crate::error::CommError;
use crate::store::Store;

/// The live launcher's store, `host:port`, or `etcd` for the cluster at
/// `TANDEM_RDZV_ENDPOINTS`: its presence is what puts a worker in live mode.
pub const LIVE_STORE_VAR: &str = "TANDEM_LIVE_STORE";
/// The fewest ranks the job may go on with (`tandem run --min-nproc`, times the nodes).
pub const LIVE_MIN_WORLD_VAR: &str = "TANDEM_LIVE_MIN_WORLD";
/// Set ("1") on a worker the launcher started again in place of one that died.
pub const LIVE_REPLACEMENT_VAR: &str = "TANDEM_LIVE_REPLACEMENT";
/// How long a regroup waits for a member that is alive but not yet ready (seconds).
pub const LIVE_ARRIVAL_VAR: &str = "TANDEM_LIVE_ARRIVAL_TIMEOUT";

/// Where a live job keeps its membership: a store that outlives every worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LiveStoreAt {
    /// The live launcher's own store at `host:port` (node 0's on several nodes).
    Launcher(String),
    /// An etcd cluster (feature `etcd`), keys under `tandem/<run_id>/live/`: no host is
    /// special, so the job outlives any one host's loss.
    Etcd { endpoints: Vec<String>, run_id: String },
}

impl LiveStoreAt {
    /// Connects to the store, scoped to the live job's keys. `var` names the setting at fault
    /// in errors.
    pub fn connect(
        &self,
        run_id: &str,
        secret: Option<&JobSecret>,
        timeout: Duration,
        var: &str,
    ) -> Result<Store, CommError> {
        match self {
            LiveStoreAt::Launcher(addr) => {
                Ok(Store::connect(addr, run_id, secret, timeout, var)?.with_prefix("live"))
            }
            LiveStoreAt::Etcd { endpoints, run_id } => {
                Ok(Store::connect_etcd(endpoints, secret, timeout, var)?
                    .with_prefix(&format!("tandem/{run_id}/live")))
            }
        }
    }

    /// What the store holds of the job now: nothing yet, a running world, or the keys of a
    /// job that ended (every member gone). A launcher started again on a lost host reads it to
    /// start its workers as joiners of the running job.
    pub fn job_state(&self, store: &Store, slots: usize) -> Result<LiveJobState, CommError> {
        let Some(generation) = store.get_now("committed")? else {
            return Ok(LiveJobState::New);
        };
        let generation = String::from_utf8_lossy(&generation).trim().parse().unwrap_or(0);
        let keys: Vec<String> = (0..slots).map(|m| format!("alive/{m}")).collect();
        let missing = store.missing(&as_strs(&keys))?;
        let alive: Vec<usize> = (0..slots).filter(|m| !missing.contains(&keys[*m])).collect();
        Ok(match (alive.is_empty(), store.get_now(super::OVER)?.is_some()) {
            (false, _) => LiveJobState::Running { generation, alive },
            (true, true) => LiveJobState::Finished { generation },
            (true, false) => LiveJobState::Died { generation },
        })
    }
}

impl std::fmt::Display for LiveStoreAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LiveStoreAt::Launcher(addr) => write!(f, "{addr}"),
            LiveStoreAt::Etcd { endpoints, run_id } => {
                write!(f, "etcd {} (run {run_id})", endpoints.join(","))
            }
        }
    }
}

/// A live job as its store shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LiveJobState {
    /// No generation committed yet: a new job.
    New,
    /// Generation `generation` is running; the member slots `alive` have a process.
    Running { generation: u64, alive: Vec<usize> },
    /// Its members finished it: an earlier job under this id.
    Finished { generation: u64 },
    /// Generations were committed, no member is alive and none finished: every rank died (all
    /// hosts lost). Workers started now restart it from its newest checkpoint.
    Died { generation: u64 },
}

/// How this process takes part in a live world.
#[derive(Clone, Debug)]
pub struct LiveOptions {
    /// The store that outlives the workers.
    pub store: LiveStoreAt,
    /// This process's member slot (its launch `RANK`).
    pub member: usize,
    /// Member slots in the job (its launch `WORLD_SIZE`).
    pub slots: usize,
    /// The fewest ranks the job may go on with.
    pub min_world: usize,
    /// Started in place of a member that died: joins the running world.
    pub replacement: bool,
    /// A regroup leaves out a member that is alive but not ready after this long (it is
    /// stalled; it will come back as a joiner if it ever recovers).
    pub arrival_timeout: Duration,
    /// Transport, collective timeout, run id; `init_timeout` bounds joining the store and
    /// connecting each generation's group.
    pub init: InitOptions,
}

impl LiveOptions {
    /// The live launcher's settings, or `None` when this process was not started by one
    /// (`TANDEM_LIVE_STORE` unset).
    pub fn from_env() -> Result<Option<LiveOptions>, CommError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let Some(store_at) = var(LIVE_STORE_VAR) else { return Ok(None) };
        let store = if store_at.trim() == "etcd" {
            match crate::env::etcd_store(&Env(&process_env))? {
                Some(StoreHost::Etcd { endpoints, run_id }) => {
                    LiveStoreAt::Etcd { endpoints, run_id }
                }
                _ => {
                    return Err(CommError::env(
                        LIVE_STORE_VAR,
                        &store_at,
                        "names an etcd store, but TANDEM_RDZV_BACKEND=etcd and \
                         TANDEM_RDZV_ENDPOINTS are not set (tandem run --live-recovery \
                         --rdzv-backend etcd sets them)",
                    ))
                }
            }
        } else {
            LiveStoreAt::Launcher(store_at.trim().to_string())
        };
        let number = |name: &str, default: Option<usize>| -> Result<usize, CommError> {
            match (var(name), default) {
                (Some(v), _) => v
                    .trim()
                    .parse()
                    .map_err(|_| CommError::env(name, &v, "expected a non-negative integer")),
                (None, Some(d)) => Ok(d),
                (None, None) => Err(CommError::env(
                    name,
                    "",
                    format!(
                        "must be set with {LIVE_STORE_VAR} (tandem run --live-recovery sets both)"
                    ),
                )),
            }
        };
        let slots = number("WORLD_SIZE", None)?;
        let member = number("RANK", None)?;
        if member >= slots {
            return Err(CommError::env(
                "RANK",
                &member.to_string(),
                format!("must be below WORLD_SIZE={slots}"),
            ));
        }
        let min_world = number(LIVE_MIN_WORLD_VAR, Some(1))?.max(1);
        let arrival = number(LIVE_ARRIVAL_VAR, Some(30))?;
        Ok(Some(LiveOptions {
            store,
            member,
            slots,
            min_world,
            replacement: var(LIVE_REPLACEMENT_VAR).is_some_and(|v| v != "0"),
            arrival_timeout: Duration::from_secs(arrival as u64),
            init: InitOptions::from_env()?,
        }))
    }
}
