//! Where a step's time and loss go: [`StepTimes`] (seconds per phase over the run) and the
//! epoch's loss queue (device losses read a few steps late, so the host never waits for the
//! GPU inside a step).
use crate::trainer::StepReport;
use crate::Result;

/// Steps whose loss is read back from the device this many steps later: the host runs ahead of
/// the GPU by up to that many steps instead of waiting for every step's end.
pub(super) const LOSS_READ_LAG: usize = 2;

/// An epoch's losses: summed as they reach the host, the device ones a few steps late.
#[derive(Default)]
pub(super) struct LossQueue {
    pub sum: f64,
    pub samples: usize,
    pending: std::collections::VecDeque<(usize, candle_core::Tensor)>,
    /// The newest step loss that reached the host since `settle` last returned one.
    fresh: Option<f64>,
}

impl LossQueue {
    pub fn push(&mut self, samples: usize, loss: f64, pending: Option<candle_core::Tensor>) {
        match pending {
            Some(t) => self.pending.push_back((samples, t)),
            None => {
                self.sum += loss * samples as f64;
                self.samples += samples;
                self.fresh = Some(loss);
            }
        }
    }

    /// The mean loss over the samples read so far.
    pub fn mean(&self) -> f64 {
        self.sum / self.samples.max(1) as f64
    }

    /// Reads the device losses until at most `keep` remain; returns the newest step loss that
    /// reached the host since the last call (a host loss pushed, or the last device one read).
    pub fn settle(&mut self, keep: usize) -> Result<Option<f64>> {
        while self.pending.len() > keep {
            let Some((samples, t)) = self.pending.pop_front() else { break };
            let v = t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            self.sum += v * samples as f64;
            self.samples += samples;
            self.fresh = Some(v);
        }
        Ok(self.fresh.take())
    }
}

/// Where a rank's step time goes (seconds summed over the run's steps).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    pub steps: u64,
    /// Waiting for the next batch (decoding runs ahead on the loader's threads).
    pub data: f64,
    pub forward: f64,
    /// The recipe's own phases ([`StepReport::phases`]), by name, in the order first seen.
    #[serde(default)]
    pub phases: Vec<(String, f64)>,
    /// Backward, with Ddp's bucketed all-reduce.
    pub backward: f64,
    /// Unscale, clipping, the optimizer step and the schedule.
    pub optimizer: f64,
    /// Checkpoint saves: how many, and the seconds training stood still for them (a
    /// background save's staging only; its writing overlaps the steps).
    #[serde(default)]
    pub saves: u64,
    #[serde(default)]
    pub save: f64,
}

impl StepTimes {
    pub(crate) fn add(&mut self, data: f64, r: &StepReport) {
        self.steps += 1;
        self.data += data;
        self.forward += r.forward_secs;
        for &(name, secs) in &r.phases {
            match self.phases.iter_mut().find(|(n, _)| n == name) {
                Some((_, total)) => *total += secs,
                None => self.phases.push((name.to_string(), secs)),
            }
        }
        self.backward += r.backward_secs;
        self.optimizer += r.optimizer_secs;
    }

    /// Seconds of the steps in all (saves apart).
    pub fn total(&self) -> f64 {
        let phases: f64 = self.phases.iter().map(|(_, s)| s).sum();
        self.data + self.forward + phases + self.backward + self.optimizer
    }

    /// `time per step on rank 0: T ms = data .. + forward .. [+ PHASE .. each] + backward and
    /// all-reduce .. + optimizer ..`.
    pub fn line(&self) -> String {
        let per = |t: f64| t * 1e3 / self.steps.max(1) as f64;
        let phases: String =
            self.phases.iter().map(|(name, s)| format!(" + {name} {:.1}", per(*s))).collect();
        format!(
            "time per step on rank 0: {:.1} ms = data {:.1} + forward {:.1}{phases} + backward and all-reduce {:.1} + optimizer {:.1}",
            per(self.total()),
            per(self.data),
            per(self.forward),
            per(self.backward),
            per(self.optimizer)
        )
    }
}
