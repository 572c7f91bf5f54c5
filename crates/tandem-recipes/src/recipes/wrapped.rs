//! The model as a recipe trains it: a replica on every rank under Ddp, or sharded over the
//! ranks under Fsdp (`--fsdp`, FSDP2's `fully_shard`) — one type, so the classifier and the
//! face recipe write their step, evaluation, checkpoints and export once for both.
use std::path::Path;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use tandem_ckpt::Value;
use tandem_comm::{DeviceMesh, ProcessGroup};
use tandem_ddp::Ddp;
use tandem_fsdp::{Fsdp, FsdpOptions, InitialValues, MetaVarMap, MixedPrecisionPolicy, Units};
use tandem_models::UnitRunner;
use tandem_nn::convert::to_ckpt;
use tandem_nn::ParamModule;
use tandem_optim::OptimizerState;
use tandem_train::{bail_option, Context, FsdpShards, Result, Step, TrainingState};

use crate::options::{FsdpRunOptions, FsdpUnits};

/// A model trained by a recipe (see the module docs).
pub(crate) enum Wrapped<M: ParamModule> {
    Ddp(Ddp<M>),
    /// `rows`: HSDP's rows (1: plain FSDP).
    Fsdp {
        fsdp: Fsdp,
        module: M,
        shards: FsdpShards,
        rows: usize,
    },
}

/// `opts` as this rank builds its model with them: a live replacement builds on a placeholder
/// world of one, where no HSDP mesh forms (the running job's mesh takes it in when it joins).
pub(crate) fn build_options(
    opts: &FsdpRunOptions,
    live: Option<&super::LiveComm>,
) -> FsdpRunOptions {
    match live {
        Some(l) if l.replacement => FsdpRunOptions { hsdp_rows: 1, ..opts.clone() },
        _ => opts.clone(),
    }
}

/// Names the unit of each parameter (`None`: the root), for a model that runs its blocks
/// through a [`UnitRunner`].
pub(crate) type UnitOf = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

impl<M: ParamModule> Wrapped<M> {
    /// `module`'s parameters sharded over `group` as `opts` asks. `blocks`: how the model runs
    /// its blocks as units, when it has them — the parameters' units and a function that hands
    /// the model a [`UnitRunner`] (the model calls it per block). `meta`: the module was built
    /// on this map without values, and each rank draws its rows of the values given
    /// ([`Fsdp::from_meta_with`]); else the module holds its values (rank 0's are sharded).
    pub fn sharded(
        module: M,
        group: &ProcessGroup,
        opts: &FsdpRunOptions,
        blocks: Option<(UnitOf, &mut dyn FnMut(UnitRunner))>,
        meta: Option<(&MetaVarMap, &mut InitialValues)>,
    ) -> Result<Self> {
        let (units, runner_for) = match (opts.units, blocks) {
            (FsdpUnits::Blocks, Some((unit_of, give))) => (Units::by_name(unit_of), Some(give)),
            _ => (Units::default(), None),
        };
        let mixed_precision = MixedPrecisionPolicy {
            param_dtype: Some(opts.param_dtype.compute_dtype()),
            reduce_dtype: opts.reduce_dtype.map(|d| d.compute_dtype()),
        };
        let options = FsdpOptions {
            units,
            reshard_after_forward: opts.reshard_after_forward,
            activation_checkpointing: opts.activation_checkpointing.unwrap_or(false),
            mixed_precision,
            ..FsdpOptions::default()
        };
        let named = module.named_parameters();
        let (rows, world) = (opts.hsdp_rows, group.size());
        let mesh = if rows == 1 {
            None
        } else {
            if !world.is_multiple_of(rows) {
                bail_option!(
                    "hsdp_rows",
                    Some(rows.to_string()),
                    "{world} ranks do not form {rows} rows of equal length"
                );
            }
            let mesh = DeviceMesh::new(group, &[rows, world / rows], None);
            Some(mesh.context("forming the HSDP mesh")?)
        };
        let fsdp = match (meta, &mesh) {
            (Some((meta, values)), mesh) => {
                Fsdp::from_meta_with(named, meta, (group, mesh.as_ref()), options, values)
            }
            (None, Some(mesh)) => Fsdp::on_mesh(named, mesh, options),
            (None, None) => Fsdp::new(named, group, options),
        }
        .context("sharding the model")?;
        if let Some(give) = runner_for {
            let units = fsdp.clone();
            give(Arc::new(move |name: &str, x: &Tensor, f: tandem_nn::CheckpointFn| {
                units.run_unit(name, x, move |x| f(x)).map_err(candle_core::Error::wrap)
            }));
        }
        // (The recipes keep each rank's buffers as this rank shard, Ddp or not.)
        let shards = FsdpShards::new(&fsdp).with_buffers_in(super::face::BUFFERS_SHARD);
        Ok(Wrapped::Fsdp { fsdp, module, shards, rows })
    }

