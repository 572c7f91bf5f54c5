//! tandem-fsdp: fully sharded data parallelism with FSDP2's semantics
//! (`torch.distributed.fsdp.fully_shard`) for candle models, a peer of tandem-ddp's `Ddp`.
//!
//! Every parameter is cut on its first dimension over the process group as FSDP2's `Shard(0)`
//! cuts it (`ceil(rows / world)` rows per rank, the last ranks fewer; the padding lives only in
//! the collectives' buffers). The model is split into *units* named by module prefix, as
//! FSDP2 applies `fully_shard` to each block and then to the root. A unit's parameters are
//! all-gathered just before its forward (the next unit's all-gather started meanwhile) and
//! freed after it; in backward they are gathered again, the unit's gradients are
//! reduce-scattered (averaged) as soon as backward has computed them, and the optimizer steps
//! each rank's shards only. A rank holds its shards, their gradients and optimizer state, and
//! the full parameters of one or two units at a time.
//!
//! ```ignore
//! let varmap = VarMap::new();
//! let model = Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?; // candle-nn
//! let units = Units::prefixes((0..n_blocks).map(|i| format!("blocks.{i}")));
//! let fsdp = Fsdp::from_varmap(&varmap, &group, FsdpOptions { units, ..Default::default() })?;
//! let blocks = model.blocks.into_iter().enumerate()
//!     .map(|(i, b)| fsdp.fully_shard(&format!("blocks.{i}"), b)).collect::<Result<Vec<_>, _>>()?;
//! let mut opt = TorchAdamW::new(fsdp.params(), AdamWConfig::default())?;
//! let loss = fsdp.forward(|| model_forward(&blocks, &tokens))?;   // PyTorch: model(tokens)
//! let mut grads = fsdp.backward(&loss)?;                          // shards' gradients
//! fsdp.clip_grad_norm(&mut grads, 1.0)?;
//! opt.step(&grads)?;
//! ```
//!
//! | FSDP2 | tandem |
//! |---|---|
//! | `fully_shard(block)` per block | [`Units`] in [`FsdpOptions::units`], [`Fsdp::fully_shard`] / [`Fsdp::run_unit`] where the model calls the block |
//! | `with torch.device("meta")`, then `to_empty()` and `init_weights()` | [`MetaVarMap`], [`Fsdp::from_meta`]: each rank draws only its rows; [`Fsdp::from_meta_with`]: the model's own seeded init, one parameter whole at a time |
//! | `set_model_state_dict(model, full_sd)` | [`Fsdp::load_safetensors`]: each rank reads only its rows; [`Fsdp::load_state_dict_rows`] from a mapped `.pt` |
//! | `get_model_state_dict(full_state_dict=True, cpu_offload=True)`, `save_file` | [`Fsdp::full_state_dict_rank0`], [`Fsdp::save_safetensors`]: one parameter gathered to rank 0 at a time |
//! | `fully_shard(model)` (root) | [`FsdpOptions::shard_root`] (default), [`Fsdp::forward`] around the model's forward |
//! | `loss.backward()` | [`Fsdp::backward`] (returns the shards' gradients) |
//! | `with torch.no_grad(): model(x)` (evaluation) | [`Fsdp::forward_no_grad`]: one unit gathered at a time, no graph kept |
//! | `model.parameters()` to the optimizer | [`Fsdp::params`] |
//! | `reshard_after_forward` | [`FsdpOptions::reshard_after_forward`] |
//! | `checkpoint(block)` / `apply_activation_checkpointing` on the units | [`FsdpOptions::activation_checkpointing`] |
//! | `set_requires_gradient_sync(False)` | [`Fsdp::set_requires_gradient_sync`] |
//! | `clip_grad_norm_` on DTensor grads | [`Fsdp::clip_grad_norm`] |
//! | `requires_grad_(False)` | [`FsdpOptions::frozen`] |
//! | `fully_shard(m, mesh=mesh_2d)` (HSDP) | [`Fsdp::on_mesh`] |
//! | (torchelastic restarts the job) | [`Fsdp::regroup`]: re-shard over a live world that lost or gained ranks ([`Fsdp::regroup_on_mesh`]: HSDP's mesh re-formed) |
//! | `unshard()` / `get_model_state_dict(full_state_dict=True)` | [`Fsdp::summon_full_params`], [`Fsdp::full_state_dict`] |
//!
//! **How candle differs.** candle's autograd has no module hooks, so a unit runs as one op (see
//! `unit_op`): its forward gathers the unit, runs it and reshards it; its backward gathers it
//! again and differentiates the graph the forward kept — whose reads of the parameters see
//! the refilled storage — then sends the gradients to the reduce-scatter. As in FSDP2, the
//! activations stay from forward to backward; with [`FsdpOptions::activation_checkpointing`]
//! a unit keeps no graph and is recomputed in backward instead (PyTorch's `checkpoint` per
//! block: the memory of the units' inputs, one more forward a step). The model's own `Var`s
//! stand for FSDP2's unsharded parameters: they hold values only while their unit is
//! gathered, and reading one elsewhere is an error from the reading op (see `storage`), so
//! the model runs inside [`Fsdp::forward`] (or [`Fsdp::summon_full_params`]). A parameter
//! read by several units belongs to their common parent, the root; read by the wrong unit it
//! is an error naming it. Reduce-scatters and the all-gathers started more than one unit
//! ahead run on a second group over the same ranks, so neither waits behind the other.
//!
//! It steps no optimizer (the caller's steps [`Fsdp::params`]; clipping is tandem-optim's, the
//! norm summed over the ranks) and knows nothing of launchers or checkpoint files.
mod engine;
mod error;
mod fsdp;
mod layout;
mod meta;
mod storage;
mod unit_op;
mod units;
mod weights;
mod wire;

pub use engine::CommStats;
pub use error::{FsdpError, Result};
pub use fsdp::{Fsdp, FsdpOptions, FullyShard, InitialValues, Shard};
pub use layout::shard_rows;
pub use meta::MetaVarMap;
pub use units::{UnitOf, Units};
pub use wire::MixedPrecisionPolicy;
