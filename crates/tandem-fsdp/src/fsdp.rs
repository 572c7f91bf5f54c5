//! [`Fsdp`]: the sharded model's handle (FSDP2's `FSDPModule`), and [`FullyShard`], a unit as a
//! candle `Module`.
use std::sync::{Arc, RwLock};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::Init;
use tandem_comm::{DeviceMesh, ProcessGroup, ReduceOp};

use crate::engine::{add, CommStats, Engine, Param, Schedule, Unit, UnitFn};
use crate::error::{comm, tensor, FsdpError, Result};
use crate::layout::ShardLayout;
use crate::meta::{draw_rows, MetaVarMap};
use crate::storage;
use crate::units::{assign, Units};
use crate::wire::{MixedPrecisionPolicy, Wire};

/// `fully_shard`'s keyword arguments that apply here, and the units.
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    /// The units (the modules `fully_shard` is applied to before the root).
    pub units: Units,
    /// Shard the parameters in no unit as the root unit (`fully_shard(model)`); without it
    /// every parameter must be in a unit.
    pub shard_root: bool,
    /// FSDP2's `reshard_after_forward`: free a unit's full parameters after its forward and
    /// gather them again for its backward (true), or keep them until its backward (false, more
    /// memory, one all-gather fewer per unit). The root keeps its parameters gathered from
    /// `Fsdp::forward` to the end of `Fsdp::backward` either way, as FSDP2's root does.
    pub reshard_after_forward: bool,
    /// Parameters that take no gradient (PyTorch's `requires_grad=False`): sharded and gathered
    /// like the others, never reduced, not among [`Fsdp::params`].
    pub frozen: Vec<String>,
    /// Broadcast rank 0's parameters before sharding, so ranks that initialised differently
    /// still train one model (FSDP1's `sync_module_states`; FSDP2 trusts every rank's init).
    pub sync_module_states: bool,
    /// The dtypes the all-gathers and reduce-scatters move values in (FSDP2's `mp_policy`).
    pub mixed_precision: MixedPrecisionPolicy,
    /// Activation checkpointing per unit (PyTorch's `checkpoint(block)` under `fully_shard`):
    /// a unit's forward keeps no graph — neither its activations nor its gathered parameters
    /// outlive it — and its backward recomputes it, one more forward per step for a rank that
    /// holds only the units' inputs between forward and backward. Off (FSDP2's default): the
    /// activations stay until backward, as under `Ddp`. A unit's function must then compute
    /// the same values twice (draw dropout masks outside it).
    pub activation_checkpointing: bool,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            units: Units::default(),
            shard_root: true,
            reshard_after_forward: true,
            frozen: Vec::new(),
            sync_module_states: true,
            mixed_precision: MixedPrecisionPolicy::default(),
            activation_checkpointing: false,
        }
    }
}

/// One parameter's shard on this rank: what a checkpoint saves of it.
#[derive(Clone, Debug)]
pub struct Shard {
    /// The parameter's name (its state-dict key).
    pub name: String,
    /// This rank's rows (the optimizer's parameter when `trainable`).
    pub var: Var,
    /// Which rows of the full parameter `var` holds.
    pub rows: std::ops::Range<usize>,
    /// The full parameter's shape (a scalar is sharded as one row of one element).
    pub dims: Vec<usize>,
    pub trainable: bool,
}

impl Shard {
    /// The full parameter's rows.
    pub fn total_rows(&self) -> usize {
        self.dims.first().copied().unwrap_or(1)
    }
}

/// The engine a sharded model runs on now: one per world, replaced when a live regroup
/// re-shards the model ([`Fsdp::regroup`]); the handle and every unit's wrapper read it here.
#[derive(Clone)]
struct Current(Arc<RwLock<Arc<Engine>>>);

