//! The attempt loop: start every worker, watch them, stop them all when one fails (or the
//! launcher is signalled), and start the whole set again while restarts remain.
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::config::{available_cores, LaunchConfig};
use crate::env::JobShape;
use crate::error::LaunchError;
use crate::events::{EventSink, LaunchEvent};
use crate::nodes::{Finish, Joined, Meeting, NodeAgent, Remote, Round, RoundWatch};
use crate::outcome::{LaunchOutcome, WorkerExit, WorkerFailure};
use crate::port::{mentions_addr_in_use, pick_master_port};
use crate::reaper::GroupReaper;
use crate::signals::SignalWatch;
use crate::worker::Worker;

/// Attempts started again on a fresh port because the auto-picked one was taken; these do not
/// count against `--max-restarts`.
const MAX_PORT_RETRIES: u32 = 3;
/// How long to wait for output threads once every process of an attempt is gone.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);
/// How long to wait for workers to be reaped after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);
const STOP_POLL: Duration = Duration::from_millis(20);

enum AttemptEnd {
    Succeeded,
    /// Indices of the workers that failed by themselves, in the order seen.
    Failed(Vec<(usize, WorkerExit)>),
    Signalled(i32),
    /// The round ended on another node (multi-node jobs).
    Remote(Remote),
    /// The job ran past `LaunchConfig::deadline`.
    PastDeadline,
}

/// How long the exit barrier waits for the other nodes once this node's workers succeeded
/// (torchrun's `exit_barrier_timeout`).
const EXIT_BARRIER: Duration = Duration::from_secs(300);
/// After a local failure, how long to look for a remote cause (a node whose launcher died takes
/// its workers with it, and ours fail a moment later talking to them).
const REMOTE_CAUSE_WINDOW: Duration = Duration::from_millis(300);
/// A store silent for this long (the watcher polls it every tick) is taken as unreachable.
const STORE_SILENT: Duration = Duration::from_secs(1);

