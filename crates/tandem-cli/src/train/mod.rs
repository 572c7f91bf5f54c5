//! The main job (`tandem train`): DDP training of a classifier with sampler, evaluation,
//! checkpoints, progress and TensorBoard, or the face-recognition recipe (IResNet + PartialFC).
//! Split into the run configuration, the models, the optimizer (plain or ZeRO-sharded), the
//! classifier loop and the face loop; the step, schedules, metrics and TensorBoard writer are
//! the library's (`tandem::train`).
pub mod config;
pub mod face;
mod fault;
pub mod model;
pub mod optimizer;
pub mod worker;
