//! `--live-recovery`: a worker that dies does not stop the others. The launcher hosts a store
//! that outlives every worker (node 0's launcher, at `--master-port` on several nodes; a free
//! port on one) and tells the workers where it is (`TANDEM_LIVE_STORE`); they keep their
//! membership there (`tandem_comm::live`). A worker that fails is started again alone, in its
//! own slot, as a replacement that joins the running job (while `--max-restarts` lasts); after
//! that the job goes on without it, down to `--min-nproc` ranks in the job (the workers check)
//! and `--min-nproc-per-node` on this node (the launcher checks). The launch ends when every
//! worker has exited: successfully when at least one finished the job.
//!
//! With `--rdzv-backend etcd` the membership lives on the etcd cluster instead, so no node is
//! special: losing any host whole (node 0 included) costs the job that host's ranks, and a
//! launcher started again there finds the job running and starts its workers as joiners.
use std::ffi::OsString;

use nix::sys::signal::Signal;
use tandem_comm::{host_port, LiveJobState, LiveStoreAt, StoreServer};

use crate::config::{available_cores, LaunchConfig};
use crate::env::JobShape;
use crate::error::LaunchError;
use crate::events::LaunchEvent;
use crate::outcome::{LaunchOutcome, WorkerExit, WorkerFailure};
use crate::reaper::GroupReaper;
use crate::signals::SignalWatch;
use crate::supervisor::{drain_output, stop_all};
use crate::worker::Worker;

use tandem_comm::live::{
    LIVE_MIN_WORLD_VAR as MIN_WORLD_VAR, LIVE_REPLACEMENT_VAR as REPLACEMENT_VAR,
    LIVE_STORE_VAR as STORE_VAR,
};

/// How long a launcher joining a running job waits for its node's old ranks to be seen gone
/// (their etcd leases last 3 s).
const STALE_RANKS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// One slot's worker and what became of the ones before it.
struct Slot {
    worker: Worker,
    /// The current worker has exited successfully.
    done: bool,
    /// Failed with no restart left: the job goes on without this slot.
    lost: Option<WorkerFailure>,
}

/// Where the workers find the store, and the server when this launcher hosts it.
fn live_store(cfg: &LaunchConfig) -> Result<(LiveStoreAt, Option<StoreServer>), LaunchError> {
    if let Some(endpoints) = &cfg.rdzv_etcd {
        let run_id = cfg.run_id.clone();
        return Ok((LiveStoreAt::Etcd { endpoints: endpoints.clone(), run_id }, None));
    }
    let host = &cfg.master_addr;
    if cfg.is_multi_node() {
        let port = cfg.master_port.expect("validated: multi-node needs --master-port");
        let server = if cfg.node_rank == 0 {
            let bind = host_port("0.0.0.0", port);
            Some(StoreServer::bind(&bind, &cfg.run_id, cfg.secret.as_ref()).map_err(|error| {
                LaunchError::config(
                    "--master-port",
                    format!("node 0 cannot host the live-recovery store on {bind}: {error}"),
                )
            })?)
        } else {
            None
        };
        return Ok((LiveStoreAt::Launcher(host_port(host, port)), server));
    }
    let bind = host_port(host, cfg.master_port.unwrap_or(0));
    let server = StoreServer::bind(&bind, &cfg.run_id, cfg.secret.as_ref()).map_err(|error| {
        LaunchError::config(
            "--master-addr",
            format!("cannot host the live-recovery store on {bind}: {error}"),
        )
    })?;
    let addr = host_port(host, server.local_addr().port());
    Ok((LiveStoreAt::Launcher(addr), Some(server)))
}

