//! `Ddp`: DistributedDataParallel for candle models.
//!
//! Training loop (the model reads its parameters through its `ParamSet`, see `params`):
//! ```ignore
//! let ddp = Ddp::new(model, &group, DdpOptions::default())?;
//! let loss = ddp.hooked().loss(&x, &y)?; // the model's own method, through Ddp's hooks
//! let grads = ddp.backward(&loss)?;      // GradStore: world-averaged gradient per parameter Var
//! opt.step(&grads)?;
//! ```
//! Two explicit ways to reach the model, as in PyTorch: [`Ddp::hooked`] is the training path
//! (PyTorch's `ddp(x)`; `Ddp` also implements candle's `Module` when the model does,
//! so `ddp.forward(&x)` is that call), [`Ddp::module`] the plain model (PyTorch's `ddp.module`).
//! The first parameter read of a forward starts a step (and broadcasts buffers from rank 0);
//! each parameter's backward hook copies its finished gradient into a bucket; full buckets are
//! all-reduced on a communication thread while backward continues.
use std::cell::Cell;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::comm_hooks::CommHook;
use crate::error::{DdpError, Result};
use crate::reducer::{Reducer, ReducerConfig};
use tandem_comm::Collectives;
use tandem_nn::kernels::with_f32_slice;
use tandem_nn::NamedVars;
use tandem_nn::ParamModule;
use tandem_nn::ViewHooks;

mod join;
pub use join::JoinOptions;
use join::JoinState;

/// PyTorch's DistributedDataParallel keyword arguments that apply here.
#[derive(Clone, Debug)]
pub struct DdpOptions {
    pub bucket_cap_mb: f64,
    pub first_bucket_mb: f64,
    pub broadcast_buffers: bool,
    pub find_unused_parameters: bool,
    /// Rebuild buckets in gradient arrival order after the first iteration (PyTorch does).
    pub rebuild_buckets: bool,
    /// Check at construction that every rank holds the same parameters and broadcast rank 0's
    /// (PyTorch always does). `false` skips both, with their collectives (and the cross-rank
    /// check of `register_comm_hook`): for a rank that joins a running job (`tandem::live`),
    /// whose parameters arrive with the training state while the others construct nothing.
    pub sync_on_init: bool,
    /// Reduce, while backward runs, the gradients the model's fused tandem-nn layers compute
    /// (convolutions, linear layers, BatchNorm, PReLU): each bucket goes to the all-reduce as
    /// soon as its last gradient arrives, as the hooks of a [`ParamSet`](tandem_nn::ParamSet)
    /// model make it — for models built on a `VarMap` (tandem's IResNet and ResNet) that read
    /// each parameter once per forward through those layers. A parameter that gets a second
    /// gradient (used twice) is an error naming it, never a wrong average. CPU gradients only:
    /// CUDA gradients under NCCL are reduced on the device after backward.
    pub reduce_during_backward: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            broadcast_buffers: true,
            find_unused_parameters: false,
            rebuild_buckets: true,
            sync_on_init: true,
            reduce_during_backward: false,
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
    comm: Arc<dyn Collectives>,
    /// The comm's world generation the reducer's layout was built in (see
    /// `Collectives::generation`).
    generation: std::sync::atomic::AtomicU64,
    /// `DdpOptions::sync_on_init`: without it, setup calls (registering a comm hook) skip their
    /// cross-rank checks too — the running ranks made them when they set up.
    checked_setup: bool,
    reducer: Mutex<Reducer>,
    buffers: Vec<(String, Var)>,
    broadcast_buffers: bool,
    sync: AtomicBool,
    /// First error raised inside a hook (candle would otherwise report it as a generic op error).
    hook_error: Mutex<Option<DdpError>>,
    /// Set while inside `Ddp::join`.
    join: Mutex<Option<JoinState>>,
    /// `DdpOptions::reduce_during_backward`: the parameters' indices by tensor id.
    early: Option<std::collections::HashMap<candle_core::TensorId, usize>>,
    /// Gradients handed to the reducer during the last backward (`reduce_during_backward`).
    early_count: std::sync::atomic::AtomicUsize,
    /// `no_sync` sums of CUDA gradients kept on the GPU for the NCCL path.
    #[cfg(feature = "cuda")]
    device_sums: Mutex<crate::bucketed::LocalSums>,
}