/// Starts the workers of this node and supervises them until the job succeeds, fails past
/// `max_restarts`, or the launcher is signalled. Blocks until every worker is gone. Must stay
/// on one thread: the workers' parent-death signal is tied to the thread that started them.
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    cfg.validate()?;
    let cfg = &cfg.with_job_secret()?;
    if cfg.live_recovery {
        return crate::live::launch_live(cfg);
    }
    let nproc = cfg.nproc_per_node.resolve()?;
    let deadline = cfg.deadline.map(|limit| Instant::now() + limit);
    let cores = available_cores();
    let signals =
        if cfg.forward_signals { SignalWatch::install()? } else { SignalWatch::disabled() };
    let pick = || {
        pick_master_port()
            .map_err(|error| LaunchError::NoFreePort { addr: cfg.master_addr.clone(), error })
    };
    // A port free to bind but just reported taken (by a process that has since let go, or
    // never held it) must not come back: the kernel hands a released port out again.
    let new_port_other_than = |old: u16| -> Result<u16, LaunchError> {
        let mut port = pick()?;
        for _ in 0..16 {
            if port != old {
                break;
            }
            port = pick()?;
        }
        Ok(port)
    };
    let mut port = match cfg.master_port {
        Some(p) => p,
        None => pick()?,
    };
    let job_log_dir = cfg.log_dir.as_ref().map(|d| d.join(&cfg.run_id));
    if let Some(dir) = &job_log_dir {
        std::fs::create_dir_all(dir)
            .map_err(|error| LaunchError::LogFile { path: dir.clone(), error })?;
    }
    let mut reaper = match GroupReaper::start() {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(%e, "cannot start the watchdog; a killed launcher may leave grandchildren");
            None
        }
    };
    let meeting = match (&cfg.rdzv_etcd, cfg.master_port) {
        (Some(endpoints), _) => Some(Meeting::Etcd(endpoints)),
        (None, Some(port)) => Some(Meeting::Node0 { master_addr: &cfg.master_addr, port }),
        (None, None) => None,
    };
    let agent = match (cfg.is_multi_node(), meeting) {
        (true, Some(meeting)) => Some(NodeAgent::start(
            meeting,
            &cfg.run_id,
            cfg.secret.as_ref(),
            cfg.node_rank,
            (cfg.min_nnodes.unwrap_or(cfg.nnodes), cfg.nnodes),
            cfg.rdzv_timeout,
        )?),
        _ => None,
    };
    let mut next_round = 0;
    let mut restart_count = 0;
    let mut port_retries = 0;
    loop {
        let round = match &agent {
            Some(a) => {
                let r = match a.join(next_round, nproc, pick_master_port)? {
                    Joined::Round(r) => r,
                    Joined::JobOver { round, nnodes } => {
                        cfg.on_event.emit(LaunchEvent::SpareNotNeeded { round, nnodes });
                        return Ok(LaunchOutcome {
                            exit_code: 0,
                            restarts: restart_count,
                            failures: Vec::new(),
                            signal: None,
                            master_port: port,
                            log_dir: job_log_dir.clone(),
                        });
                    }
                };
                next_round = r.index + 1;
                tracing::info!(
                    round = r.index,
                    nnodes = r.nnodes,
                    node_rank = r.node_rank,
                    "rendezvous"
                );
                port = r.worker_port;
                Some(r)
            }
            None => None,
        };
        let (nnodes, node_rank) =
            round.as_ref().map_or((cfg.nnodes, cfg.node_rank), |r| (r.nnodes, r.node_rank));
        let shape = JobShape {
            nnodes,
            nproc_per_node: nproc,
            node_rank,
            master_addr: cfg.master_addr.clone(),
            master_port: port,
            restart_count,
            max_restarts: cfg.max_restarts,
            run_id: cfg.run_id.clone(),
            // Each attempt's workers meet under a key scope of their own.
            etcd: cfg.rdzv_etcd.as_ref().map(|e| {
                let round = round.as_ref().map_or(restart_count, |r| r.index);
                (e.join(","), format!("{}.attempt{round}", cfg.run_id))
            }),
        };
        let attempt_dir = job_log_dir.as_ref().map(|d| d.join(format!("attempt_{restart_count}")));
        tracing::info!(restart_count, port, nproc, "starting workers");

        let mut workers = Vec::with_capacity(nproc as usize);
        for local_rank in 0..nproc {
            // (Each worker lists its own group with the watchdog before it execs.)
            match Worker::spawn(
                cfg,
                &shape,
                local_rank,
                cores,
                attempt_dir.as_deref(),
                reaper.as_ref(),
            ) {
                Ok(w) => workers.push(w),
                Err(e) => {
                    stop_all(&mut workers, Signal::SIGTERM, cfg.stop_grace, &signals);
                    drain_output(&mut workers);
                    return Err(e);
                }
            }
        }
        let round_watch = match (&agent, &round) {
            (Some(a), Some(r)) => Some(a.watch(r, cfg.monitor_interval)?),
            _ => None,
        };
        let mut remote = || round_watch.as_ref().and_then(RoundWatch::seen);
        let polls = Polls { interval: cfg.monitor_interval, deadline };
        let end =
            match watch(&mut workers, polls, &signals, &mut reaper, &mut remote, &cfg.on_event) {
                Ok(end) => end,
                Err(e) => {
                    stop_all(&mut workers, Signal::SIGTERM, cfg.stop_grace, &signals);
                    drain_output(&mut workers);
                    return Err(e);
                }
            };
        let stop_with = match end {
            AttemptEnd::Signalled(sig) => Signal::try_from(sig).unwrap_or(Signal::SIGTERM),
            _ => Signal::SIGTERM,
        };
        // Always stop: on success this removes anything the workers left running.
        stop_all(&mut workers, stop_with, cfg.stop_grace, &signals);
        drain_output(&mut workers);
        if let Some(r) = &mut reaper {
            for w in workers.iter().filter(|w| !group_has_live_members(w.pgid)) {
                r.forget_group(w.pgid);
            }
        }

        let end = match (&agent, &round, &round_watch) {
            (Some(a), Some(r), Some(w)) => settle_with_nodes(a, r, w, end, &workers, cfg)?,
            _ => end,
        };
        drop(round_watch);

        let outcome = |exit_code, failures, signal| LaunchOutcome {
            exit_code,
            restarts: restart_count,
            failures,
            signal,
            master_port: port,
            log_dir: job_log_dir.clone(),
        };
        match end {
            AttemptEnd::Succeeded => return Ok(outcome(0, Vec::new(), None)),
            AttemptEnd::PastDeadline => {
                let limit = cfg.deadline.unwrap_or_default();
                cfg.on_event.emit(LaunchEvent::PastDeadline { limit, nproc });
                return Ok(outcome(124, Vec::new(), None));
            }
            AttemptEnd::Signalled(sig) => {
                let o = outcome(128 + sig, Vec::new(), Some(sig));
                let max_restarts = cfg.max_restarts;
                cfg.on_event.emit(LaunchEvent::Ended { outcome: o.clone(), max_restarts });
                return Ok(o);
            }
            AttemptEnd::Remote(Remote::NodeWaiting { hostname }) => {
                // Not a failure: no restart is spent on admitting a node (as torchrun).
                cfg.on_event.emit(LaunchEvent::AdmittingNode { hostname, nproc });
                continue;
            }
            AttemptEnd::Remote(remote) => {
                let fatal = remote.is_fatal(cfg.min_nnodes.is_some());
                if !fatal && restart_count < cfg.max_restarts {
                    restart_count += 1;
                    cfg.on_event.emit(LaunchEvent::RestartingWithNodes {
                        cause: remote.to_string(),
                        nproc,
                        restart: restart_count,
                        max_restarts: cfg.max_restarts,
                    });
                    continue;
                }
                cfg.on_event.emit(LaunchEvent::FailedOnNodes {
                    cause: remote.to_string(),
                    node_needed: fatal && matches!(remote, Remote::NodeLost { .. }),
                });
                return Ok(outcome(1, Vec::new(), None));
            }
            AttemptEnd::Failed(failed) => {
                let failures: Vec<WorkerFailure> = failed
                    .iter()
                    .map(|&(i, exit)| WorkerFailure {
                        rank: workers[i].rank,
                        local_rank: workers[i].local_rank,
                        node_rank: cfg.node_rank,
                        exit,
                        stderr_tail: workers[i].stderr_lines(),
                    })
                    .collect();
                let root = &failures[0];
                let port_taken = cfg.master_port.is_none()
                    && workers
                        .iter()
                        .any(|w| w.stderr_lines().iter().any(|l| mentions_addr_in_use(l)));
                if port_taken && agent.is_none() && port_retries < MAX_PORT_RETRIES {
                    port_retries += 1;
                    let old = port;
                    port = new_port_other_than(old)?;
                    cfg.on_event.emit(LaunchEvent::PortTaken { old, new: port });
                    continue;
                }
                if restart_count < cfg.max_restarts {
                    restart_count += 1;
                    cfg.on_event.emit(LaunchEvent::Restarting {
                        rank: root.rank,
                        exit: root.exit,
                        nproc,
                        restart: restart_count,
                        max_restarts: cfg.max_restarts,
                    });
                    if cfg.master_port.is_none() {
                        port = new_port_other_than(port)?;
                    }
                    continue;
                }
                let o = outcome(root.exit.launcher_exit_code(), failures, None);
                let max_restarts = cfg.max_restarts;
                cfg.on_event.emit(LaunchEvent::Ended { outcome: o.clone(), max_restarts });
                return Ok(o);
            }
        }
    }
}

