//! `Ddp`: DistributedDataParallel for candle models.
//!
//! Training loop (the model reads its parameters through its `ParamSet`, see `params`):
//! ```ignore
//! let ddp = Ddp::new(model, &group, DdpOptions::default())?;
//! let loss = ddp.loss(&x, &y)?;          // the model's own method, through Deref
//! let grads = ddp.backward(&loss)?;      // GradStore: world-averaged gradient per parameter Var
//! opt.step(&grads)?;
//! ```
//! The first parameter read of a forward starts a step (and broadcasts buffers from rank 0);
//! each parameter's backward hook copies its finished gradient into a bucket; full buckets are
//! all-reduced on a communication thread while backward continues.
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::comm::GradComm;
use crate::error::{DdpError, Result};
use crate::hook::{with_f32_slice, ViewHooks};
use crate::module::ParamModule;
use crate::reducer::{Reducer, ReducerConfig};
use crate::vars::NamedVars;

/// PyTorch's DistributedDataParallel keyword arguments that apply here.
#[derive(Clone, Debug)]
pub struct DdpOptions {
    pub bucket_cap_mb: f64,
    pub first_bucket_mb: f64,
    pub broadcast_buffers: bool,
    pub find_unused_parameters: bool,
    /// Rebuild buckets in gradient arrival order after the first iteration (PyTorch does).
    pub rebuild_buckets: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            broadcast_buffers: true,
            find_unused_parameters: false,
            rebuild_buckets: true,
        }
    }
}

fn mb_to_bytes(what: &'static str, mb: f64) -> Result<usize> {
    if !(mb.is_finite() && mb > 0.0) {
        return Err(DdpError::InvalidOption {
            what,
            why: format!("{mb} is not a positive number of MiB"),
        });
    }
    Ok(((mb * 1024.0 * 1024.0) as usize).max(1))
}

struct Shared {
    comm: Arc<dyn GradComm>,
    reducer: Mutex<Reducer>,
    buffers: Vec<(String, Var)>,
    broadcast_buffers: bool,
    sync: AtomicBool,
    /// First error raised inside a hook (candle would otherwise report it as a generic op error).
    hook_error: Mutex<Option<DdpError>>,
}

impl Shared {
    fn reducer(&self) -> MutexGuard<'_, Reducer> {
        self.reducer.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn start_step(&self) -> Result<()> {
        if self.broadcast_buffers && self.comm.size() > 1 && !self.buffers.is_empty() {
            broadcast_vars(self.comm.as_ref(), &self.buffers)?;
        }
        self.reducer().prepare_for_backward(self.sync.load(Ordering::SeqCst));
        Ok(())
    }
    fn record(&self, e: DdpError) -> candle_core::Error {
        let msg = e.to_string();
        let mut slot = self.hook_error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
        candle_core::Error::Msg(msg)
    }
}

impl ViewHooks for Shared {
    fn on_view_start(&self) -> candle_core::Result<()> {
        self.start_step().map_err(|e| self.record(e))
    }
    fn on_grad_ready(&self, idx: usize, grad: &Tensor) -> candle_core::Result<()> {
        let r = with_f32_slice(grad, |g| self.reducer().mark_ready(idx, g))?;
        r.map_err(|e| self.record(e))
    }
}

/// Concatenates the vars (f32), broadcasts them from rank 0 in one collective, writes back.
fn broadcast_vars(comm: &dyn GradComm, vars: &[(String, Var)]) -> Result<()> {
    let mut flat = Vec::new();
    for (_, v) in vars {
        with_f32_slice(v.as_tensor(), |s| flat.extend_from_slice(s))?;
    }
    comm.broadcast(&mut flat, 0).map_err(|e| {
        DdpError::comm("broadcast of parameters/buffers from rank 0", comm.rank(), e)
    })?;
    let mut off = 0;
    for (_, v) in vars {
        let n = v.elem_count();
        v.set(&Tensor::from_slice(&flat[off..off + n], v.shape(), v.device())?)?;
        off += n;
    }
    Ok(())
}