impl Current {
    fn get(&self) -> Arc<Engine> {
        Arc::clone(&self.0.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn set(&self, engine: Engine) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(engine);
    }
}

/// A model sharded over a process group (see the crate docs).
#[derive(Clone)]
pub struct Fsdp {
    current: Current,
}

/// A unit as a candle [`Module`]: FSDP2's `fully_shard(block)` for a block the model calls as
/// `block.forward(&x)`. Build it with [`Fsdp::fully_shard`].
pub struct FullyShard<M> {
    current: Current,
    unit: usize,
    inner: Arc<M>,
}

impl<M> Clone for FullyShard<M> {
    fn clone(&self) -> Self {
        FullyShard {
            current: self.current.clone(),
            unit: self.unit,
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<M: Module + Send + Sync + 'static> Module for FullyShard<M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let inner = Arc::clone(&self.inner);
        let f: UnitFn = Arc::new(move |x: &Tensor| inner.forward(x));
        self.current.get().unit_forward(self.unit, x, f).map_err(candle_core::Error::wrap)
    }
}

impl<M> FullyShard<M> {
    /// The wrapped module (its parameters hold values only inside the unit's forward).
    pub fn inner(&self) -> &M {
        &self.inner
    }
}

/// A model's own initialisation for [`Fsdp::from_meta_with`]: the values of parameter `name` of
/// shape `dims`, whole, or `None` for the meta map's draw.
pub type InitialValues<'a> = dyn FnMut(&str, &[usize]) -> Option<Vec<f32>> + 'a;

/// Where the shards' values come from.
enum Source<'a, 'v> {
    /// The model's own full values (rank 0's, with `sync_module_states`).
    Full,
    /// Drawn from a [`MetaVarMap`]'s seed, parameter by parameter in the build's order, where
    /// `given` (asked in that order) gives no values.
    Meta { seed: u64, inits: &'a [Init], given: &'a mut InitialValues<'v> },
}

/// The groups FSDP shards over and replicates across on `mesh` (1-D: FSDP, 2-D: HSDP).
fn mesh_groups(mesh: &DeviceMesh) -> Result<(ProcessGroup, Option<ProcessGroup>)> {
    let group = |dim| mesh.group(dim).cloned().map_err(comm("device mesh"));
    match mesh.shape().len() {
        1 => Ok((group(0)?, None)),
        2 => Ok((group(1)?, Some(group(0)?))),
        n => Err(FsdpError::InvalidOption {
            what: "mesh",
            why: format!("a {n}-D mesh: FSDP shards over a 1-D mesh, HSDP over a 2-D one"),
        }),
    }
}

fn check_param(name: &str, var: &Var) -> Result<()> {
    let why = if var.dtype() != DType::F32 {
        format!("dtype {:?}: FSDP shards f32 parameters", var.dtype())
    } else if !matches!(var.device(), Device::Cpu) {
        "on a GPU: FSDP runs on CPU tensors for now".to_string()
    } else if !var.is_contiguous() || var.layout().start_offset() != 0 {
        "a strided view, not a whole variable".to_string()
    } else {
        return Ok(());
    };
    Err(FsdpError::Unsupported { param: name.to_string(), why })
}

/// Every rank holds parameters of the same names and shapes in the same order, or an error
/// naming the first that differs — found with one small all-gather, before any collective
/// whose sizes depend on the model could wait for a rank that will never send.
fn same_model_everywhere(named: &[(String, Var)], group: &ProcessGroup) -> Result<()> {
    let describe = |named: &[(String, Var)]| -> Vec<String> {
        named.iter().map(|(n, v)| format!("`{n}` {:?}", v.dims())).collect()
    };
    let mine = describe(named).join("\n");
    let all = group.all_gather_bytes(mine.as_bytes()).map_err(comm("all_gather"))?;
    let first: Vec<String> = String::from_utf8_lossy(&all[0]).lines().map(String::from).collect();
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        let theirs: Vec<String> =
            String::from_utf8_lossy(theirs).lines().map(String::from).collect();
        if theirs == first {
            continue;
        }
        let at = first
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a != b)
            .unwrap_or(first.len().min(theirs.len()));
        let show = |v: &[String]| v.get(at).cloned().unwrap_or_else(|| "nothing".into());
        return Err(FsdpError::ModelsDiffer {
            rank,
            why: format!(
                "parameter {at} is {} on rank {rank}, {} on rank 0",
                show(&theirs),
                show(&first)
            ),
        });
    }
    Ok(())
}

impl Fsdp {
    /// Shards `named` (the model's parameters, the same names and shapes on every rank) over
    /// `group`: every rank keeps its rows of each parameter and the model's `Var`s are freed
    /// until a forward gathers them. A collective on every rank of `group`.
    pub fn new(named: Vec<(String, Var)>, group: &ProcessGroup, opts: FsdpOptions) -> Result<Fsdp> {
        Fsdp::build(named, (group.clone(), None), opts, Source::Full)
    }

