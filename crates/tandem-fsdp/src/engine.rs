//! The state a sharded model's step runs on, shared by [`crate::Fsdp`] and the unit ops that
//! candle's backward calls: the shards, which units are gathered, the all-gathers in flight
//! (prefetches) and the reduce-scatters in flight.
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use candle_core::{Tensor, Var};
use tandem_comm::{ProcessGroup, ReduceOp};
use tandem_nn::kernels::with_f32_slice;

use crate::error::{comm, tensor, FsdpError, Result};
use crate::layout::ShardLayout;
use crate::storage;
use crate::unit_op::UnitOp;
use crate::wire::{InFlight, Wire};

/// How far ahead of the running unit a large unit's all-gather may start.
const PREFETCH_UNITS: usize = 8;

/// One parameter: the model's `Var` (full values only while its unit is gathered) and this
/// rank's rows of it, the `Var` the optimizer steps.
pub(crate) struct Param {
    pub name: String,
    pub full: Var,
    pub shard: Var,
    pub layout: ShardLayout,
    pub trainable: bool,
    pub unit: usize,
}

/// A unit: its parameters, gathered and reduced together.
#[derive(Clone)]
pub(crate) struct Unit {
    pub name: String,
    pub params: Vec<usize>,
}

/// What a unit keeps between its forward and its backward.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    /// Free the unit's full parameters after its forward (FSDP2's `reshard_after_forward`).
    pub reshard_after_forward: bool,
    /// Keep no graph inside the unit and recompute it in backward.
    pub activation_checkpointing: bool,
}

/// The function a unit computes (run again in backward under activation checkpointing).
pub(crate) type UnitFn = Arc<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// A reduce-scatter in flight: the parameters whose gradients it reduces, at their offsets in
/// its output.
struct Reduction {
    params: Vec<(usize, usize)>,
    work: InFlight,
}

#[derive(Default)]
pub(crate) struct State {
    gathered: Vec<bool>,
    /// Each unit's all-gathers in flight, one per parameter.
    gathering: Vec<Option<Vec<InFlight>>>,
    /// The units in the order this step's forward ran them; `remaining` of them are still to
    /// go through backward.
    order: Vec<usize>,
    remaining: usize,
    /// The last step's order: the next unit's all-gather is started before the current one runs.
    last_order: Vec<usize>,
    pub in_step: bool,
    /// Inside [`crate::Fsdp::summon_full_params`]: every unit gathered in float32 whatever
    /// the policy's `param_dtype` (the master weights, for export), units run plainly.
    pub summoned: bool,
    /// Inside [`crate::Fsdp::forward_no_grad`]: units keep no graph and reshard at once.
    pub no_grad: bool,
    in_unit: Option<usize>,
    reducing: Vec<Reduction>,
    shard_grads: Vec<Option<Tensor>>,
    /// Full gradients kept while gradient sync is off (FSDP2's `set_requires_gradient_sync`).
    unsynced: Vec<Option<Tensor>>,
    /// Gradients of the root's parameters computed inside a unit's backward.
    root_extra: Vec<Option<Tensor>>,
    pub sync: bool,
    pub stats: CommStats,
}

/// Where a sharded step's communication time went, summed since the last
/// [`crate::Fsdp::take_comm_stats`]: the time the step waited for collectives (what compute
/// did not hide) and the bytes this rank moved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    /// Seconds spent waiting for all-gathers (a unit's parameters not there yet).
    pub all_gather_wait_secs: f64,
    /// Seconds spent waiting for reduce-scatters (and HSDP's all-reduces) at the end of backward.
    pub reduce_wait_secs: f64,
    /// Bytes this rank's all-gathers received.
    pub all_gather_bytes: u64,
    /// Bytes this rank's reduce-scatters sent.
    pub reduce_scatter_bytes: u64,
    pub all_gathers: u64,
    pub reduce_scatters: u64,
}