/// Every rank's "name shape dtype" list; the first difference from rank 0 is an error naming
/// both ranks. All ranks see the same gathered lists, so they all fail together.
fn check_same_params(comm: &dyn GradComm, vars: &[(String, Var)]) -> Result<()> {
    let describe = |(n, v): &(String, Var)| format!("{n} {:?} {:?}", v.dims(), v.dtype());
    let mine: Vec<String> = vars.iter().map(describe).collect();
    let all = comm
        .all_gather_bytes(mine.join("\n").as_bytes())
        .map_err(|e| DdpError::comm("all_gather of parameter descriptions", comm.rank(), e))?;
    let lists: Vec<Vec<String>> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).lines().map(str::to_string).collect())
        .collect();
    let Some(reference) = lists.first() else { return Ok(()) };
    for (rank, list) in lists.iter().enumerate().skip(1) {
        for i in 0..reference.len().max(list.len()) {
            let (a, b) = (reference.get(i), list.get(i));
            if a != b {
                return Err(DdpError::ParamMismatch {
                    what: format!("entry #{i} of parameters+buffers"),
                    rank_a: 0,
                    a: a.cloned().unwrap_or_else(|| "<none>".into()),
                    rank_b: rank,
                    b: b.cloned().unwrap_or_else(|| "<none>".into()),
                });
            }
        }
    }
    Ok(())
}

pub struct Ddp<M: ParamModule> {
    module: M,
    shared: Arc<Shared>,
}

impl<M: ParamModule> Ddp<M> {
    /// Checks that every rank holds the same parameters and buffers (names, shapes, dtypes),
    /// broadcasts them from rank 0, and attaches the gradient hooks. A collective.
    pub fn new<G: GradComm + Clone + 'static>(
        module: M,
        group: &G,
        opts: DdpOptions,
    ) -> Result<Self> {
        Self::with_comm(module, Arc::new(group.clone()), opts)
    }

    pub fn with_comm(module: M, comm: Arc<dyn GradComm>, opts: DdpOptions) -> Result<Self> {
        let params = module.named_parameters();
        let buffers = module.named_buffers();
        for (name, v) in params.iter() {
            if v.dtype() != candle_core::DType::F32 {
                return Err(DdpError::UnsupportedDtype { name: name.clone(), dtype: v.dtype() });
            }
        }
        let everything: Vec<(String, Var)> =
            params.iter().cloned().chain(buffers.iter().cloned()).collect();
        check_same_params(comm.as_ref(), &everything)?;
        if comm.size() > 1 {
            let floats: Vec<(String, Var)> = everything
                .iter()
                .filter(|(_, v)| v.dtype() == candle_core::DType::F32)
                .cloned()
                .collect();
            broadcast_vars(comm.as_ref(), &floats)?;
        }
        let cfg = ReducerConfig {
            first_bucket_bytes: mb_to_bytes("first_bucket_mb", opts.first_bucket_mb)?,
            bucket_bytes: mb_to_bytes("bucket_cap_mb", opts.bucket_cap_mb)?,
            find_unused_parameters: opts.find_unused_parameters,
            rebuild_buckets: opts.rebuild_buckets,
        };
        let reducer = Reducer::new(
            params.iter().map(|(n, _)| n.clone()).collect(),
            params.iter().map(|(_, v)| v.elem_count()).collect(),
            comm.clone(),
            cfg,
        )?;
        let shared = Arc::new(Shared {
            comm,
            reducer: Mutex::new(reducer),
            buffers: buffers
                .into_iter()
                .filter(|(_, v)| v.dtype() == candle_core::DType::F32)
                .collect(),
            broadcast_buffers: opts.broadcast_buffers,
            sync: AtomicBool::new(true),
            hook_error: Mutex::new(None),
        });
        // A world of one has no communication to overlap with backward, so it skips the hooks
        // and with them the copy of every parameter that the identity op costs each forward;
        // `backward` then reduces from candle's gradients, with the same semantics (averaging,
        // unused-parameter check, no_sync accumulation).
        if shared.comm.size() > 1 {
            module.params().attach(shared.clone());
        }
        Ok(Ddp { module, shared })
    }

    /// The wrapped model as a plain model, like PyTorch's `ddp.module`: a forward through it
    /// starts no step, broadcasts no buffers and fires no gradient hooks, so one rank alone can
    /// evaluate it (`if rank == 0 { ddp.module().forward(&x) }`) without the others. Reads go
    /// around the hooks while the returned handle lives; a Ddp forward in that time still trains
    /// correctly, its gradients reduced after backward instead of overlapped with it.
    pub fn module(&self) -> Unhooked<'_, M> {
        self.module.params().begin_plain();
        Unhooked { module: &self.module }
    }

    /// Unwraps the model (hooks detached), e.g. to save or evaluate it without Ddp.
    pub fn into_inner(self) -> M {
        self.module.params().detach();
        self.module
    }

    pub fn rank(&self) -> usize {
        self.shared.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.shared.comm.size()
    }

    /// Runs `f` with gradient synchronisation off: backwards inside accumulate gradients locally
    /// and the next synchronised backward all-reduces the sum (PyTorch's `with ddp.no_sync():`).
    pub fn no_sync<T>(&self, f: impl FnOnce(&Self) -> T) -> T {
        struct Restore<'a>(&'a AtomicBool, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::SeqCst);
            }
        }
        let _restore = Restore(&self.shared.sync, self.shared.sync.swap(false, Ordering::SeqCst));
        f(self)
    }

    /// Backward through `loss`, then the gradients: averaged over the world in a synchronised
    /// step, this rank's accumulated ones inside `no_sync`. Keyed by the parameter `Var`s.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let viewed = self.module.params().end_view();
        let candle_grads = match loss.backward() {
            Ok(g) => g,
            Err(e) => {
                let hooked =
                    self.shared.hook_error.lock().unwrap_or_else(|p| p.into_inner()).take();
                return Err(hooked.unwrap_or(DdpError::Candle(e)));
            }
        };
        let vars = self.module.params().vars();
        let mut candle_grads = candle_grads;
        if !viewed && self.shared.comm.size() == 1 && self.shared.sync.load(Ordering::SeqCst) {
            // A world of one, nothing accumulated by no_sync, every parameter used: the average
            // over the world is candle's gradient itself; skip the copy through the buckets.
            // Anything else (an unused parameter, accumulation) takes the reducer's path below.
            let all_used = vars.iter().all(|v| candle_grads.get(v.as_tensor()).is_some());
            if all_used && !self.shared.reducer().has_accumulated() {
                let mut grads = GradStore::default();
                for v in &vars {
                    if let Some(g) = candle_grads.remove(v.as_tensor()) {
                        grads.insert(v.as_tensor(), g);
                    }
                }
                return Ok(grads);
            }
        }
        if !viewed {
            // The forward did not read parameters through the view (no hooks fired): reduce
            // from candle's own gradients, without overlap.
            self.shared.start_step()?;
            let mut r = self.shared.reducer();
            for (i, v) in vars.iter().enumerate().rev() {
                if let Some(g) = candle_grads.get(v.as_tensor()) {
                    with_f32_slice(g, |s| r.mark_ready(i, s))??;
                }
            }
        }
        drop(candle_grads);
        let mut r = self.shared.reducer();
        r.finalize()?;
        let mut grads = GradStore::default();
        if r.is_sync() {
            // Synced: the gradients are views into the averaged bucket buffers (no copy on CPU).
            for (data, params) in r.take_reduced() {
                let len = data.len();
                let device =
                    vars.first().map(|v| v.device().clone()).unwrap_or(candle_core::Device::Cpu);
                let bucket = Tensor::from_vec(data, len, &device)?;
                for (i, off) in params {
                    let v = &vars[i];
                    grads.insert(
                        v.as_tensor(),
                        bucket.narrow(0, off, v.elem_count())?.reshape(v.shape())?,
                    );
                }
            }
        } else {
            for (i, v) in vars.iter().enumerate() {
                if let Some(g) = r.grad(i) {
                    grads.insert(v.as_tensor(), Tensor::from_slice(g, v.shape(), v.device())?);
                }
            }
        }
        r.after_step()?;
        Ok(grads)
    }

    /// Current bucket layout, parameter indices per bucket (diagnostics, tests).
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.shared.reducer().bucket_params()
    }
}