    /// FSDP2's `fully_shard(module, mesh=mesh)`: on a 1-D mesh as [`Fsdp::new`] over its group;
    /// on a 2-D mesh HSDP — each parameter sharded along dimension 1 (the ranks of a row) and
    /// replicated along dimension 0 (the rows), gradients reduce-scattered within a row and
    /// then averaged across the rows. A collective on every rank of the mesh.
    pub fn on_mesh(
        named: Vec<(String, Var)>,
        mesh: &DeviceMesh,
        opts: FsdpOptions,
    ) -> Result<Fsdp> {
        Fsdp::build(named, mesh_groups(mesh)?, opts, Source::Full)
    }

    fn build(
        named: Vec<(String, Var)>,
        (group, replicate): (ProcessGroup, Option<ProcessGroup>),
        opts: FsdpOptions,
        mut source: Source,
    ) -> Result<Fsdp> {
        let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        for frozen in &opts.frozen {
            if !names.contains(&frozen.as_str()) {
                return Err(FsdpError::InvalidOption {
                    what: "frozen",
                    why: format!("`{frozen}` is not a parameter of this model"),
                });
            }
        }
        let assignment = assign(&names, &opts.units, opts.shard_root)?;
        let wires = Wire::of_policy(&opts.mixed_precision)?;
        if let Source::Full = source {
            for (name, var) in &named {
                check_param(name, var)?;
            }
        }
        let (rank, world) = (group.rank(), group.size());
        same_model_everywhere(&named, &group)?;
        if let Some(replicas) = &replicate {
            same_model_everywhere(&named, replicas)?;
        }
        let mut params = Vec::with_capacity(named.len());
        for (i, ((name, full), &unit)) in named.into_iter().zip(&assignment.of).enumerate() {
            let layout = ShardLayout::new(full.dims(), rank, world);
            let values = match &mut source {
                Source::Full => {
                    let mut values = full
                        .flatten_all()
                        .and_then(|t| t.to_vec1::<f32>())
                        .map_err(tensor(format!("reading `{name}`")))?;
                    if opts.sync_module_states {
                        // Down the first column, then along every row: rank 0's values everywhere.
                        for g in replicate.iter().chain([&group]).filter(|g| g.size() > 1) {
                            g.broadcast(&mut values, 0).map_err(comm("broadcast"))?;
                        }
                    }
                    layout.my_part(&values).to_vec()
                }
                Source::Meta { seed, inits, given } => match given(&name, full.dims()) {
                    Some(v) if v.len() == full.elem_count() => layout.my_part(&v).to_vec(),
                    Some(v) => {
                        return Err(FsdpError::Unsupported {
                            param: name,
                            why: format!("{} initial values for its {:?}", v.len(), full.dims()),
                        })
                    }
                    None => draw_rows(&name, full.shape(), &inits[i], *seed, layout.my_rows()),
                },
            };
            let shard = Var::from_vec(values, layout.shard_dims(), full.device())
                .map_err(tensor(format!("the shard of `{name}`")))?;
            storage::free(full.as_tensor()).map_err(tensor(format!("freeing `{name}`")))?;
            let trainable = !opts.frozen.contains(&name);
            params.push(Param { name, full, shard, layout, trainable, unit });
        }
        let units = assignment
            .names
            .iter()
            .enumerate()
            .map(|(u, name)| {
                let members: Vec<usize> =
                    (0..params.len()).filter(|&p| params[p].unit == u).collect();
                Unit { name: name.clone(), params: members }
            })
            .collect();
        let schedule = Schedule {
            reshard_after_forward: opts.reshard_after_forward,
            activation_checkpointing: opts.activation_checkpointing,
        };
        let engine = Engine::new((group, replicate), params, units, schedule, wires);
        Ok(Fsdp { current: Current(Arc::new(RwLock::new(Arc::new(engine)))) })
    }

