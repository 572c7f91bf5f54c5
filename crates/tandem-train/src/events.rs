//! What a training run reports as it happens, as types: the [`Trainer`](crate::Trainer) and the
//! recipes report [`Event`]s to the [`Logger`]s they are given (through a [`Reporter`]), and
//! never print. The run directory's files (`metrics.jsonl`, TensorBoard, a recipe's own opened
//! through an [`OpenLog`]) are loggers; so are the `tandem` binary's progress bar and lines, and
//! a benchmark reads the metrics file's records instead of a program's text.
//!
//! Each event is reported once, by the rank it concerns: the world's (steps, epochs,
//! validation, checkpoints, a resume, a regroup, the summary) by rank 0, a member joining a
//! live job by that member. Warnings about files a run reads or leaves behind (a checkpoint
//! skipped, a save left uncommitted) are `tracing` warnings: the binary shows them, a library
//! user's subscriber decides.
//!
//! ```ignore
//! struct Lines(std::io::Stderr);
//! impl Logger for Lines {
//!     fn log(&mut self, event: &Event) -> std::io::Result<()> {
//!         match event.line() {
//!             Some(line) => writeln!(self.0, "{line}"),
//!             None => Ok(()),
//!         }
//!     }
//! }
//! let trainer = Trainer::new(recipe, loader, step, group, options)?.reporter(Reporter::new().with(Lines(std::io::stderr())));
//! ```
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use crate::live::Regroup;
use crate::live::WorldChange;
use crate::metrics::{EpochMetrics, MetricsFile, MetricsRecord, RunSummary, ValidationMetrics};
pub use tandem_state::{MirrorCost, RegroupCounts, Resplit};

/// One thing a run reports.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// Training (re)starts: `total` steps in the run, `done` of them already (a resume, or a
    /// live world re-formed).
    Started { total: u64, done: u64 },
    /// A step finished.
    Step(StepEvent),
    /// An epoch ended: the world's figures, and the run's epoch count.
    EpochEnded { metrics: EpochMetrics, epochs: u64 },
    /// The recipe's validation sets were scored after `step`
    /// ([`Recipe::validate`](crate::Recipe::validate)).
    Validated { step: u64, results: Vec<ValidationMetrics> },
    /// A checkpoint of `step` was written (`path` on rank 0; a background save's is where it
    /// lands once committed).
    CheckpointSaved { step: u64, path: Option<PathBuf> },
    /// Training resumed from a checkpoint.
    Resumed { path: PathBuf, epoch: u64, step: u64, note: Option<String> },
    /// A live world re-formed (a rank died, or one joins).
    Regrouped(Regroup),
    /// This process (a replacement, or an original member) joined a running live job.
    Joined { member: String, change: WorldChange },
    /// What live recovery's mirrors of per-rank state cost over the run.
    MirrorCost(MirrorCost),
    /// A fact about the run's set-up a user should see (what `--init-from` loaded, which NCCL
    /// communicator, that a resume found nothing, what an export wrote).
    Note(String),
    /// The run ended; every rank agrees.
    Finished(Box<RunSummary>),
}

/// One step, as rank 0 saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepEvent {
    /// 1-based.
    pub global_step: u64,
    /// This step's loss, once it reached the host (a GPU step's loss arrives a few steps
    /// late; then the newest one that arrived).
    pub loss: Option<f64>,
    /// The epoch's mean loss so far.
    pub epoch_loss: f64,
    /// 0-based.
    pub epoch: u64,
    pub lr: f64,
    /// Samples this rank took.
    pub batch: usize,
    /// The GradScaler's scale when training in f16.
    pub grad_scale: Option<f64>,
}

impl Event {
    /// The event as one line of text for a console (as `tandem train` prints it), or `None`
    /// for what a console shows otherwise (steps move a progress bar).
    pub fn line(&self) -> Option<String> {
        Some(match self {
            Event::Started { .. } | Event::Step(_) | Event::CheckpointSaved { .. } => return None,
            Event::Finished(_) => return None,
            Event::EpochEnded { metrics, epochs } => epoch_line(metrics, *epochs),
            Event::Validated { step, results } => results
                .iter()
                .map(|r| format!("[{}][{step}] accuracy-flip: {:.5}+-{:.5}", r.name, r.accuracy, r.std))
                .collect::<Vec<_>>()
                .join("\n"),
            Event::Resumed { path, epoch, step, note } => {
                let mut s = format!("resumed from {} (epoch {epoch}, step {step})", path.display());
                if let Some(note) = note {
                    s = format!("{s}\n{note}");
                }
                s
            }
            Event::Regrouped(r) => {
                let mut s = format!(
                    "live: regrouped ({}): {}; {} step(s) redone",
                    r.cause, r.change, r.redone
                );
                if let Some(resplit) = &r.resplit {
                    s = format!("{s}\nlive: {resplit}");
                }
                s
            }
            Event::Joined { member, change } => {
                format!("live: member {member} joined the running job: {change}")
            }
            Event::MirrorCost(m) => format!(
                "live: {} mirror every {} step(s): {} taken, {} KiB sent per rank each, {:.2} ms each on rank 0",
                m.what,
                m.every,
                m.taken,
                m.bytes_per_rank.div_ceil(1024),
                m.mean_secs * 1e3
            ),
            Event::Note(text) => text.clone(),
        })
    }
}