impl Shared {
    fn reducer(&self) -> MutexGuard<'_, Reducer> {
        self.reducer.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn join_state(&self) -> MutexGuard<'_, Option<JoinState>> {
        self.join.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start_step(&self) -> Result<()> {
        let generation = self.comm.generation();
        if self.generation.swap(generation, Ordering::SeqCst) != generation {
            // The world re-formed (live recovery): every rank starts from the same layout.
            self.reducer().reset_layout();
        }
        let sync = self.sync.load(Ordering::SeqCst);
        let mut root = 0;
        let joining = self.join_state().as_ref().map(|j| j.opts);
        if let Some(opts) = joining {
            let round = self.join_round(true, sync)?;
            root = round.root().unwrap_or(0);
            let active = round.active.iter().filter(|&&a| a).count().max(1);
            let scale = if opts.divide_by_initial_world_size {
                1.0
            } else {
                self.comm.size() as f32 / active as f32
            };
            self.reducer().set_join_step(root, scale);
        }
        if self.broadcast_buffers && self.comm.size() > 1 && !self.buffers.is_empty() {
            broadcast_vars(self.comm.as_ref(), &self.buffers, root)?;
        }
        self.reducer().prepare_for_backward(sync);
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

/// `DdpOptions::reduce_during_backward`'s side of `tandem_nn::backward_with_sink`: a gradient a
/// fused layer computes for one of the model's parameters goes into its bucket at once (the
/// step starts with the first one).
struct EarlySink<'a> {
    shared: &'a Shared,
    ids: &'a std::collections::HashMap<candle_core::TensorId, usize>,
    started: Cell<bool>,
}

impl tandem_nn::GradSink for EarlySink<'_> {
    fn take(&self, param: &Tensor, grad: &Tensor) -> candle_core::Result<bool> {
        let Some(&idx) = self.ids.get(&param.id()) else { return Ok(false) };
        if !grad.device().is_cpu() {
            return Ok(false);
        }
        if !self.started.get() {
            self.shared.start_step().map_err(|e| self.shared.record(e))?;
            self.started.set(true);
        }
        if self.shared.reducer().is_ready(idx) {
            let name = self.shared.reducer().param_name(idx);
            return Err(self.shared.record(DdpError::InvalidOption {
                what: "reduce_during_backward",
                why: format!(
                    "parameter `{name}` got a second gradient from a fused layer: the model uses \
                     it more than once per forward, so turn reduce_during_backward off for it"
                ),
            }));
        }
        self.shared.on_grad_ready(idx, grad)?;
        self.shared.early_count.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }
}