    /// [`Fsdp::new`] over the parameters of a candle `VarMap`, sorted by name. Its buffers
    /// (BatchNorm statistics: `*.running_mean`, `*.running_var`, `*.num_batches_tracked`) stay
    /// whole on every rank, as FSDP2 leaves a module's buffers.
    pub fn from_varmap(
        varmap: &candle_nn::VarMap,
        group: &ProcessGroup,
        opts: FsdpOptions,
    ) -> Result<Fsdp> {
        use tandem_nn::ParamModule;
        Fsdp::new(tandem_nn::NamedVars::from_varmap(varmap).named_parameters(), group, opts)
    }

    /// FSDP2's meta-device init: shards the parameters of a model built on `meta` (which
    /// hold no values) over `group`, every rank drawing only its rows of each from the init the
    /// model asked for — a rank never holds the whole model. The values are the map's seeded
    /// draws, the same on any number of ranks ([`MetaVarMap::materialize`]), so
    /// `sync_module_states` has nothing to do. The map's buffers stay whole
    /// ([`MetaVarMap::buffers`]). Load trained weights afterwards with
    /// [`Fsdp::load_safetensors`]. A collective on every rank of `group`.
    pub fn from_meta(meta: &MetaVarMap, group: &ProcessGroup, opts: FsdpOptions) -> Result<Fsdp> {
        let named = meta.params().into_iter().map(|p| (p.name, p.var)).collect();
        Fsdp::from_meta_with(named, meta, (group, None), opts, &mut |_, _| None)
    }

    /// [`Fsdp::from_meta`] with the model's own order and initialisation, for a model whose
    /// init draws parameter after parameter from one seeded stream (tandem's face backbones,
    /// as arcface_torch's): `named` are parameters of `meta` in the order to shard them (the
    /// order [`Fsdp::params`] keeps), and `values` gives each one's values whole, asked once per
    /// parameter in that order (`None`: the map's own draw). A rank keeps its rows and holds
    /// one parameter whole for a moment, never the model. On `mesh`, HSDP as
    /// [`Fsdp::on_mesh`] (every row computes the same values); else over `group`. Parameters
    /// of `meta` left out of `named` keep no values (materialize them with
    /// [`MetaVarMap::materialize_with`]). A collective on every rank of the group (the mesh).
    pub fn from_meta_with(
        named: Vec<(String, Var)>,
        meta: &MetaVarMap,
        (group, mesh): (&ProcessGroup, Option<&DeviceMesh>),
        opts: FsdpOptions,
        values: &mut InitialValues,
    ) -> Result<Fsdp> {
        let inits = named
            .iter()
            .map(|(name, _)| {
                meta.init_of(name).ok_or_else(|| FsdpError::InvalidOption {
                    what: "named",
                    why: format!("`{name}` is not a parameter built on the meta map"),
                })
            })
            .collect::<Result<Vec<Init>>>()?;
        let groups = match mesh {
            Some(mesh) => mesh_groups(mesh)?,
            None => (group.clone(), None),
        };
        let source = Source::Meta { seed: meta.seed(), inits: &inits, given: values };
        Fsdp::build(named, groups, opts, source)
    }