impl Ddp<NamedVars> {
    /// Wraps a stock candle model by its `VarMap`: the model code is unchanged and keeps
    /// reading its own `Var`s, which Ddp checks across ranks and overwrites with rank 0's
    /// values. `backward` returns the world-averaged gradients as a `GradStore` keyed by those
    /// `Var`s, for candle-nn's optimizers (`Optimizer::step(&GradStore)`) or tandem's. See
    /// [`crate::vars`] for ordering and buffers.
    pub fn from_varmap<G: GradComm + Clone + 'static>(
        varmap: &candle_nn::VarMap,
        group: &G,
        opts: DdpOptions,
    ) -> Result<Self> {
        Self::new(NamedVars::from_varmap(varmap), group, opts)
    }
}

/// `Ddp::module()`'s handle: the wrapped model, read without Ddp's hooks while it lives.
pub struct Unhooked<'a, M: ParamModule> {
    module: &'a M,
}

impl<M: ParamModule> Deref for Unhooked<'_, M> {
    type Target = M;
    fn deref(&self) -> &M {
        self.module
    }
}

impl<M: ParamModule> Drop for Unhooked<'_, M> {
    fn drop(&mut self) {
        self.module.params().end_plain();
    }
}

/// The training path, like calling PyTorch's `ddp(x)`: the model's methods through the wrapper
/// read parameters through Ddp's hooks (the first read of a forward starts a step).
impl<M: ParamModule> Deref for Ddp<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.module
    }
}
