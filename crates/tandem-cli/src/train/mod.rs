//! The main job (`tandem train`): DDP training of a small classifier with sampler, evaluation,
//! checkpoints, progress and TensorBoard. Split into the run configuration, the TensorBoard
//! writer and the per-rank training loop.
pub mod config;
pub mod model;
pub mod tfevents;
pub mod worker;