    /// Under live recovery (`live`): the shards mirrored to the next rank every `every` steps
    /// and re-split over the new world after a regroup (a replacement holds none until it
    /// joins). Ddp's replicas need nothing: the state's source sends them.
    pub fn live(self, live: Option<&super::LiveComm>, every: u64) -> Self {
        match (self, live) {
            (Wrapped::Fsdp { fsdp, module, shards, rows }, Some(l)) => {
                let shards = shards.live(every, !l.replacement);
                Wrapped::Fsdp { fsdp, module, shards, rows }
            }
            (wrapped, _) => wrapped,
        }
    }

    /// The full state dict's key order in checkpoints (PyTorch's `state_dict()` order): Ddp's
    /// state takes it from [`TrainingState::order`], Fsdp's shards keep it.
    pub fn keep_order(self, order: &[String]) -> Self {
        match self {
            Wrapped::Fsdp { fsdp, module, shards, rows } => {
                let shards = shards.with_order(order.to_vec());
                Wrapped::Fsdp { fsdp, module, shards, rows }
            }
            ddp => ddp,
        }
    }

    /// The variables the optimizer steps (Ddp: the parameters; Fsdp: this rank's shards).
    pub fn params(&self) -> Vec<Var> {
        match self {
            Wrapped::Ddp(ddp) => ddp.params(),
            Wrapped::Fsdp { fsdp, .. } => fsdp.params(),
        }
    }

    /// A training forward: `f` runs the model (Ddp's hooked module; Fsdp's with the root's
    /// parameters gathered and the units gathering theirs).
    pub fn forward<R>(&self, f: impl FnOnce(&M) -> candle_core::Result<R>) -> Result<R> {
        match self {
            Wrapped::Ddp(ddp) => Ok(f(ddp.hooked())?),
            Wrapped::Fsdp { fsdp, module, .. } => Ok(fsdp.forward(|| f(module))?),
        }
    }

    /// The backward of a loss from [`Wrapped::forward`]: the gradients the optimizer steps
    /// with (averaged over the ranks), and those of `local` (state each rank holds alone, such
    /// as a PartialFC head's rows) as autograd computed them.
    pub fn backward(&self, loss: &Tensor, local: &[Var]) -> Result<GradStore> {
        match self {
            Wrapped::Ddp(ddp) => Ok(ddp.backward_with_local(loss, local)?),
            // (Fsdp takes its own parameters' gradients out of the store and leaves the rest.)
            Wrapped::Fsdp { fsdp, .. } => Ok(fsdp.backward(loss)?),
        }
    }

