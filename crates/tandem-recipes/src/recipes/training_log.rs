//! `RUN/training.log`: arcface_torch's log, line for line (`utils_logging.init_logging`,
//! `CallBackLogging`, `CallBackVerification`), so the tools people point at it keep working:
//! every line `Training: <local time>-<message>`; `rank_id: 0` first; every `frequent` steps
//! (after the first `frequent`, which starts the clock) `Speed .. samples/sec   Loss ..
//! LearningRate ..   Epoch: ..   Global Step: ..   [Fp16 Grad Scale: ..   ]Required: .. hours`
//! with the loss averaged over the steps since the last line; and per verification set
//! `[NAME][STEP]XNorm: ..`, `Accuracy-Flip: ..+-..` and `Accuracy-Highest: ..`. Written by rank
//! 0, appended to (a resumed run continues the file); the Trainer opens it through
//! [`open`] (an `OpenLog` among its options' `log_files`).
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tandem_train::events::{Event, LogSetup, Logger, OpenLog, StepEvent};
use tandem_train::metrics::ValidationMetrics;

use crate::face_eval::verification::XNORM;

/// `training.log` with a line every `frequent` steps, for the Trainer's `log_files`.
pub(crate) fn open(frequent: u64) -> OpenLog {
    OpenLog::new(move |s: &LogSetup| {
        let log = TrainingLog::open(s.dir, frequent, s.world, s.total_steps, s.start_step)?;
        Ok(Box::new(log) as Box<dyn Logger>)
    })
}

pub struct TrainingLog {
    file: File,
    path: PathBuf,
    /// Steps between lines (arcface_torch's `frequent`).
    frequent: u64,
    /// Ranks x images per rank per step.
    world: u64,
    total_steps: u64,
    start_step: u64,
    started: Instant,
    /// When the previous line was written (`None` until the first `frequent` step).
    tic: Option<Instant>,
    loss_sum: f64,
    loss_count: u64,
    highest: BTreeMap<String, f64>,
}

impl TrainingLog {
    /// Appends to `dir/training.log`; `start_step` is the step training resumes from.
    pub fn open(
        dir: &Path,
        frequent: u64,
        world: usize,
        total_steps: u64,
        start_step: u64,
    ) -> std::io::Result<TrainingLog> {
        let path = dir.join("training.log");
        let opened = std::fs::OpenOptions::new().create(true).append(true).open(&path);
        let file = opened.map_err(|e| with_path(&path, e))?;
        let mut log = TrainingLog {
            file,
            path,
            frequent: frequent.max(1),
            world: world as u64,
            total_steps,
            start_step,
            started: Instant::now(),
            tic: None,
            loss_sum: 0.0,
            loss_count: 0,
            highest: BTreeMap::new(),
        };
        log.line("rank_id: 0")?;
        Ok(log)
    }

    fn line(&mut self, message: &str) -> std::io::Result<()> {
        // Python logging's asctime: local time, milliseconds after a comma.
        let now = chrono::Local::now().format("%Y-%m-%d %H:%M:%S,%3f");
        writeln!(self.file, "Training: {now}-{message}")?;
        self.file.flush()
    }

    /// One step: its loss joins the average; every `frequent` steps a line.
    pub fn step(&mut self, s: &StepEvent) -> std::io::Result<()> {
        if let Some(loss) = s.loss.filter(|l| l.is_finite()) {
            self.loss_sum += loss;
            self.loss_count += 1;
        }
        if s.global_step == 0 || !s.global_step.is_multiple_of(self.frequent) {
            return Ok(());
        }
        let Some(tic) = self.tic.replace(Instant::now()) else { return Ok(()) };
        let secs = tic.elapsed().as_secs_f64();
        let speed = if secs > 0.0 {
            (self.frequent * s.batch as u64 * self.world) as f64 / secs
        } else {
            f64::INFINITY
        };
        // arcface_torch: whole seconds so far over the steps done, times the steps left.
        let elapsed = self.started.elapsed().as_secs() as f64;
        let per_step = elapsed / (s.global_step - self.start_step.min(s.global_step) + 1) as f64;
        let left = self.total_steps.saturating_sub(s.global_step + 1) as f64;
        let hours = per_step * left / 3600.0;
        let loss = if self.loss_count > 0 { self.loss_sum / self.loss_count as f64 } else { 0.0 };
        let scale =
            s.grad_scale.map(|g| format!("Fp16 Grad Scale: {g:2.0}   ")).unwrap_or_default();
        let message = format!(
            "Speed {speed:.2} samples/sec   Loss {loss:.4}   LearningRate {:.6}   Epoch: {}   \
             Global Step: {}   {scale}Required: {hours:1.0} hours",
            s.lr, s.epoch, s.global_step
        );
        self.loss_sum = 0.0;
        self.loss_count = 0;
        self.line(&message)
    }