/// How [`watch`] polls: every `interval`, until `deadline` when there is one.
#[derive(Clone, Copy)]
struct Polls {
    interval: Duration,
    deadline: Option<Instant>,
}

/// Checks the workers every `polls.interval`, and at once when one exits, until one fails, all
/// succeed, a signal arrives or the deadline passes; keeps the watchdog alive meanwhile.
fn watch(
    workers: &mut [Worker],
    polls: Polls,
    signals: &SignalWatch,
    reaper: &mut Option<GroupReaper>,
    remote: &mut dyn FnMut() -> Option<Remote>,
    events: &EventSink,
) -> Result<AttemptEnd, LaunchError> {
    let mut grace_until: Option<Instant> = None;
    loop {
        if let Some((sig, _)) = signals.received() {
            return Ok(AttemptEnd::Signalled(sig));
        }
        if let Some(r) = remote() {
            return Ok(AttemptEnd::Remote(r));
        }
        replace_dead_reaper(reaper, workers, events);
        let mut failed = Vec::new();
        let mut running = 0;
        for (i, w) in workers.iter_mut().enumerate() {
            match w.poll()? {
                None => running += 1,
                Some(status) if !status.success() => {
                    failed.push((i, WorkerExit::from_status(status)))
                }
                Some(_) => {}
            }
        }
        if !failed.is_empty() {
            // Ranks that fail together exit within milliseconds of each other, and the first
            // to exit may only report what another did (a lost peer, a peer's failed save):
            // the others get one interval to be seen too, so the root cause is chosen among
            // them all (the pause wakes at each exit).
            let until = *grace_until.get_or_insert_with(|| Instant::now() + polls.interval);
            if running == 0 || Instant::now() >= until {
                return Ok(AttemptEnd::Failed(failed));
            }
            signals.pause(until.saturating_duration_since(Instant::now()));
            continue;
        }
        if running == 0 {
            return Ok(AttemptEnd::Succeeded);
        }
        if polls.deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(AttemptEnd::PastDeadline);
        }
        // Until the next check, or sooner: a signal or a worker's exit wakes the pause.
        signals.pause(polls.interval);
    }
}

