//! What a user writes for the [`Trainer`](crate::Trainer): a [`Recipe`] (one step, an
//! evaluation, the state it gives), and what a step and an evaluation report.
use tandem_comm::ProcessGroup;
use tandem_data::{Batch, Dataset};
use tandem_optim::TorchOptimizer;

use crate::metrics::ValidationMetrics;
use crate::state::TrainingState;
use crate::Result;
use crate::Step;

/// What one step reported: this rank's mean loss over its `samples`, and where its time went.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// The loss, when it is already on the host.
    pub loss: f64,
    /// The loss still on a GPU (a scalar tensor): the trainer reads it a few steps later, so
    /// the host never waits for the device inside a step; `loss` is then unused.
    pub pending_loss: Option<candle_core::Tensor>,
    pub samples: usize,
    /// Seconds in the forward pass (the model's, before any phase below).
    pub forward_secs: f64,
    /// Seconds in phases the recipe names itself, between forward and backward (a
    /// model-parallel head: `("head", secs)`).
    pub phases: Vec<(&'static str, f64)>,
    pub backward_secs: f64,
    pub optimizer_secs: f64,
}

/// An end-of-epoch evaluation on held-out data (the world's figures).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
}

/// One recipe: the model, its optimizer and its data, as the [`Trainer`](crate::Trainer) drives them.
pub trait Recipe {
    /// What the loader reads.
    type Data: Dataset + 'static;

    /// One optimizer step on `batch`: forward, loss, and `step.run` with the recipe's backward.
    /// `global_step` numbers the step being taken (1-based).
    fn train_step(
        &mut self,
        batch: &Batch,
        step: &mut Step,
        global_step: u64,
    ) -> Result<StepReport>;

    /// The optimizer (its learning rate goes in the epoch line; a schedule is reloaded into it).
    fn optimizer(&mut self) -> &mut dyn TorchOptimizer;

    /// Called before an epoch's batches (augmentation keyed by the epoch).
    fn start_epoch(&mut self, _epoch: u64) {}

    /// Training (`true`) or evaluation mode.
    fn set_training(&mut self, _training: bool) -> Result<()> {
        Ok(())
    }

    /// The end-of-epoch evaluation (a collective), if the recipe has one.
    fn evaluate(&mut self, _group: &ProcessGroup) -> Result<Option<Evaluation>> {
        Ok(None)
    }

    /// Its validation sets scored (a collective) every `validate_every` steps and at the end,
    /// if it has any (the face recipe's verification pairs).
    fn validate(&mut self, _group: &ProcessGroup, _step: u64) -> Result<Vec<ValidationMetrics>> {
        Ok(Vec::new())
    }

    /// The state the [`Trainer`](crate::Trainer) saves, resumes and moves between live ranks, beside its own
    /// part (the schedule, the loss scaler, the loader's position, the step count): the model
    /// and optimizer, and the parts each rank holds alone
    /// (`Some(TrainingState::new(&self.ddp, &mut self.opt).part(&mut self.head))`). The
    /// checkpoints go to `DIR/checkpoints` as [`TrainerOptions::checkpoints`](crate::TrainerOptions::checkpoints) says. `None`
    /// (the default): nothing to save, which a run without checkpoints, resume or live
    /// recovery may do.
    fn state(&mut self) -> Option<TrainingState<'_>> {
        None
    }

    /// The final outputs after the last checkpoint (weights, ONNX); every rank calls it.
    fn finish(&mut self, _group: &ProcessGroup) -> Result<()> {
        Ok(())
    }
}