    /// The engine of the current world.
    pub(crate) fn engine(&self) -> Arc<Engine> {
        self.current.get()
    }

    /// Re-shards the model over `group` after a live regroup (`tandem run --live-recovery`):
    /// `rows[i]` is this rank's rows of parameter `i` (of [`Fsdp::shards`]) in the new layout
    /// ([`shard_rows`](crate::shard_rows) of the new rank and size), put together by the caller from the copies
    /// the ranks hold. The shards become new variables: hand [`Fsdp::params`] to the optimizer
    /// again (`OptimizerState::replace_param`). Not a collective; plain FSDP over the whole
    /// group (an HSDP model too: [`Fsdp::regroup_on_mesh`] keeps rows).
    pub fn regroup(&self, group: &ProcessGroup, rows: Vec<Tensor>) -> Result<()> {
        let engine = self.engine().regrouped((group.clone(), None), rows)?;
        self.current.set(engine);
        Ok(())
    }

    /// [`Fsdp::regroup`] onto a mesh formed over the new world: on a 2-D mesh HSDP again, each
    /// parameter sharded over this rank's row (`rows[i]`: the rows of parameter `i` for this
    /// rank's place in its row, [`shard_rows`](crate::shard_rows) of the mesh's second
    /// coordinate and width) and replicated across the rows. Not a collective (forming the
    /// mesh is).
    pub fn regroup_on_mesh(&self, mesh: &DeviceMesh, rows: Vec<Tensor>) -> Result<()> {
        let engine = self.engine().regrouped(mesh_groups(mesh)?, rows)?;
        self.current.set(engine);
        Ok(())
    }

    /// How many copies of the shards the ranks hold: the rows of an HSDP mesh, 1 under plain
    /// FSDP.
    pub fn replicas(&self) -> usize {
        self.engine().replicate.as_ref().map_or(1, ProcessGroup::size)
    }

