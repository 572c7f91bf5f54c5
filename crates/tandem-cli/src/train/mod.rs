//! The main job (`tandem train`): DDP training of a small classifier with sampler, evaluation,
//! checkpoints, progress and TensorBoard. Split into the run configuration, the models, the
//! optimizer (plain or ZeRO-sharded), the TensorBoard writer and the per-rank training loop.
pub mod config;
pub mod model;
pub mod optimizer;
pub mod tfevents;
pub mod worker;