/// `epoch E/N step S loss=L [eval_loss=.. eval_accuracy=..] samples/s=.. lr=..[ loss_scale=..
/// skipped_steps=..][ verification_accuracy=.. NAME=ACC+-STD ...]`.
pub fn epoch_line(m: &EpochMetrics, epochs: u64) -> String {
    let mut line = format!("epoch {}/{epochs} step {} loss={:.4}", m.epoch, m.step, m.train_loss);
    if let (Some(l), Some(a)) = (m.eval_loss, m.eval_accuracy) {
        line += &format!(" eval_loss={l:.4} eval_accuracy={a:.4}");
    }
    let rate = crate::metrics::three_figures(m.samples_per_s);
    line += &format!(" samples/s={rate} lr={}", m.lr);
    if let Some(s) = m.loss_scale {
        line += &format!(" loss_scale={s} skipped_steps={}", m.skipped_steps);
    }
    line + &validation_text(&m.verification)
}

/// ` verification_accuracy=X NAME=ACC+-STD ...` (empty without results).
pub fn validation_text(results: &[ValidationMetrics]) -> String {
    let Some(first) = results.first() else { return String::new() };
    let mut s = format!(" verification_accuracy={:.4}", first.accuracy);
    for r in results {
        s += &format!(" {}={:.4}+-{:.4}", r.name, r.accuracy, r.std);
    }
    s
}

/// Where events go: a logger writes a file, draws a bar, prints lines, or keeps them for a
/// test. An error ends the run (a metrics file that cannot be written is not silently lost).
pub trait Logger: Send {
    fn log(&mut self, event: &Event) -> std::io::Result<()>;
}

/// What an [`OpenLog`] is told: the run directory, and where the run stands.
#[derive(Clone, Copy, Debug)]
pub struct LogSetup<'a> {
    pub dir: &'a Path,
    /// Ranks in the world.
    pub world: usize,
    /// The run's steps in all.
    pub total_steps: u64,
    /// The step training (re)starts from.
    pub start_step: u64,
}

type OpenFn = dyn Fn(&LogSetup) -> std::io::Result<Box<dyn Logger>> + Send + Sync;

/// A logger of the run directory beside the metrics file and TensorBoard, opened by rank 0
/// when training starts — and again by whichever process becomes rank 0 under live recovery
/// (so it should append): a recipe's own file, as tandem-recipes' `training.log` in
/// arcface_torch's format ([`TrainerOptions::log_files`](crate::TrainerOptions::log_files)).
#[derive(Clone)]
pub struct OpenLog(Arc<OpenFn>);

impl OpenLog {
    pub fn new(
        open: impl Fn(&LogSetup) -> std::io::Result<Box<dyn Logger>> + Send + Sync + 'static,
    ) -> Self {
        OpenLog(Arc::new(open))
    }

    /// The logger, its file opened in `setup.dir`.
    pub fn open(&self, setup: &LogSetup) -> std::io::Result<Box<dyn Logger>> {
        (self.0)(setup)
    }
}

impl std::fmt::Debug for OpenLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpenLog")
    }
}

/// Writes each event's [`Event::line`] to `W` (`Lines(std::io::stdout())`: the lines `tandem
/// train` prints, without its progress bar).
pub struct Lines<W>(pub W);

impl<W: std::io::Write + Send> Logger for Lines<W> {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        match event.line() {
            Some(line) => writeln!(self.0, "{line}"),
            None => Ok(()),
        }
    }
}

/// The loggers a run was given, shared by the trainer and its recipe (clones report to the
/// same loggers). Reports nothing without loggers.
#[derive(Clone, Default)]
pub struct Reporter {
    loggers: Arc<Mutex<Vec<Box<dyn Logger>>>>,
}

impl Reporter {
    pub fn new() -> Self {
        Reporter::default()
    }

    /// Adds `logger` (events reach loggers in the order they were added).
    pub fn with(self, logger: impl Logger + 'static) -> Self {
        self.add(Box::new(logger));
        self
    }

    /// Adds `logger` to every clone of this reporter.
    pub fn add(&self, logger: Box<dyn Logger>) {
        self.lock().push(logger);
    }

    /// Puts `loggers` in front of this reporter's (a trainer's run-directory files).
    pub(crate) fn add_first(&self, mut loggers: Vec<Box<dyn Logger>>) {
        let mut mine = self.lock();
        loggers.append(&mut mine);
        *mine = loggers;
    }

    /// Takes every logger out of this reporter (and its clones).
    pub(crate) fn take_all(&self) -> Vec<Box<dyn Logger>> {
        std::mem::take(&mut *self.lock())
    }

    /// Reports `event` to every logger; the first failure is returned after all were tried.
    pub fn report(&self, event: &Event) -> std::io::Result<()> {
        let mut first = Ok(());
        for logger in self.lock().iter_mut() {
            let logged = logger.log(event);
            if first.is_ok() {
                first = logged;
            }
        }
        first
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Box<dyn Logger>>> {
        // A logger that panicked mid-event leaves nothing half-done the others depend on.
        self.loggers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reporter({} logger(s))", self.lock().len())
    }
}

/// A logger that keeps every event (for tests and for programs that read a run's events).
#[derive(Clone, Default)]
pub struct Recorder {
    events: Arc<Mutex<Vec<Event>>>,
}

impl Recorder {
    pub fn new() -> Self {
        Recorder::default()
    }

    /// The events so far, in order.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

impl Logger for Recorder {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        if let Ok(mut events) = self.events.lock() {
            events.push(event.clone());
        }
        Ok(())
    }
}

/// The run's metrics file (`metrics.jsonl`) logs the events a script reads back.
impl Logger for MetricsFile {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        let record = match event {
            Event::EpochEnded { metrics, .. } => MetricsRecord::Epoch(metrics.clone()),
            Event::Finished(summary) => MetricsRecord::Summary((**summary).clone()),
            Event::Regrouped(r) => MetricsRecord::Regrouped(r.clone()),
            Event::MirrorCost(m) => MetricsRecord::MirrorCost(m.clone()),
            _ => return Ok(()),
        };
        self.write(&record).map_err(std::io::Error::other)
    }
}