    fn unit_index(&self, name: &str) -> Result<usize> {
        let e = self.engine();
        let units = &e.units;
        units[..units.len() - 1]
            .iter()
            .position(|u| u.name == name.trim_end_matches('.'))
            .ok_or_else(|| FsdpError::UnknownUnit {
                unit: name.to_string(),
                known: units[..units.len() - 1]
                    .iter()
                    .map(|u| format!("`{}`", u.name))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Unit `name` as a candle `Module` wrapping `module` (PyTorch: `fully_shard(module)`;
    /// the model then calls the wrapper where it called the module).
    pub fn fully_shard<M: Module + Send + Sync + 'static>(
        &self,
        name: &str,
        module: M,
    ) -> Result<FullyShard<M>> {
        Ok(FullyShard {
            current: self.current.clone(),
            unit: self.unit_index(name)?,
            inner: Arc::new(module),
        })
    }

    /// `f(x)` run as unit `name`: gathered, computed, resharded; in backward gathered again and
    /// differentiated (recomputed first under activation checkpointing, where `f` must compute
    /// the same values when called again: draw dropout masks outside it).
    pub fn run_unit(
        &self,
        name: &str,
        x: &Tensor,
        f: impl Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    ) -> Result<Tensor> {
        let u = self.unit_index(name)?;
        self.engine().unit_forward(u, x, Arc::new(f))
    }

    /// One forward of the model (PyTorch: calling the root module): the root's parameters
    /// gathered for `f`, which runs the model with each unit through its wrapper.
    pub fn forward<R>(&self, f: impl FnOnce() -> candle_core::Result<R>) -> Result<R> {
        let e = self.engine();
        e.begin_forward()?;
        let out = f().map_err(|e| {
            let hint = if storage::read_freed(&e) { storage::FREED_HINT } else { "" };
            FsdpError::Tensor {
                context: format!("the model's forward {hint}"),
                source: Box::new(e),
            }
        })?;
        e.end_forward()?;
        Ok(out)
    }

    /// An evaluation forward (PyTorch: `with torch.no_grad(): model(x)` on an FSDP2 model):
    /// each unit gathered, run and resharded at once, keeping no graph (the result is detached:
    /// no backward reaches the model from it), every parameter freed again when it returns — a
    /// rank holds one or two units, never the model. A collective, like every forward: every
    /// rank runs as many (a rank with fewer samples runs a stand-in batch).
    pub fn forward_no_grad(
        &self,
        f: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let e = self.engine();
        e.outside_step("forward_no_grad")?;
        e.lock().no_grad = true;
        // (A model that cuts its graph between blocks under `no_grad` does so at the root too.)
        let out = self.forward(|| tandem_nn::no_grad(f));
        e.lock().no_grad = false;
        let ended = e.end_step();
        let out = out?.detach();
        ended?;
        Ok(out)
    }

    /// Frees every gathered parameter (PyTorch: `model.reshard()`): after an evaluation
    /// forward that no backward follows, the root's parameters stay gathered until this or the
    /// next backward.
    pub fn reshard(&self) -> Result<()> {
        self.engine().end_step()
    }

    /// The backward of a loss computed inside [`Fsdp::forward`]: every unit's gradients
    /// reduce-scattered (averaged over the group) as backward reaches it, the root's after.
    /// Returns the gradients of this rank's shards, keyed by the [`Fsdp::params`] variables,
    /// for any tandem or candle optimizer. While gradient sync is off
    /// ([`Fsdp::set_requires_gradient_sync`]) the full gradients are accumulated instead and
    /// the store holds none: step after the backward that syncs.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let e = &self.engine();
        if !e.lock().in_step {
            return Err(FsdpError::Order("Fsdp::backward without Fsdp::forward".into()));
        }
        let result = self.backward_in_step(loss);
        let ended = e.end_step();
        let grads = result?;
        ended?;
        Ok(grads)
    }

    fn backward_in_step(&self, loss: &Tensor) -> Result<GradStore> {
        let e = &self.engine();
        let mut grads = loss.backward().map_err(tensor("backward"))?;
        let root = e.root();
        let mut root_grads = Vec::new();
        for (p, param) in e.params.iter().enumerate() {
            let mut g = grads.remove(param.full.as_tensor());
            if param.unit != root {
                if g.is_some() {
                    return Err(FsdpError::ReadOutsideUnit {
                        param: param.name.clone(),
                        unit: e.units[param.unit].name.clone(),
                    });
                }
                continue;
            }
            if let Some(extra) = e.take_root_extra(p) {
                add(&mut g, extra).map_err(tensor(format!("the gradient of `{}`", param.name)))?;
            }
            if let (Some(g), true) = (g, param.trainable) {
                root_grads.push((p, g));
            }
        }
        e.reduce(root_grads)?;
        e.finish_reductions()?;
        for (p, g) in e.take_shard_grads().into_iter().enumerate() {
            if let Some(g) = g {
                grads.insert(e.params[p].shard.as_tensor(), g);
            }
        }
        Ok(grads)
    }

    /// FSDP2's `set_requires_gradient_sync`: with `false`, backward accumulates full gradients
    /// on each rank without communicating (gradient accumulation); the next backward with
    /// `true` reduce-scatters the sum.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.engine().lock().sync = sync;
    }

    /// This rank's shards of the trainable parameters: what the optimizer steps (PyTorch:
    /// `model.parameters()` of a sharded model, `requires_grad` ones).
    pub fn params(&self) -> Vec<Var> {
        self.engine().params.iter().filter(|p| p.trainable).map(|p| p.shard.clone()).collect()
    }

    /// The communication since the last call (see [`CommStats`]), and a fresh count.
    pub fn take_comm_stats(&self) -> CommStats {
        std::mem::take(&mut self.engine().lock().stats)
    }

    /// Every parameter's shard on this rank, in the model's order (frozen ones included; the
    /// trainable ones in [`Fsdp::params`]'s order).
    pub fn shards(&self) -> Vec<Shard> {
        self.engine()
            .params
            .iter()
            .map(|p| Shard {
                name: p.name.clone(),
                var: p.shard.clone(),
                rows: p.layout.my_rows(),
                dims: p.layout.dims.clone(),
                trainable: p.trainable,
            })
            .collect()
    }

    /// The units' names, the root last.
    pub fn units(&self) -> Vec<String> {
        self.engine().units.iter().map(|u| u.name.clone()).collect()
    }

    /// This rank's place among the ranks a parameter is sharded over (a row of an HSDP mesh).
    pub fn rank(&self) -> usize {
        self.engine().group.rank()
    }

    /// How many ranks a parameter is sharded over (a row of an HSDP mesh).
    pub fn world_size(&self) -> usize {
        self.engine().group.size()
    }

    /// Whether this rank's shards are the first copy of them: always under FSDP, on the
    /// mesh's first row under HSDP (the others hold the same shards). A checkpoint takes each
    /// shard from its first copy.
    pub fn is_first_replica(&self) -> bool {
        self.engine().replicate.as_ref().is_none_or(|g| g.rank() == 0)
    }

    /// Runs `f` with every parameter gathered (PyTorch: `unshard()`; FSDP1's
    /// `summon_full_params`): the plain model, for evaluation or export; a unit called inside
    /// `f` runs its function as it is (no graph is cut, nothing is gathered). The parameters
    /// are gathered in float32 whatever the mixed-precision policy: the master weights. A
    /// collective.
    pub fn summon_full_params<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let e = &self.engine();
        e.outside_step("summon_full_params")?;
        let units = 0..e.units.len();
        e.lock().summoned = true;
        let gathered = (units.clone().try_for_each(|u| e.prefetch(u)))
            .and_then(|()| units.clone().try_for_each(|u| e.gather(u)));
        let out = gathered.map(|()| f());
        e.lock().summoned = false;
        for u in 0..e.units.len() {
            e.reshard(u)?;
        }
        out
    }