    /// `f` with gradient sync off (Ddp's `no_sync`, FSDP2's `set_requires_gradient_sync`):
    /// its backwards accumulate without communicating, the next backward outside reduces the
    /// sum.
    pub fn no_sync<T>(&self, f: impl FnOnce() -> T) -> T {
        match self {
            Wrapped::Ddp(ddp) => ddp.no_sync(|_| f()),
            Wrapped::Fsdp { fsdp, .. } => {
                fsdp.set_requires_gradient_sync(false);
                let out = f();
                fsdp.set_requires_gradient_sync(true);
                out
            }
        }
    }

    /// `f`, a forward of the model for evaluation, under `tandem_nn::no_grad` (the model
    /// cuts its graph between blocks; the result is detached): Ddp's on its replica, Fsdp's
    /// one unit gathered at a time ([`Fsdp::forward_no_grad`]; a collective: every rank runs
    /// as many).
    pub fn forward_no_grad(
        &self,
        f: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match self {
            Wrapped::Ddp(_) => Ok(tandem_nn::no_grad(f)?.detach()),
            Wrapped::Fsdp { fsdp, .. } => fsdp.forward_no_grad(f).map_err(candle_core::Error::wrap),
        }
    }

    /// `f` on the whole model, outside training (evaluation, export): Ddp's plain module, or
    /// Fsdp's with every parameter gathered. A collective under Fsdp: every rank calls it.
    pub fn summon<R>(&self, f: impl FnOnce(&M) -> R) -> Result<R> {
        match self {
            Wrapped::Ddp(ddp) => Ok(f(&ddp.module())),
            Wrapped::Fsdp { fsdp, module, .. } => Ok(fsdp.summon_full_params(|| f(module))?),
        }
    }

    /// The model's state dict (parameters, then buffers, by the module's names) on rank 0 and
    /// `None` elsewhere: what `--save-final` and `--export-onnx` write. Under Fsdp each
    /// parameter is gathered to rank 0 alone, one at a time (FSDP2's
    /// `get_model_state_dict(full_state_dict=True, cpu_offload=True)`), so no other rank ever
    /// holds the model whole; under Ddp it is rank 0's replica. A collective under Fsdp.
    pub fn state_dict_rank0(&self, rank: usize) -> Result<Option<Value>> {
        let params = match self {
            Wrapped::Ddp(ddp) if rank == 0 => return Ok(Some(ddp.module().state_dict()?)),
            Wrapped::Ddp(_) => return Ok(None),
            Wrapped::Fsdp { fsdp, .. } => fsdp.full_state_dict_rank0()?,
        };
        let Some(params) = params else { return Ok(None) };
        let mut entries = Vec::with_capacity(params.len());
        // Each gathered tensor dropped once converted: one copy of the model at a time.
        for (name, t) in params {
            entries.push((name, to_ckpt(&t)?));
        }
        for (name, v) in self.module().named_buffers() {
            entries.push((name, to_ckpt(v.as_tensor())?));
        }
        Ok(Some(Value::dict_from(entries.into_iter().map(|(k, t)| (k, Value::Tensor(t))))))
    }

    /// Whether `path` is written as the model is gathered, one parameter at a time
    /// ([`Wrapped::save_gathering`]): a `.safetensors` file of a sharded model. Other files
    /// are written from [`Wrapped::state_dict_rank0`].
    pub fn saves_gathering(&self, path: &Path) -> bool {
        matches!(self, Wrapped::Fsdp { .. }) && path.extension().is_some_and(|e| e == "safetensors")
    }

    /// Writes `path` from rank 0 as each parameter is gathered ([`Fsdp::save_safetensors`]:
    /// not even rank 0 holds the model whole), the buffers from rank 0's. A collective; only
    /// where [`Wrapped::saves_gathering`].
    pub fn save_gathering(&self, path: &Path) -> Result<()> {
        let Wrapped::Fsdp { fsdp, module, .. } = self else {
            bail_option!("save_final", Some(path.display().to_string()), "not a sharded model");
        };
        let buffers: Vec<(String, Tensor)> =
            module.named_buffers().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
        Ok(fsdp.save_safetensors(path, &buffers)?)
    }