pub(crate) struct Engine {
    /// The ranks a parameter is sharded over.
    pub group: ProcessGroup,
    /// HSDP: the ranks holding the same shard, across which gradients are averaged after the
    /// reduce-scatter (`None`: plain FSDP).
    pub replicate: Option<ProcessGroup>,
    /// `group`'s ranks on connections of their own, made when first needed, for the
    /// reduce-scatters and the all-gathers started more than one unit ahead. A group's
    /// collectives run in issue order: on `group` alone, a large unit's reduce-scatter held
    /// up the all-gathers issued after it (ViT-L's head: the next blocks' by 0.18 s a step),
    /// and its early all-gather held up the blocks' in between (0.12 s). FSDP2 gives its
    /// collectives streams of their own likewise.
    side: OnceLock<ProcessGroup>,
    pub params: Vec<Param>,
    pub units: Vec<Unit>,
    pub schedule: Schedule,
    /// The dtypes the all-gathers and the reduce-scatters move values in.
    wires: (Wire, Wire),
    state: Mutex<State>,
}

/// Adds `g` to what `slot` holds (or puts it there).
pub(crate) fn add(slot: &mut Option<Tensor>, g: Tensor) -> candle_core::Result<()> {
    *slot = Some(match slot.take() {
        Some(acc) => (acc + g)?,
        None => g,
    });
    Ok(())
}

impl Engine {
    pub fn new(
        (group, replicate): (ProcessGroup, Option<ProcessGroup>),
        params: Vec<Param>,
        units: Vec<Unit>,
        schedule: Schedule,
        wires: (Wire, Wire),
    ) -> Engine {
        let (n, p) = (units.len(), params.len());
        let state = State {
            gathered: vec![false; n],
            gathering: (0..n).map(|_| None).collect(),
            shard_grads: vec![None; p],
            unsynced: vec![None; p],
            root_extra: vec![None; p],
            sync: true,
            ..State::default()
        };
        let state = Mutex::new(state);
        Engine { group, replicate, side: OnceLock::new(), params, units, schedule, wires, state }
    }

