//! tandem-train: what a training loop does around the model, written once for every recipe.
//!
//! - [`Trainer`] drives a [`Recipe`] (what a user writes: a train step, an evaluation, the
//!   state it gives) through epochs, checkpoints ([`CheckpointPolicy`]: when and how many),
//!   resume and live recovery;
//! - [`Step`] (from tandem-optim): one optimizer step with optional float16 loss scaling —
//!   scale, backward, unscale, clip a chosen parameter set, step (skipped on inf/NaN, counted),
//!   update the scale, step the schedule; [`LrSchedule`] (tandem-optim's, as [`schedule`]):
//!   learning-rate schedules by name (constant, poly with warm-up, cosine, step) and their
//!   checkpoint state;
//! - [`checkpoint`] (the `tandem-checkpoint` crate): one API for a run's training state,
//!   replicated and sharded ([`Checkpointer`], [`TrainingStateDict`], [`Saved`]): every rank's
//!   shards written in parallel, the replicated part once, a manifest last, synchronously or
//!   in the background, loaded on any world size reading only the slices a rank owns;
//! - [`TrainingState`] (the tandem-state crate, re-exported): the whole training state of a
//!   model, its optimizer (ZeRO-1's shards too), scheduler, scaler, loader and the state each
//!   rank holds alone ([`RankState`] parts: PartialFC's rows, [`RankBuffers`], an `Fsdp`
//!   model's shards as [`FsdpShards`]) saved and loaded in one call each
//!   ([`save_state`]/[`load_state`], over [`checkpoint`]), resumable on any world size;
//!   [`live`]: keeping a loop running through a rank's death (`tandem run --live-recovery`),
//!   the per-rank parts mirrored to a buddy and re-split after a regroup — the same calls for
//!   the [`Trainer`] and a user's own loop; [`World`]: a rank's place in the job, live or not,
//!   that a [`Trainer`] is fitted in;
//! - [`events`]: what a run reports as it happens ([`Event`]), to the [`Logger`]s a
//!   [`Reporter`] holds; [`metrics`]: a run's typed results ([`EpochMetrics`], [`RunSummary`])
//!   and the JSON-lines file a script reads them from; [`EventWriter`] (TensorBoard scalars);
//!   both loggers of the run directory, beside a recipe's own ([`OpenLog`]);
//!
//! It knows no recipe by name: the built-in ones (the classifier, arcface_torch's face recipe)
//! and the options `tandem train` takes are the `tandem-recipes` crate, a user of this one.
//!
//! Modules are private behind these re-exports except the namespaces above, so a module can
//! move without breaking a user. It knows nothing of command lines and never prints: the
//! `tandem` binary maps its flags onto these types and prints the events.
// A public item of a private module must be re-exported: a user can name every type they get.
#![warn(unnameable_types)]

pub mod events;
pub mod metrics;

mod evaluate;
mod tfevents;
mod trainer;
mod world;

pub use evaluate::evaluate_logits;
pub use events::{Event, Lines, LogSetup, Logger, OpenLog, Reporter};
pub use metrics::{EpochMetrics, MetricsFile, MetricsRecord, RunSummary, ValidationMetrics};
pub use tandem_checkpoint as checkpoint;
pub use tandem_checkpoint::{
    CheckpointPolicy, Checkpointer, Never, Periodic, Saved, ShardDict, ShardSlice,
    TrainingStateDict,
};
pub use tandem_optim::lr_scheduler::schedule;
pub use tandem_optim::lr_scheduler::schedule::{LrSchedule, RunLength, Scheduler, Warmup};
pub use tandem_optim::{phase_end, Step, StepOutcome, StepPhase};
#[doc(hidden)]
pub use tandem_state::fault;
pub use tandem_state::{
    bail, bail_option, fsdp2_state_dict, fsdp_consolidated, live, load_fsdp2_dcp, load_state,
    load_state_from, save_state, state, Context, FsdpShards, LoaderPosition, PartLoaded,
    RankBuffers, RankState, Result, Resumed, TrainError, TrainingState,
};
pub use tfevents::EventWriter;
pub use trainer::{Evaluation, Recipe, StepReport, StepTimes, Trainer, TrainerOptions};
pub use world::World;