    /// The full parameters by name, copied out (every rank gets them): the state dict to export.
    /// A collective.
    pub fn full_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let e = &self.engine();
        self.summon_full_params(|| {
            e.params
                .iter()
                .map(|p| {
                    let t = p
                        .full
                        .as_tensor()
                        .copy()
                        .map_err(tensor(format!("copying `{}`", p.name)))?;
                    Ok((p.name.clone(), t))
                })
                .collect::<Result<Vec<_>>>()
        })?
    }

    /// `torch.nn.utils.clip_grad_norm_` over the sharded gradients (tandem-optim's
    /// `clip_grad_norm`, the squared norms summed over the ranks by one all-reduce): every
    /// gradient scaled by `max_norm / (norm + 1e-6)` when that is below 1. Returns the norm
    /// before clipping, the same on every rank. A collective.
    pub fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        let sum = self.sum_over_ranks();
        tandem_optim::clip_grad_norm_over(&self.params(), grads, max_norm, |x| sum(x))
            .map_err(|e| FsdpError::Clip(Box::new(e)))
    }

    /// Sums a number over the ranks a parameter is sharded over (one all-reduce; a row of an
    /// HSDP mesh, whose rows hold the same gradients): what a `tandem_optim::Step` stepping
    /// these shards clips and checks for inf/NaN with (`Step::sharded`).
    /// It follows the model through a live regroup (the group of the time of each call).
    pub fn sum_over_ranks(&self) -> tandem_optim::SumOverRanks {
        let current = self.current.clone();
        Arc::new(move |local| {
            let mut sum = [local];
            current.get().group.all_reduce(&mut sum, ReduceOp::Sum)?;
            Ok(sum[0])
        })
    }
}
