//! [`UnitRunner`]: how a model hands its blocks to a sharded model's units.
use candle_core::Tensor;

/// Runs a part of the model on an input as a sharded model's unit (tandem-fsdp's
/// `Fsdp::run_unit`, FSDP2's `fully_shard` per block): the model calls it with the unit's name
/// (the prefix its parameters share, `blocks.3`, `layer2.1`) and the function to compute. The
/// function may be called again in backward: it computes the same values each time (random
/// masks are drawn before it, and BatchNorm counts the batch once, under
/// `tandem_nn::recompute`).
pub type UnitRunner = std::sync::Arc<
    dyn Fn(&str, &Tensor, tandem_nn::CheckpointFn) -> candle_core::Result<Tensor> + Send + Sync,
>;