/// On etcd, whether this node's workers start as joiners of a job already running: a host lost
/// whole and started again finds the others training (every other store dies with its host,
/// so only etcd can tell). Refuses a node whose ranks are alive (a second launcher given the
/// same `--node-rank`) and a run id whose earlier job has ended.
fn joins_running_job(
    cfg: &LaunchConfig,
    store_at: &LiveStoreAt,
    nproc: u32,
) -> Result<bool, LaunchError> {
    if !matches!(store_at, LiveStoreAt::Etcd { .. }) {
        return Ok(false);
    }
    let unreachable = |e: tandem_comm::CommError| {
        LaunchError::Rendezvous(format!("live recovery: the store at {store_at}: {e}"))
    };
    let store = store_at
        .connect(&cfg.run_id, cfg.secret.as_ref(), cfg.rdzv_timeout, "--rdzv-endpoints")
        .map_err(unreachable)?;
    let slots = (cfg.nnodes * nproc) as usize;
    let mine: Vec<u32> = (0..nproc).map(|l| cfg.node_rank * nproc + l).collect();
    let started = std::time::Instant::now();
    let state = loop {
        let state = store_at.job_state(&store, slots).map_err(unreachable)?;
        // A host started again at once may still see its dead ranks' keys until their leases
        // expire (a few seconds): wait that out before taking them for another launcher's.
        let LiveJobState::Running { alive, .. } = &state else { break state };
        if !mine.iter().any(|r| alive.contains(&(*r as usize)))
            || started.elapsed() >= STALE_RANKS_WAIT
        {
            break state;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    match state {
        LiveJobState::New => Ok(false),
        LiveJobState::Running { generation, alive } => {
            let taken: Vec<u32> =
                mine.iter().copied().filter(|r| alive.contains(&(*r as usize))).collect();
            if !taken.is_empty() {
                return Err(LaunchError::config(
                    "--node-rank",
                    format!(
                        "{}: ranks {taken:?} of the running job (run {:?}) are alive, so another \
                         launcher runs this node; each node needs its own --node-rank",
                        cfg.node_rank, cfg.run_id
                    ),
                ));
            }
            cfg.on_event.emit(LaunchEvent::JoiningRunningJob {
                node_rank: cfg.node_rank,
                ranks: mine,
                generation,
                alive: alive.len(),
            });
            Ok(true)
        }
        LiveJobState::Died { generation } => {
            // Its ranks, replacements all, form a restart generation from its checkpoint.
            cfg.on_event.emit(LaunchEvent::RestartingDeadJob {
                node_rank: cfg.node_rank,
                ranks: mine,
                generation,
            });
            Ok(true)
        }
        LiveJobState::Finished { generation } => Err(LaunchError::config(
            "--run-id",
            format!(
                "{:?}: the etcd cluster holds an earlier live job under this id, which finished \
                 (generation {generation}); give each job its own --run-id",
                cfg.run_id
            ),
        )),
    }
}

/// Stops every slot's worker (`sig`, then SIGKILL after the grace period) and collects the
/// last of their output.
fn stop_slots(slots: Vec<Slot>, sig: Signal, cfg: &LaunchConfig, signals: &SignalWatch) {
    let mut ws: Vec<Worker> = slots.into_iter().map(|s| s.worker).collect();
    stop_all(&mut ws, sig, cfg.stop_grace, signals);
    drain_output(&mut ws);
}

/// Starts this node's workers in live-recovery mode and supervises them (see the module docs).
pub(crate) fn launch_live(cfg: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    cfg.validate()?;
    if cfg.min_nnodes.is_some() {
        return Err(LaunchError::config(
            "--live-recovery",
            "works with a fixed --nnodes (the workers re-form the world themselves; \
             --nnodes MIN:MAX is for whole-job restarts)",
        ));
    }
    let nproc = cfg.nproc_per_node.resolve()?;
    let cores = available_cores();
    let signals =
        if cfg.forward_signals { SignalWatch::install()? } else { SignalWatch::disabled() };
    let (store_at, _server) = live_store(cfg)?;
    let joining = joins_running_job(cfg, &store_at, nproc)?;
    let port = match &store_at {
        LiveStoreAt::Launcher(addr) => {
            addr.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)
        }
        LiveStoreAt::Etcd { .. } => 0,
    };
    let job_log_dir = cfg.log_dir.as_ref().map(|d| d.join(&cfg.run_id));
    let reaper = GroupReaper::start().ok();
    let shape = JobShape {
        nnodes: cfg.nnodes,
        nproc_per_node: nproc,
        node_rank: cfg.node_rank,
        master_addr: cfg.master_addr.clone(),
        master_port: port,
        restart_count: 0,
        max_restarts: cfg.max_restarts,
        run_id: cfg.run_id.clone(),
        etcd: match &store_at {
            LiveStoreAt::Etcd { endpoints, run_id } => Some((endpoints.join(","), run_id.clone())),
            LiveStoreAt::Launcher(_) => None,
        },
    };
    let store_var = match &store_at {
        LiveStoreAt::Launcher(addr) => addr.clone(),
        LiveStoreAt::Etcd { .. } => "etcd".into(),
    };
    let min_world = cfg.min_nproc.unwrap_or(1).max(1);
    let with_env = |replacement: bool| {
        let mut c = cfg.clone();
        c.extra_env.push((STORE_VAR.into(), OsString::from(&store_var)));
        c.extra_env.push((MIN_WORLD_VAR.into(), min_world.to_string().into()));
        if replacement {
            c.extra_env.push((REPLACEMENT_VAR.into(), "1".into()));
        }
        c
    };
    // (Each worker lists its own group with the watchdog before it execs.)
    let spawn = |local_rank: u32, replacement: bool, restart: u32, reaper: Option<&GroupReaper>| {
        let dir = job_log_dir.as_ref().map(|d| d.join(format!("attempt_{restart}")));
        Worker::spawn(&with_env(replacement), &shape, local_rank, cores, dir.as_deref(), reaper)
    };
    tracing::info!(nproc, store = %store_at, joining, "starting workers (live recovery)");
    let mut slots: Vec<Slot> = Vec::with_capacity(nproc as usize);
    for local_rank in 0..nproc {
        match spawn(local_rank, joining, 0, reaper.as_ref()) {
            Ok(w) => slots.push(Slot { worker: w, done: false, lost: None }),
            Err(e) => {
                stop_slots(slots, Signal::SIGTERM, cfg, &signals);
                return Err(e);
            }
        }
    }
    let mut restarts = 0u32;
    let min_here = cfg.min_nproc_per_node.unwrap_or(1).max(1);
    let outcome = |exit_code, failures, signal, restarts| LaunchOutcome {
        exit_code,
        restarts,
        failures,
        signal,
        master_port: port,
        log_dir: job_log_dir.clone(),
    };
    loop {
        if let Some((sig, _)) = signals.received() {
            let how = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
            stop_slots(slots, how, cfg, &signals);
            return Ok(outcome(128 + sig, Vec::new(), Some(sig), restarts));
        }
        // A member exits 0 only once the whole world agreed the run is over: a replacement
        // failing after that could never join (no member holds the state any more), and
        // restarting it would only fail again.
        for slot in slots.iter_mut().filter(|s| !s.done && s.lost.is_none()) {
            // (A worker's status is kept once read: the loop below sees it again.)
            if slot.worker.poll()?.is_some_and(|status| status.success()) {
                slot.done = true;
            }
        }
        let job_over = slots.iter().any(|s| s.done);
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.done || slot.lost.is_some() {
                continue;
            }
            let Some(status) = slot.worker.poll()? else { continue };
            if status.success() {
                slot.done = true;
                continue;
            }
            let exit = WorkerExit::from_status(status);
            let failure = WorkerFailure {
                rank: slot.worker.rank,
                local_rank: slot.worker.local_rank,
                node_rank: cfg.node_rank,
                exit,
                stderr_tail: slot.worker.stderr_lines(),
            };
            if job_over {
                cfg.on_event.emit(LaunchEvent::FailedAfterFinish { rank: failure.rank, exit });
                slot.lost = Some(failure);
            } else if restarts < cfg.max_restarts {
                restarts += 1;
                cfg.on_event.emit(LaunchEvent::Rejoining {
                    rank: failure.rank,
                    exit,
                    restart: restarts,
                    max_restarts: cfg.max_restarts,
                });
                let w = spawn(i as u32, true, restarts, reaper.as_ref())?;
                let mut old = std::mem::replace(&mut slot.worker, w);
                old.join_output();
            } else {
                cfg.on_event.emit(LaunchEvent::GoingOnWithout {
                    rank: failure.rank,
                    exit,
                    max_restarts: cfg.max_restarts,
                });
                slot.lost = Some(failure);
            }
        }
        let running = slots.iter().filter(|s| !s.done && s.lost.is_none()).count();
        let lost = slots.iter().filter(|s| s.lost.is_some()).count();
        if running > 0 && (nproc as usize - lost) < min_here as usize {
            cfg.on_event.emit(LaunchEvent::NodeBelowMinimum {
                left: nproc as usize - lost,
                nproc,
                min: min_here,
            });
            let failures: Vec<WorkerFailure> =
                slots.iter().filter_map(|s| s.lost.clone()).collect();
            stop_slots(slots, Signal::SIGTERM, cfg, &signals);
            let code = failures.first().map_or(1, |f| f.exit.launcher_exit_code());
            return Ok(outcome(code, failures, None, restarts));
        }
        if running == 0 {
            let finished = slots.iter().filter(|s| s.done).count();
            let failures: Vec<WorkerFailure> =
                slots.iter().filter_map(|s| s.lost.clone()).collect();
            stop_slots(slots, Signal::SIGTERM, cfg, &signals);
            if finished > 0 {
                if !failures.is_empty() || restarts > 0 {
                    cfg.on_event.emit(LaunchEvent::FinishedWithLosses {
                        finished,
                        replacements: restarts,
                        lost: failures.iter().map(|f| f.rank).collect(),
                    });
                }
                return Ok(outcome(0, failures, None, restarts));
            }
            let o = outcome(
                failures.first().map_or(1, |f| f.exit.launcher_exit_code()),
                failures,
                None,
                restarts,
            );
            let max_restarts = cfg.max_restarts;
            cfg.on_event.emit(LaunchEvent::Ended { outcome: o.clone(), max_restarts });
            return Ok(o);
        }
        // Until the next check, or sooner: a signal or a worker's exit wakes the pause.
        signals.pause(cfg.monitor_interval);
    }
}