    /// The verification sets' lines at `step`.
    pub fn verification(
        &mut self,
        step: u64,
        results: &[ValidationMetrics],
    ) -> std::io::Result<()> {
        for r in results {
            let xnorm = r.figure(XNORM).unwrap_or(0.0);
            self.line(&format!("[{}][{step}]XNorm: {xnorm:.6}", r.name))?;
            self.line(&format!(
                "[{}][{step}]Accuracy-Flip: {:1.5}+-{:1.5}",
                r.name, r.accuracy, r.std
            ))?;
            let best = self.highest.entry(r.name.clone()).or_insert(0.0);
            if r.accuracy > *best {
                *best = r.accuracy;
            }
            let best = *best;
            self.line(&format!("[{}][{step}]Accuracy-Highest: {best:1.5}", r.name))?;
        }
        Ok(())
    }
}

impl Logger for TrainingLog {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        let logged = match event {
            Event::Step(s) => self.step(s),
            Event::Validated { step, results } => self.verification(*step, results),
            _ => Ok(()),
        };
        logged.map_err(|e| with_path(&self.path, e))
    }
}

fn with_path(path: &Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(dir: &Path) -> Vec<String> {
        std::fs::read_to_string(dir.join("training.log"))
            .unwrap()
            .lines()
            .map(|l| {
                // Past "Training: YYYY-MM-DD HH:MM:SS,mmm-".
                assert!(l.starts_with("Training: ") && l.as_bytes()[33] == b'-', "{l}");
                l[34..].to_string()
            })
            .collect()
    }

    #[test]
    fn lines_are_arcface_torch_s() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = TrainingLog::open(dir.path(), 2, 2, 10, 0).unwrap();
        for step in 1..=6u64 {
            let s = StepEvent {
                global_step: step,
                loss: Some(step as f64),
                epoch_loss: 0.0,
                epoch: 0,
                lr: 0.1,
                batch: 4,
                grad_scale: (step > 4).then_some(65536.0),
            };
            log.step(&s).unwrap();
        }
        let v =
            |name: &str, accuracy| ValidationMetrics::new(name, accuracy, 0.01).with(XNORM, 22.5);
        log.verification(6, &[v("lfw", 0.9)]).unwrap();
        log.verification(8, &[v("lfw", 0.8)]).unwrap();
        let l = lines(dir.path());
        assert_eq!(l[0], "rank_id: 0");
        assert_eq!(l.len(), 1 + 2 + 6, "{l:?}");
        // Step 2 starts the clock; step 4 averages steps 1..4, step 6 steps 5 and 6.
        assert!(l[1].starts_with("Speed ") && l[1].contains("   Loss 2.5000   LearningRate 0.100000   Epoch: 0   Global Step: 4   Required: "), "{}", l[1]);
        assert!(
            l[2].contains("Loss 5.5000")
                && l[2].contains("Global Step: 6   Fp16 Grad Scale: 65536   Required: "),
            "{}",
            l[2]
        );
        assert!(l[2].ends_with(" hours"), "{}", l[2]);
        assert_eq!(l[3], "[lfw][6]XNorm: 22.500000");
        assert_eq!(l[4], "[lfw][6]Accuracy-Flip: 0.90000+-0.01000");
        assert_eq!(l[5], "[lfw][6]Accuracy-Highest: 0.90000");
        assert_eq!(l[8], "[lfw][8]Accuracy-Highest: 0.90000", "the highest so far");
    }
}
