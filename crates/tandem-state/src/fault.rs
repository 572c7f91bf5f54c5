//! Test-only fault injection for live recovery: a rank kills itself (SIGKILL, as the OOM killer
//! or a lost machine would) at an exact point of a step, so the tests can reach the points an
//! outside `kill -9` hits only by chance. Compiled in only with the `fault-injection` feature
//! (the test build turns it on; a release build has no self-kill in it), and even then off
//! unless `TANDEM_TEST_FAULT` is set. A build without it refuses a job that sets the variable
//! ([`check_build`]) rather than run it without the faults the test counts on.
//!
//! `TANDEM_TEST_FAULT=PHASE@STEP` and `TANDEM_TEST_FAULT_MEMBER=M[,M...]`: the processes of
//! those member slots (their first start only, never a replacement) die at PHASE of step STEP
//! (1-based, the step being taken):
//!
//! - `forward`: after the forward pass;
//! - `allreduce`: inside the gradient all-reduce (from Ddp's comm hook, so the others are in
//!   the same collective);
//! - `optimizer`: gradients reduced, before the update;
//! - `save`: inside a checkpoint save (`--save-every`), before the rank reaches its barrier;
//! - `send`: while sending its state to a re-formed world as its source (STEP ignored).
//!
//! `TANDEM_TEST_FAULT_SEND_MEMBER=M` adds a `send` fault for member M beside the one above
//! (a test that kills one rank and then the source of the regroup that follows).
//!
//! `TANDEM_TEST_FAULT_HOLD=SECS`: a survivor waits SECS before it regroups after a failure (as
//! one deep in a long step notices late), so the dead member's replacement is ready first and
//! joins in the same regroup.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tandem_comm::{Collectives, CommSource};
use tandem_ddp::{CommHook, GradBucket};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Forward,
    AllReduce,
    Optimizer,
    Save,
    Send,
    /// After the last step: the final verification and outputs (any step).
    Conclude,
}

#[derive(Debug)]
struct Fault {
    phase: Phase,
    step: u64,
}

static FAULT: OnceLock<Option<Fault>> = OnceLock::new();
/// The step being taken, for the comm hook (which runs on Ddp's communication thread).
static STEP: AtomicU64 = AtomicU64::new(0);

fn parse() -> Option<Fault> {
    let spec = std::env::var("TANDEM_TEST_FAULT").ok()?;
    if std::env::var_os(tandem_comm::live::LIVE_REPLACEMENT_VAR).is_some() {
        return None;
    }
    let me = std::env::var("RANK").ok()?;
    let members = std::env::var("TANDEM_TEST_FAULT_MEMBER").ok()?;
    if !members.split(',').any(|m| m.trim() == me) {
        return None;
    }
    let (phase, step) = spec.split_once('@').unwrap_or((spec.as_str(), "0"));
    let phase = match phase {
        "forward" => Phase::Forward,
        "allreduce" => Phase::AllReduce,
        "optimizer" => Phase::Optimizer,
        "save" => Phase::Save,
        "send" => Phase::Send,
        "conclude" => Phase::Conclude,
        other => panic!("TANDEM_TEST_FAULT: unknown phase `{other}`"),
    };
    Some(Fault { phase, step: step.parse().unwrap_or(0) })
}

fn fault() -> Option<&'static Fault> {
    FAULT.get_or_init(parse).as_ref()
}

/// Whether faults are asked for in this job at all (every rank then registers the comm hook,
/// so their hooks agree).
pub fn armed() -> bool {
    cfg!(feature = "fault-injection") && asked()
}

fn asked() -> bool {
    ["TANDEM_TEST_FAULT", "TANDEM_TEST_FAULT_SEND_MEMBER", "TANDEM_TEST_FAULT_HOLD"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Waits `TANDEM_TEST_FAULT_HOLD` seconds, if set (a survivor before it regroups).
pub fn hold_before_regroup() {
    if !cfg!(feature = "fault-injection") {
        return;
    }
    let hold = std::env::var("TANDEM_TEST_FAULT_HOLD").ok().and_then(|s| s.parse::<f64>().ok());
    if let Some(secs) = hold.filter(|s| s.is_finite() && *s > 0.0) {
        std::thread::sleep(std::time::Duration::from_secs_f64(secs));
    }
}

/// Faults asked for in a build that cannot inject them: a test would wait for a death that
/// never comes.
pub fn check_build() -> crate::error::Result<()> {
    if asked() && !cfg!(feature = "fault-injection") {
        crate::error::bail!(
            "TANDEM_TEST_FAULT is set, but this build has no fault injection (build \
             tandem-train with the `fault-injection` feature; the test build does)"
        );
    }
    Ok(())
}

/// Records the step being taken (1-based).
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::SeqCst);
}

/// Whether this process (a first start, not a replacement) is member `TANDEM_TEST_FAULT_SEND_MEMBER`.
fn send_member() -> bool {
    static SEND: OnceLock<bool> = OnceLock::new();
    *SEND.get_or_init(|| {
        std::env::var_os(tandem_comm::live::LIVE_REPLACEMENT_VAR).is_none()
            && std::env::var("TANDEM_TEST_FAULT_SEND_MEMBER")
                .ok()
                .is_some_and(|m| std::env::var("RANK").is_ok_and(|r| r == m.trim()))
    })
}

/// Dies here if this process is the one to die at `phase` of the current step.
pub fn hit(phase: Phase) {
    if !cfg!(feature = "fault-injection") {
        return;
    }
    if phase == Phase::Send && send_member() {
        die(phase, 0);
    }
    let Some(f) = fault() else { return };
    let any_step = matches!(phase, Phase::Send | Phase::Conclude);
    if f.phase == phase && (any_step || f.step == STEP.load(Ordering::SeqCst)) {
        die(phase, f.step);
    }
}

#[cfg(feature = "fault-injection")]
fn die(phase: Phase, step: u64) {
    let member = std::env::var("RANK").unwrap_or_default();
    tracing::warn!("fault injection: member {member} dies at {phase:?} of step {step}");
    // SAFETY: kill(2) on this process; no memory is touched.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort();
}

#[cfg(not(feature = "fault-injection"))]
fn die(_phase: Phase, _step: u64) {}

/// Ddp's all-reduce average with the `allreduce` fault point in front.
pub struct FaultHook;

impl CommHook for FaultHook {
    fn name(&self) -> &str {
        "allreduce"
    }
    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource> {
        hit(Phase::AllReduce);
        comm.all_reduce_avg(bucket.buffer)
    }
}

/// The hook, for `Ddp::register_comm_hook`.
pub fn hook() -> Arc<dyn CommHook> {
    Arc::new(FaultHook)
}