    /// This model sharded over `group` (and under HSDP replicated across `replicate`), this
    /// rank's shards `rows[p]` of each parameter in the new layout: a live regroup's engine.
    /// The full parameters are freed (a step that failed may have left some gathered).
    pub fn regrouped(
        &self,
        (group, replicate): (ProcessGroup, Option<ProcessGroup>),
        rows: Vec<Tensor>,
    ) -> Result<Engine> {
        if rows.len() != self.params.len() {
            return Err(FsdpError::InvalidOption {
                what: "regroup",
                why: format!("{} shards for {} parameters", rows.len(), self.params.len()),
            });
        }
        let (rank, world) = (group.rank(), group.size());
        let mut params = Vec::with_capacity(rows.len());
        for (old, t) in self.params.iter().zip(rows) {
            let layout = ShardLayout::new(&old.layout.dims, rank, world);
            if t.dims() != layout.shard_dims() {
                return Err(FsdpError::Unsupported {
                    param: old.name.clone(),
                    why: format!(
                        "rows of shape {:?} for rank {rank} of {world}, whose shard is {:?}",
                        t.dims(),
                        layout.shard_dims()
                    ),
                });
            }
            let what = || format!("the shard of `{}`", old.name);
            let t = t.to_dtype(candle_core::DType::F32).map_err(tensor(what()))?;
            let shard = Var::from_tensor(&t).map_err(tensor(what()))?;
            storage::free(old.full.as_tensor())
                .map_err(tensor(format!("freeing `{}`", old.name)))?;
            params.push(Param {
                name: old.name.clone(),
                full: old.full.clone(),
                shard,
                layout,
                trainable: old.trainable,
                unit: old.unit,
            });
        }
        let sync = self.lock().sync;
        let groups = (group, replicate);
        let engine = Engine::new(groups, params, self.units.clone(), self.schedule, self.wires);
        engine.lock().sync = sync;
        Ok(engine)
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An error naming `what` when it is called between a forward and its backward (a shard
    /// read or set there would desync the gathered units).
    pub fn outside_step(&self, what: &str) -> Result<()> {
        match self.lock().in_step {
            true => Err(FsdpError::Order(format!("{what} between forward and backward"))),
            false => Ok(()),
        }
    }

    pub fn root(&self) -> usize {
        self.units.len() - 1
    }

    /// Starts unit `u`'s all-gather unless it is gathered or on its way; `early`: on the side
    /// group (a unit more than one ahead).
    fn start_gather_on(&self, st: &mut State, u: usize, early: bool) -> Result<()> {
        if st.gathered[u] || st.gathering[u].is_some() {
            return Ok(());
        }
        let unit = &self.units[u];
        if unit.params.is_empty() {
            st.gathered[u] = true; // a root with every parameter in a unit
            return Ok(());
        }
        // One all-gather per parameter: its output, rank-major rows with any padding at the
        // end, is the full parameter once truncated, so it becomes the parameter's storage
        // without a copy.
        let mut works = Vec::with_capacity(unit.params.len());
        for &p in &unit.params {
            let param = &self.params[p];
            let mut input = Vec::with_capacity(param.layout.padded_len());
            with_f32_slice(param.shard.as_tensor(), |shard| {
                param.layout.pack_shard(shard, &mut input)
            })
            .map_err(tensor(format!("reading the shard of `{}`", param.name)))?;
            let wire = if st.summoned { Wire::F32 } else { self.wires.0 };
            let group = if early { self.side()? } else { &self.group };
            works.push(wire.all_gather(group, input));
        }
        st.gathering[u] = Some(works);
        Ok(())
    }

    /// Starts unit `u`'s all-gather on `group` unless it is gathered or on its way.
    fn start_gather(&self, st: &mut State, u: usize) -> Result<()> {
        self.start_gather_on(st, u, false)
    }

    /// Starts `u`'s all-gather in the background (a prefetch).
    pub fn prefetch(&self, u: usize) -> Result<()> {
        self.start_gather(&mut self.lock(), u)
    }

    /// Unit `u`'s parameters hold their full values when this returns.
    pub fn gather(&self, u: usize) -> Result<()> {
        let work = {
            let mut st = self.lock();
            self.start_gather(&mut st, u)?;
            match st.gathering[u].take() {
                Some(work) => work,
                None => return Ok(()), // already gathered
            }
        };
        let waited = std::time::Instant::now();
        let mut gathered = Vec::with_capacity(work.len());
        for w in work {
            gathered.push(w.wait("all_gather")?);
        }
        {
            let stats = &mut self.lock().stats;
            stats.all_gather_wait_secs += waited.elapsed().as_secs_f64();
            let size = self.wires.0.size();
            stats.all_gather_bytes += gathered.iter().map(|g| g.len() as u64 * size).sum::<u64>();
            stats.all_gathers += gathered.len() as u64;
        }
        for (&p, mut full) in self.units[u].params.iter().zip(gathered) {
            let param = &self.params[p];
            full.truncate(param.layout.full_len());
            storage::fill(param.full.as_tensor(), full)
                .map_err(tensor(format!("filling `{}`", param.name)))?;
        }
        self.lock().gathered[u] = true;
        Ok(())
    }

    /// Frees unit `u`'s full parameters.
    pub fn reshard(&self, u: usize) -> Result<()> {
        let mut st = self.lock();
        if !st.gathered[u] {
            return Ok(());
        }
        for &p in &self.units[u].params {
            let param = &self.params[p];
            storage::free(param.full.as_tensor())
                .map_err(tensor(format!("freeing `{}`", param.name)))?;
        }
        st.gathered[u] = false;
        Ok(())
    }

    /// Hands a unit's full gradients (by parameter) to the reduce-scatter, or keeps them for
    /// later while gradient sync is off.
    pub fn reduce(&self, grads: Vec<(usize, Tensor)>) -> Result<()> {
        let mut st = self.lock();
        let mut ready = Vec::with_capacity(grads.len());
        for (p, g) in grads {
            let name = || format!("accumulating the gradient of `{}`", self.params[p].name);
            add(&mut st.unsynced[p], g).map_err(tensor(name()))?;
            if st.sync {
                ready.extend(st.unsynced[p].take().map(|g| (p, g)));
            }
        }
        if ready.is_empty() {
            return Ok(());
        }
        let stride: usize = ready.iter().map(|(p, _)| self.params[*p].layout.padded_len()).sum();
        let mut input = vec![0f32; stride * self.group.size()];
        let mut params = Vec::with_capacity(ready.len());
        let mut offset = 0;
        for (p, g) in ready {
            let param = &self.params[p];
            // Packed straight from the gradient's storage: no copy of a full gradient.
            let len = with_f32_slice(&g, |full| {
                if full.len() == param.layout.full_len() {
                    param.layout.pack_full(full, stride, offset, &mut input);
                }
                full.len()
            })
            .map_err(tensor(format!("reading the gradient of `{}`", param.name)))?;
            if len != param.layout.full_len() {
                return Err(FsdpError::Unsupported {
                    param: param.name.clone(),
                    why: format!("a gradient of {len} elements for {:?}", param.layout.dims),
                });
            }
            params.push((p, offset));
            offset += param.layout.padded_len();
        }
        let work = self.wires.1.reduce_scatter(self.side()?, input, stride);
        st.reducing.push(Reduction { params, work });
        Ok(())
    }

    /// The side group (made by the first call: every rank makes it at the same point of the
    /// same step).
    fn side(&self) -> Result<&ProcessGroup> {
        if let Some(g) = self.side.get() {
            return Ok(g);
        }
        let ranks: Vec<usize> = (0..self.group.size()).collect();
        let made = self.group.new_group(&ranks).map_err(comm("forming FSDP's side group"))?;
        let g = made.ok_or_else(|| FsdpError::Order("this rank is not in its own group".into()))?;
        Ok(self.side.get_or_init(|| g))
    }

    /// Waits for every reduce-scatter in flight and keeps the shard gradients they produce.
    pub fn finish_reductions(&self) -> Result<()> {
        let pending = std::mem::take(&mut self.lock().reducing);
        for Reduction { params, work } in pending {
            let waited = std::time::Instant::now();
            let mut out = work.wait("reduce_scatter")?;
            if let Some(replicas) = &self.replicate {
                replicas.all_reduce(&mut out, ReduceOp::Avg).map_err(comm("all_reduce"))?;
            }
            {
                let stats = &mut self.lock().stats;
                stats.reduce_wait_secs += waited.elapsed().as_secs_f64();
                let sent = out.len() as u64 * self.wires.1.size() * self.group.size() as u64;
                stats.reduce_scatter_bytes += sent;
                stats.reduce_scatters += 1;
            }
            for (p, offset) in params {
                let param = &self.params[p];
                let n = param.layout.shard_len();
                let g = Tensor::from_slice(
                    &out[offset..offset + n],
                    param.layout.shard_dims(),
                    param.shard.device(),
                )
                .map_err(tensor(format!("the shard gradient of `{}`", param.name)))?;
                self.lock().shard_grads[p] = Some(g);
            }
        }
        Ok(())
    }

    /// Takes the finished shard gradients.
    pub fn take_shard_grads(&self) -> Vec<Option<Tensor>> {
        let mut st = self.lock();
        let n = st.shard_grads.len();
        std::mem::replace(&mut st.shard_grads, vec![None; n])
    }

    /// Takes the root's gradients computed inside units.
    pub fn take_root_extra(&self, p: usize) -> Option<Tensor> {
        self.lock().root_extra[p].take()
    }

    /// Begins a forward: the root gathered, this step's unit order started afresh.
    pub fn begin_forward(&self) -> Result<()> {
        {
            let mut st = self.lock();
            if st.in_unit.is_some() {
                return Err(FsdpError::Order("Fsdp::forward inside a unit's forward".into()));
            }
            if !st.order.is_empty() {
                let order = std::mem::take(&mut st.order);
                st.last_order = order;
            }
            st.remaining = 0;
            st.in_step = true;
        }
        self.gather(self.root())
    }

    /// Ends a forward: the unit backward reaches first starts gathering while the loss's own
    /// backward runs.
    pub fn end_forward(&self) -> Result<()> {
        let mut st = self.lock();
        if st.no_grad {
            return Ok(()); // no backward comes
        }
        match st.order.last() {
            Some(&last) if self.schedule.reshard_after_forward => self.start_gather(&mut st, last),
            _ => Ok(()),
        }
    }

    /// Ends a backward: nothing gathered, nothing in flight, the order kept for prefetching.
    pub fn end_step(&self) -> Result<()> {
        let pending: Vec<_> = {
            let mut st = self.lock();
            st.in_step = false;
            let order = std::mem::take(&mut st.order);
            if !order.is_empty() {
                st.last_order = order;
            }
            st.gathering.iter_mut().filter_map(Option::take).collect()
        };
        for work in pending {
            for w in work {
                w.wait("all_gather")?; // a prefetch no unit used
            }
        }
        for u in 0..self.units.len() {
            self.reshard(u)?;
        }
        Ok(())
    }

    /// Unit `u`'s forward: gathered (the next unit's all-gather started meanwhile), run,
    /// resharded. The result carries the op that runs the unit's backward: on the graph the
    /// forward kept (FSDP2's default), or on one recomputed then (activation checkpointing, where
    /// the forward keeps no graph inside the unit).
    pub fn unit_forward(self: &Arc<Self>, u: usize, x: &Tensor, f: UnitFn) -> Result<Tensor> {
        let anchor = {
            let mut st = self.lock();
            if st.summoned && !st.in_step {
                drop(st);
                // FSDP2 after `unshard()`: the full parameters are there, no graph to cut.
                return self.run(u, x, &f);
            }
            if !st.in_step {
                return Err(FsdpError::Order(format!(
                    "unit `{}` ran outside Fsdp::forward",
                    self.units[u].name
                )));
            }
            if let Some(outer) = st.in_unit {
                return Err(FsdpError::Order(format!(
                    "unit `{}` ran inside unit `{}`: units do not nest",
                    self.units[u].name, self.units[outer].name
                )));
            }
            st.order.push(u);
            st.remaining = st.order.len();
            let at = st.order.len() - 1;
            // This unit's all-gather first: the collectives run in the order they are issued.
            self.start_gather(&mut st, u)?;
            self.prefetch_ahead(&mut st, at)?;
            // The last step's last unit runs backward first: it stays gathered for that.
            let last = at + 1 == st.last_order.len() && st.last_order[at] == u;
            let anchor = self.params[self.units[u].params[0]].full.as_tensor().clone();
            (anchor, last)
        };
        let (anchor, last) = anchor;
        self.gather(u)?;
        if self.lock().no_grad {
            // No backward follows: nothing to keep, nothing to stay gathered for.
            let y = self.run(u, &x.detach(), &f)?.detach();
            self.reshard(u)?;
            return Ok(y);
        }
        let (y, graph) = if self.schedule.activation_checkpointing {
            (self.run(u, &x.detach(), &f)?.detach(), UnitGraph::Recompute(f))
        } else {
            let input = self.input_var(u, x)?;
            let y = self.run(u, input.as_tensor(), &f)?;
            (y.clone(), UnitGraph::Kept { input, output: y })
        };
        let out = x.apply_op2(&anchor, UnitOp::new(Arc::clone(self), u, y, graph));
        let name = &self.units[u].name;
        if self.schedule.reshard_after_forward && !last {
            // The kept graph reads the parameters' storage, refilled before its backward.
            self.reshard(u)?;
        }
        out.map_err(tensor(format!("the output of unit `{name}`")))
    }

    /// Starts the all-gathers of the units after position `at` of the last step's order: the
    /// next one, and a unit `k` places ahead once it is at least `k` times the size of the unit
    /// at `at` — so a large unit (ViT-L's 340 MB head after 50 MB blocks) starts gathering
    /// several units early and its transfer overlaps their compute instead of one unit's.
    /// Every rank decides the same from the same order and sizes (collectives keep one order).
    fn prefetch_ahead(&self, st: &mut State, at: usize) -> Result<()> {
        let size = |u: usize| self.unit_len(u);
        let here = st.last_order.get(at).map_or(0, |&u| size(u)).max(1);
        for k in 1..=PREFETCH_UNITS {
            let Some(&next) = st.last_order.get(at + k) else { break };
            if next != self.root() && (k == 1 || size(next) >= k * here) {
                self.start_gather_on(st, next, k > 1)?;
            }
        }
        Ok(())
    }

    /// The values of unit `u`'s full parameters.
    fn unit_len(&self, u: usize) -> usize {
        self.units[u].params.iter().map(|&p| self.params[p].layout.full_len()).sum()
    }

    /// A variable holding `x`'s values, where unit `u`'s graph starts (its gradient is the
    /// input's).
    fn input_var(&self, u: usize, x: &Tensor) -> Result<Var> {
        Var::from_tensor(&x.detach())
            .map_err(tensor(format!("the input of unit `{}`", self.units[u].name)))
    }

    /// Runs `f` as unit `u`.
    fn run(&self, u: usize, x: &Tensor, f: &UnitFn) -> Result<Tensor> {
        self.lock().in_unit = Some(u);
        let y = f(x);
        self.lock().in_unit = None;
        y.map_err(|e| {
            let hint = if storage::read_freed(&e) { storage::FREED_HINT } else { "" };
            FsdpError::Tensor {
                context: format!("the forward of unit `{}` {hint}", self.units[u].name),
                source: Box::new(e),
            }
        })
    }

    /// Unit `u`'s backward (called by candle's backward through [`UnitOp`]; `x` its input):
    /// gathered again (the previous unit's all-gather started meanwhile), differentiated — on
    /// the graph its forward kept, or on one recomputed now — its parameters' gradients sent to
    /// the reduce-scatter, resharded; returns the input's gradient.
    pub fn unit_backward(
        &self,
        u: usize,
        x: &Tensor,
        grad: &Tensor,
        graph: UnitGraph,
    ) -> Result<Option<Tensor>> {
        {
            let mut st = self.lock();
            self.start_gather(&mut st, u)?;
            let remaining = st.remaining;
            if let Some(at) = st.order[..remaining].iter().rposition(|&v| v == u) {
                st.remaining = at;
                if at > 0 {
                    let previous = st.order[at - 1];
                    self.start_gather(&mut st, previous)?;
                }
            }
        }
        self.gather(u)?;
        let (input, y) = match graph {
            UnitGraph::Kept { input, output } => (input, output),
            UnitGraph::Recompute(f) => {
                let input = self.input_var(u, x)?;
                let y = tandem_nn::recompute(|| self.run(u, input.as_tensor(), &f))?;
                (input, y)
            }
        };
        let mut grads = grad
            .detach()
            .to_dtype(y.dtype())
            .and_then(|g| y.mul(&g))
            .and_then(|t| t.sum_all())
            .and_then(|t| tandem_nn::backward(&t))
            .map_err(tensor(format!("the backward of unit `{}`", self.units[u].name)))?;
        drop(y); // the unit's graph, activations and all, ends here
                 // The full parameters are not needed once their gradients exist: freed before the
                 // reduce-scatter's input is packed, so a unit's parameters, its full gradients and that
                 // input are never all held at once (for ViT-L's 85 M-parameter head, 340 MB less).
        self.reshard(u)?;
        let mut mine = Vec::new();
        for (p, param) in self.params.iter().enumerate() {
            let Some(g) = grads.remove(param.full.as_tensor()) else { continue };
            if param.unit == u {
                if param.trainable {
                    mine.push((p, g));
                }
            } else if param.unit == self.root() {
                add(&mut self.lock().root_extra[p], g)
                    .map_err(tensor(format!("the gradient of `{}`", param.name)))?;
            } else {
                return Err(FsdpError::ReadOutsideUnit {
                    param: param.name.clone(),
                    unit: self.units[param.unit].name.clone(),
                });
            }
        }
        self.reduce(mine)?;
        Ok(grads.remove(input.as_tensor()))
    }
}

/// What a unit's backward differentiates.
pub(crate) enum UnitGraph {
    /// The graph its forward kept, from its own input variable to its output.
    Kept { input: Var, output: Tensor },
    /// The unit, run again on its input (activation checkpointing).
    Recompute(UnitFn),
}