/// Concatenates the vars (f32), broadcasts them from `root` in one collective, writes back.
fn broadcast_vars(comm: &dyn Collectives, vars: &[(String, Var)], root: usize) -> Result<()> {
    let mut flat = Vec::new();
    for (_, v) in vars {
        with_f32_slice(v.as_tensor(), |s| flat.extend_from_slice(s))?;
    }
    comm.broadcast(&mut flat, root).map_err(|e| {
        DdpError::comm(
            "broadcast of parameters/buffers from the authoritative rank",
            comm.rank(),
            e,
        )
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
fn check_same_params(comm: &dyn Collectives, vars: &[(String, Var)]) -> Result<()> {
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
    pub fn new<G: Collectives + Clone + 'static>(
        module: M,
        group: &G,
        opts: DdpOptions,
    ) -> Result<Self> {
        Self::with_comm(module, Arc::new(group.clone()), opts)
    }

    pub fn with_comm(module: M, comm: Arc<dyn Collectives>, opts: DdpOptions) -> Result<Self> {
        let params = module.named_parameters();
        let buffers = module.named_buffers();
        for (name, v) in params.iter() {
            if v.dtype() != candle_core::DType::F32 {
                return Err(DdpError::UnsupportedDtype { name: name.clone(), dtype: v.dtype() });
            }
        }
        let everything: Vec<(String, Var)> =
            params.iter().cloned().chain(buffers.iter().cloned()).collect();
        if opts.sync_on_init {
            check_same_params(comm.as_ref(), &everything)?;
        }
        if opts.sync_on_init && comm.size() > 1 {
            let floats: Vec<(String, Var)> = everything
                .iter()
                .filter(|(_, v)| v.dtype() == candle_core::DType::F32)
                .cloned()
                .collect();
            broadcast_vars(comm.as_ref(), &floats, 0)?;
        }
        let cfg = ReducerConfig {
            first_bucket_bytes: mb_to_bytes("first_bucket_mb", opts.first_bucket_mb)?,
            bucket_bytes: mb_to_bytes("bucket_cap_mb", opts.bucket_cap_mb)?,
            find_unused_parameters: opts.find_unused_parameters,
            rebuild_buckets: opts.rebuild_buckets,
        };
        let mut reducer = Reducer::new(
            params.iter().map(|(n, _)| n.clone()).collect(),
            params.iter().map(|(_, v)| v.elem_count()).collect(),
            comm.clone(),
            cfg,
        )?;
        reducer.set_param_shapes(params.iter().map(|(_, v)| v.dims().to_vec()).collect())?;
        if tandem_comm::debug_level() >= tandem_comm::DebugLevel::Info {
            // TORCH_DISTRIBUTED_DEBUG=INFO: the set-up PyTorch's DDP logs at construction.
            let buckets = reducer.bucket_params();
            let elems: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
            tandem_comm::debug_line(&format!(
                "[tandem rank {}] Ddp: {} parameters ({elems} elements) in {} bucket(s) of \
                 {:?} parameters, first bucket {} MB, cap {} MB, find_unused_parameters {}, \
                 reduce during backward {}",
                comm.rank(),
                params.len(),
                buckets.len(),
                buckets.iter().map(Vec::len).collect::<Vec<_>>(),
                opts.first_bucket_mb,
                opts.bucket_cap_mb,
                opts.find_unused_parameters,
                opts.reduce_during_backward,
            ));
        }
        let shared = Arc::new(Shared {
            generation: comm.generation().into(),
            checked_setup: opts.sync_on_init,
            comm,
            reducer: Mutex::new(reducer),
            buffers: buffers
                .into_iter()
                .filter(|(_, v)| v.dtype() == candle_core::DType::F32)
                .collect(),
            broadcast_buffers: opts.broadcast_buffers,
            sync: AtomicBool::new(true),
            hook_error: Mutex::new(None),
            join: Mutex::new(None),
            early: opts.reduce_during_backward.then(|| {
                params.iter().enumerate().map(|(i, (_, v))| (v.as_tensor().id(), i)).collect()
            }),
            early_count: 0.into(),
            #[cfg(feature = "cuda")]
            device_sums: Mutex::default(),
        });
        // A world of one has no communication to overlap with backward, so it skips the hooks
        // and with them the copy of every parameter that the identity op costs each forward;
        // `backward` then reduces from candle's gradients, with the same semantics (averaging,
        // unused-parameter check, no_sync accumulation).
        // CUDA parameters in a group with an NCCL communicator skip them too: their gradients
        // are reduced on the device after backward (`device.rs`), not copied to the host.
        #[cfg(feature = "cuda")]
        let on_device = crate::device::reduces_on_device(
            shared.comm.nccl().as_ref(),
            params.first().map(|(_, v)| v),
        );
        #[cfg(not(feature = "cuda"))]
        let on_device = false;
        if shared.comm.size() > 1 && !on_device {
            module.param_set().attach(shared.clone());
        }
        Ok(Ddp { module, shared })
    }

    /// The wrapped model as a plain model, like PyTorch's `ddp.module`: a forward through it
    /// starts no step, broadcasts no buffers and fires no gradient hooks, so one rank alone can
    /// evaluate it (`if rank == 0 { ddp.module().forward(&x) }`) without the others. Reads go
    /// around the hooks while the returned handle lives; a Ddp forward in that time still trains
    /// correctly, its gradients reduced after backward instead of overlapped with it.
    pub fn module(&self) -> Unhooked<'_, M> {
        self.module.param_set().begin_plain();
        Unhooked { module: &self.module }
    }

    /// The wrapped model with Ddp's hooks in place: the training path, like calling PyTorch's
    /// `ddp(x)`. Its methods read the parameters through Ddp's hooks (the first read of a
    /// forward starts a step; every rank must then take part in `backward`).
    pub fn hooked(&self) -> &M {
        &self.module
    }

    /// The parameters as `Var`s, in `named_parameters()` order (what an optimizer takes; the
    /// same as `ParamModule::params`, here without importing the trait).
    pub fn params(&self) -> Vec<Var> {
        self.module.params()
    }

    /// Unwraps the model (hooks detached), e.g. to save or evaluate it without Ddp.
    pub fn into_inner(self) -> M {
        self.module.param_set().detach();
        self.module
    }

    pub fn rank(&self) -> usize {
        self.shared.comm.rank()
    }

    /// Sets what every gradient bucket goes through instead of the all-reduce average
    /// (PyTorch's `register_comm_hook`), e.g. `comm_hooks::Fp16Compress`. A collective: every
    /// rank registers, at the same point, a hook of the same name; a rank that registered
    /// another is named in the error.
    pub fn register_comm_hook(&self, hook: Arc<dyn CommHook>) -> Result<()> {
        if !self.shared.checked_setup {
            // A rank joining a running job: the others registered the same hook at their setup.
            self.shared.reducer().set_comm_hook(hook);
            return Ok(());
        }
        let rank = self.rank();
        let names = self
            .shared
            .comm
            .all_gather_bytes(hook.name().as_bytes())
            .map_err(|e| DdpError::comm("all_gather of the comm hook names", rank, e))?;
        if let Some((other, theirs)) =
            names.iter().enumerate().find(|(_, n)| n.as_slice() != hook.name().as_bytes())
        {
            return Err(DdpError::CommHookMismatch {
                rank,
                ours: hook.name().to_string(),
                other,
                theirs: String::from_utf8_lossy(theirs).into_owned(),
            });
        }
        self.shared.reducer().set_comm_hook(hook);
        Ok(())
    }

    /// How many parameters' gradients the last backward handed to the all-reduce while it
    /// ran (`DdpOptions::reduce_during_backward`; a `ParamSet` model's hooks are not counted).
    pub fn grads_reduced_during_backward(&self) -> usize {
        self.shared.early_count.load(Ordering::SeqCst)
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
        self.backward_with_local(loss, &[])
    }

    /// [`Ddp::backward`], plus the gradients of `local`: parameters kept outside this `Ddp` on
    /// purpose, such as the class centres of a model-parallel head (`tandem-partial-fc`), each
    /// rank holding different ones. Their gradients come back exactly as autograd computed
    /// them, never all-reduced, so one optimizer can step the model and them together (as two
    /// parameter groups). A `local` parameter that is also one of this `Ddp`'s is refused.
    pub fn backward_with_local(&self, loss: &Tensor, local: &[Var]) -> Result<GradStore> {
        let vars = self.module.params();
        if let Some(i) =
            local.iter().position(|l| vars.iter().any(|v| v.as_tensor().id() == l.as_tensor().id()))
        {
            return Err(DdpError::InvalidOption {
                what: "backward_with_local",
                why: format!(
                    "local parameter {i} is also a parameter of this Ddp model, whose gradients \
                     are averaged over the ranks; keep rank-local parameters out of the model \
                     given to Ddp"
                ),
            });
        }
        let viewed = self.module.param_set().end_view();
        self.shared.early_count.store(0, Ordering::SeqCst);
        let early = match &self.shared.early {
            Some(ids) if !viewed && self.shared.comm.size() > 1 => {
                Some(EarlySink { shared: &self.shared, ids, started: Cell::new(false) })
            }
            _ => None,
        };
        let backward = match &early {
            Some(sink) => tandem_nn::backward_with_sink(loss, sink),
            None => tandem_nn::backward(loss),
        };
        let started = early.as_ref().is_some_and(|s| s.started.get());
        let mut candle_grads = match backward {
            Ok(g) => g,
            Err(e) => {
                let hooked =
                    self.shared.hook_error.lock().unwrap_or_else(|p| p.into_inner()).take();
                return Err(hooked.unwrap_or(DdpError::Candle(e)));
            }
        };
        let local_grads: Vec<(Tensor, Tensor)> = local
            .iter()
            .filter_map(|v| candle_grads.remove(v.as_tensor()).map(|g| (v.as_tensor().clone(), g)))
            .collect();
        let mut grads = self.reduce_grads(viewed, started, vars, candle_grads)?;
        for (param, g) in local_grads {
            grads.insert(&param, g);
        }
        Ok(grads)
    }

    /// The model's gradients from candle's: averaged over the world (see [`Ddp::backward`]).
    /// `started`: the step began during backward, some gradients already handed over
    /// (`reduce_during_backward`).
    fn reduce_grads(
        &self,
        viewed: bool,
        started: bool,
        vars: Vec<Var>,
        candle_grads: GradStore,
    ) -> Result<GradStore> {
        let mut candle_grads = candle_grads;
        if !viewed
            && !started
            && self.shared.comm.size() == 1
            && self.shared.sync.load(Ordering::SeqCst)
            && self.shared.reducer().has_default_hook()
        {
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
        #[cfg(feature = "cuda")]
        if !viewed && !started {
            if let Some(grads) = self.reduce_on_device(&vars, &candle_grads)? {
                return Ok(grads);
            }
        }
        if !viewed {
            // The forward did not read parameters through the view (no hooks fired): reduce
            // from candle's own gradients, those the fused layers handed over during backward
            // (`reduce_during_backward`) already in flight.
            if !started {
                self.shared.start_step()?;
            }
            let mut r = self.shared.reducer();
            for (i, v) in vars.iter().enumerate().rev() {
                if let Some(g) = candle_grads.get(v.as_tensor()) {
                    if started && r.is_ready(i) {
                        return Err(DdpError::InvalidOption {
                            what: "reduce_during_backward",
                            why: format!(
                                "parameter `{}` got a gradient from a fused layer during backward \
                                 and another after it: the model uses it more than once per \
                                 forward, so turn reduce_during_backward off for it",
                                self.module.named_parameters()[i].0
                            ),
                        });
                    }
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

    /// The NCCL path for CUDA gradients (see `device.rs`), for a step with the default hook or
    /// a built-in compressing one (fp16, bf16), not joining, every gradient on the device and,
    /// when it synchronises, every parameter with one unless `find_unused_parameters` (then the
    /// used map is summed over the group and the missing ones reduce as zeros, as on the host).
    /// A `no_sync` step adds its gradients to sums kept on the device
    /// ([`LocalSums`](crate::bucketed::LocalSums), the host reducer's arithmetic); the next
    /// synchronised step reduces its own plus the sums. Any other step (PowerSGD or your own
    /// hook, an unused parameter without `find_unused_parameters` — the host path names it —,
    /// `join`) takes the host path after the device's sums are handed to it. `None`: not taken.
    #[cfg(feature = "cuda")]
    fn reduce_on_device(&self, vars: &[Var], grads: &GradStore) -> Result<Option<GradStore>> {
        let sh = &self.shared;
        let Some(comm) = sh.comm.nccl() else { return Ok(None) };
        let sync = sh.sync.load(Ordering::SeqCst);
        let present = |v: &Var| grads.get(v.as_tensor());
        let finds_unused = sh.reducer().finds_unused();
        // Every gradient on the GPU implies the parameters are there too.
        let on_device = !vars.is_empty()
            && sh.join_state().is_none()
            && vars.iter().all(|v| present(v).is_none_or(|g| g.device().is_cuda()))
            && (!sync || finds_unused || vars.iter().all(|v| present(v).is_some()));
        let mut sums = sh.device_sums.lock().unwrap_or_else(|p| p.into_inner());
        let plan = {
            let r = sh.reducer();
            match r.device_wire() {
                Some(wire) if on_device && !r.has_accumulated() => Some((r.bucket_params(), wire)),
                _ => None,
            }
        };
        let Some((buckets, wire)) = plan else {
            if !sums.is_empty() {
                self.hand_sums_to_host(sums.take())?;
            }
            return Ok(None);
        };
        if !sync {
            return sums.add(vars, grads).map(Some);
        }
        if sh.broadcast_buffers && sh.comm.size() > 1 && !sh.buffers.is_empty() {
            broadcast_vars(sh.comm.as_ref(), &sh.buffers, 0)?;
        }
        crate::device::all_reduce_step(
            (&comm, sh.comm.as_ref()),
            (vars, grads),
            &mut sums,
            &buckets,
            (wire, finds_unused),
        )
        .map(Some)
    }

    /// The device's `no_sync` sums into the host reducer's accumulation (as one no_sync step),
    /// for a step the host path takes.
    #[cfg(feature = "cuda")]
    fn hand_sums_to_host(&self, sums: Vec<Option<Tensor>>) -> Result<()> {
        let mut r = self.shared.reducer();
        r.prepare_for_backward(false);
        for (i, sum) in sums.into_iter().enumerate() {
            if let Some(s) = sum {
                let host = s.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
                with_f32_slice(&host, |v| r.mark_ready(i, v))??;
            }
        }
        r.finalize()
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
    /// [`tandem_nn::NamedVars`] for ordering and buffers.
    pub fn from_varmap<G: Collectives + Clone + 'static>(
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
        self.module.param_set().end_plain();
    }
}

/// A Ddp is a model too, as PyTorch's DDP is an `nn.Module`: its parameters, buffers and state
/// dict are the wrapped model's, under the model's own names (never `module.`), so `&ddp` goes
/// wherever a model goes (`save_state`, `save_weights`, an optimizer's `params()`).
impl<M: ParamModule> ParamModule for Ddp<M> {
    fn param_set(&self) -> &tandem_nn::ParamSet {
        self.module.param_set()
    }
    fn named_buffers(&self) -> Vec<(String, Var)> {
        self.module.named_buffers()
    }
    /// Refused: DataParallel replicas of a Ddp make no sense; replicate the module instead.
    fn replicate(&self, _device: &candle_core::Device) -> tandem_nn::Result<Self> {
        Err(tandem_nn::NnError::InvalidOption {
            what: "replicate",
            why: "a Ddp-wrapped model is not replicated; replicate the model before wrapping it"
                .into(),
        })
    }
}

/// `ddp.forward(&x)`: PyTorch's `ddp(x)`, through [`Ddp::hooked`].
impl<M: ParamModule + candle_core::Module> candle_core::Module for Ddp<M> {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.module.forward(xs)
    }
}