    /// Loads `path`, the whole model's state dict (`--init-from` under `--fsdp`), each rank
    /// reading only its rows of each parameter and the tensors kept whole (buffers, frozen
    /// parameters) whole: no rank reads the model whole. A safetensors file is read by
    /// position ([`Fsdp::load_safetensors_with`]); `state`, the file already read (a `.pt`,
    /// which tandem-ckpt maps), is copied row by row ([`Fsdp::load_state_dict_rows`]).
    /// Strict, as `load_state_dict`: a tensor the model lacks, one it has that the file lacks,
    /// or a parameter of another shape is an error naming it before anything is set (a buffer
    /// of another shape, after the parameters). Returns how many tensors it loaded. Not a
    /// collective.
    pub fn load_rows(&self, path: &Path, state: Option<&Value>) -> Result<usize> {
        let shown = || Some(path.display().to_string());
        let Wrapped::Fsdp { fsdp, module, .. } = self else {
            bail_option!("init_from", shown(), "read row by row only by a sharded model");
        };
        let kept = module.named_buffers();
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        let loaded = match state {
            Some(state) => fsdp.load_state_dict_rows(path, state, &names),
            None => fsdp.load_safetensors_with(&[path], &names),
        };
        let mut whole: std::collections::HashMap<String, Tensor> =
            loaded.option("init_from", shown())?.into_iter().collect();
        let mut values = Vec::with_capacity(kept.len());
        for (name, var) in &kept {
            // (Fsdp required every name given: each is there.)
            let t = whole.remove(name).option("init_from", shown())?;
            if t.dims() != var.dims() {
                let (file, model) = (t.dims(), var.dims());
                bail_option!("init_from", shown(), "`{name}` is {file:?}; the model's {model:?}");
            }
            values.push((var, t.to_dtype(var.dtype())?));
        }
        for (var, t) in values {
            var.set(&t)?;
        }
        Ok(fsdp.shards().len() + kept.len())
    }

    /// The model itself, outside any forward (its buffers; under Fsdp its parameters hold no
    /// values here).
    pub fn module(&self) -> &M {
        match self {
            Wrapped::Ddp(ddp) => ddp.hooked(),
            Wrapped::Fsdp { module, .. } => module,
        }
    }

    /// `step` as this model needs it: under Fsdp clipping and the GradScaler's inf check sum
    /// over the ranks' shards.
    pub fn step(&self, step: Step) -> Step {
        match self {
            Wrapped::Ddp(_) => step,
            Wrapped::Fsdp { fsdp, .. } => step.sharded(fsdp.sum_over_ranks()),
        }
    }

    /// The model and `optimizer` as training state: replicated under Ddp, the shards (by rows,
    /// resumable on any world size) under Fsdp.
    pub fn state<'a, O: OptimizerState + 'a>(
        &'a mut self,
        optimizer: &'a mut O,
    ) -> TrainingState<'a> {
        match self {
            Wrapped::Ddp(ddp) => TrainingState::new(&*ddp, optimizer),
            Wrapped::Fsdp { shards, .. } => TrainingState::fsdp(shards, optimizer),
        }
    }

    /// How the model is spread, for the run's first lines (rank 0); `None` under Ddp.
    pub fn describe(&self) -> Option<String> {
        let Wrapped::Fsdp { fsdp, rows, .. } = self else { return None };
        let units = fsdp.units();
        let shown = match units.len() {
            0..=4 => units.join(", "),
            n => format!("{}, {} .. {} ({n} with the root)", units[0], units[1], units[n - 1]),
        };
        let copies = match rows {
            1 => String::new(),
            r => format!(" in each of {r} HSDP rows"),
        };
        Some(format!(
            "fsdp: {} parameters sharded over {} ranks{copies}; units {shown}",
            fsdp.shards().len(),
            fsdp.world_size(),
        ))
    }
}