/// Squares this node's view of a round with the other nodes': a local failure is reported to
/// them (unless a remote cause explains it), and a local success waits at the exit barrier.
fn settle_with_nodes(
    agent: &NodeAgent,
    round: &Round,
    watch: &RoundWatch,
    end: AttemptEnd,
    workers: &[Worker],
    cfg: &LaunchConfig,
) -> Result<AttemptEnd, LaunchError> {
    match end {
        AttemptEnd::Failed(failed) if watch.silent_for() > STORE_SILENT => {
            // Cut off from the host: no report can come in or go out; do not wait for one.
            cfg.on_event.emit(LaunchEvent::HostSilent { silent: watch.silent_for() });
            Ok(AttemptEnd::Failed(failed))
        }
        AttemptEnd::Failed(failed) => {
            // A worker killed by a signal is a root cause; one that exited with an error may
            // have lost a peer on another node, whose launcher may be about to say so.
            let window = match failed[0].1 {
                WorkerExit::Signal(_) => Duration::ZERO,
                WorkerExit::Code(_) => REMOTE_CAUSE_WINDOW,
            };
            let start = Instant::now();
            loop {
                if let Some(r) = watch.seen() {
                    return Ok(AttemptEnd::Remote(r));
                }
                if start.elapsed() >= window {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let (i, exit) = failed[0];
            let msg = format!(
                "rank {} (local rank {} on node {}, {}) failed with {exit}",
                workers[i].rank,
                workers[i].local_rank,
                round.node_rank,
                agent.hostname()
            );
            if let Err(e) = agent.report_failure(round, &msg) {
                cfg.on_event.emit(LaunchEvent::NodesNotTold { error: e.to_string() });
            }
            Ok(AttemptEnd::Failed(failed))
        }
        AttemptEnd::Succeeded => match agent.finish(round, watch, EXIT_BARRIER)? {
            Finish::AllDone => Ok(AttemptEnd::Succeeded),
            Finish::Remote(r) => Ok(AttemptEnd::Remote(r)),
        },
        other => Ok(other),
    }
}

/// A watchdog that died (somebody killed it) is reaped, reported, and replaced by a new one that
/// lists the running workers' groups, so the no-orphans guarantee holds again.
fn replace_dead_reaper(reaper: &mut Option<GroupReaper>, workers: &[Worker], events: &EventSink) {
    let Some(old) = reaper.as_mut() else { return };
    let old_pid = old.pid();
    let Some(how) = old.check_dead() else { return };
    *reaper = GroupReaper::start().ok();
    if let Some(r) = reaper {
        for w in workers.iter().filter(|w| w.status.is_none() || group_has_live_members(w.pgid)) {
            r.watch_group(w.pgid);
        }
    }
    let new_pid = reaper.as_ref().map(GroupReaper::pid);
    events.emit(LaunchEvent::WatchdogReplaced { old_pid, how, new_pid });
}

/// Sends `sig` to every worker's process group, waits up to `grace` for every process in
/// those groups to end, then SIGKILLs the groups and reaps the workers. A second signal to the
/// launcher cuts the grace period short.
pub(crate) fn stop_all(
    workers: &mut [Worker],
    sig: Signal,
    grace: Duration,
    signals: &SignalWatch,
) {
    let signals_before = signals.received().map_or(0, |(_, n)| n);
    for w in workers.iter_mut() {
        if w.status.is_none() || group_has_live_members(w.pgid) {
            send_to_group(w.pgid, sig);
        }
    }
    let deadline = Instant::now() + grace;
    loop {
        for w in workers.iter_mut() {
            let _ = w.poll();
        }
        let all_gone =
            workers.iter().all(|w| w.status.is_some() && !group_has_live_members(w.pgid));
        if all_gone {
            return;
        }
        let escalated = signals.received().map_or(0, |(_, n)| n) > signals_before;
        if Instant::now() >= deadline || escalated {
            break;
        }
        std::thread::sleep(STOP_POLL);
    }
    for w in workers.iter() {
        send_to_group(w.pgid, Signal::SIGKILL);
    }
    let deadline = Instant::now() + KILL_WAIT;
    while Instant::now() < deadline {
        let mut pending = false;
        for w in workers.iter_mut() {
            pending |= matches!(w.poll(), Ok(None));
        }
        if !pending {
            return;
        }
        std::thread::sleep(STOP_POLL);
    }
    for w in workers.iter() {
        if w.status.is_none() {
            tracing::warn!(
                rank = w.rank,
                "worker survived SIGKILL for {KILL_WAIT:?} (uninterruptible sleep?)"
            );
        }
    }
}

fn send_to_group(pgid: i32, sig: Signal) {
    match killpg(Pid::from_raw(pgid), sig) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => tracing::warn!(pgid, %e, "cannot signal process group"),
    }
}

/// Whether any process of group `pgid` is still running. Zombies do not count: orphans that
/// were re-parented to an init that has not reaped them yet are already dead.
fn group_has_live_members(pgid: i32) -> bool {
    if killpg(Pid::from_raw(pgid), None) == Err(Errno::ESRCH) {
        return false;
    }
    let Ok(dir) = std::fs::read_dir("/proc") else { return true };
    for entry in dir.filter_map(Result::ok) {
        let name = entry.file_name();
        if !name.as_encoded_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else { continue };
        let mut fields = after.split_whitespace();
        let (state, _ppid, pgrp) = (fields.next(), fields.next(), fields.next());
        if pgrp.and_then(|p| p.parse::<i32>().ok()) == Some(pgid)
            && !matches!(state, Some("Z") | Some("X"))
        {
            return true;
        }
    }
    false
}

/// Waits (bounded) for the output threads, so the last lines reach the console and the
/// stderr tails are complete. A process that escaped its group could hold a pipe open forever;
/// its thread is then left behind rather than hanging the launcher.
pub(crate) fn drain_output(workers: &mut [Worker]) {
    let deadline = Instant::now() + OUTPUT_DRAIN;
    while Instant::now() < deadline && !workers.iter().all(|w| w.output_done()) {
        std::thread::sleep(Duration::from_millis(5));
    }
    for w in workers.iter_mut() {
        if w.output_done() {
            w.join_output();
        }
    }
}
