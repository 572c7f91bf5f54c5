//! `ParamSet`: a model's named parameters (candle `Var`s, in PyTorch `named_parameters()`
//! order) and the per-step *view* through which the model reads them.
//!
//! Models read parameters with `params.get(i)` instead of holding tensors directly. Outside Ddp
//! that is the `Var`'s tensor. Once Ddp has attached itself, the first `get` of a step hands out
//! an identity-wrapped copy whose backward reports "this gradient is complete" to Ddp's reducer
//! (candle has no per-parameter autograd hooks); the copy is cached so a parameter used twice in
//! one forward is still one node, and the cache is dropped by `Ddp::backward`, so the next
//! forward sees the optimizer's updated weights. Changing weights between a forward and the next
//! backward by other means (`Var::set`) needs `refresh_view()` (`load_state_dict` does it).
//!
//! Cost: the identity op copies each parameter once per step (a `CustomOp1` must return owned
//! storage); `tandem bench ddp` measures what that and the bucket copies cost.
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Tensor, Var};

use crate::hook::{ReadyHook, ViewHooks};

pub struct ParamSet {
    named: Vec<(String, Var)>,
    view: Mutex<View>,
}

#[derive(Default)]
struct View {
    hooks: Option<Arc<dyn ViewHooks>>,
    cache: Vec<Option<Tensor>>,
    started: bool,
    /// Live `Ddp::module()` handles: while any exists, reads bypass the hooks (plain model).
    plain_readers: usize,
}

impl ParamSet {
    pub fn new(named: Vec<(String, Var)>) -> Self {
        let n = named.len();
        ParamSet {
            named,
            view: Mutex::new(View {
                hooks: None,
                cache: vec![None; n],
                started: false,
                plain_readers: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, View> {
        // A panic while holding this lock cannot leave the view inconsistent (plain assignments).
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Parameter `idx` as the forward pass should use it (see the module docs).
    pub fn get(&self, idx: usize) -> candle_core::Result<Tensor> {
        let (name, var) = self.named.get(idx).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "parameter index {idx} out of range ({} parameters)",
                self.named.len()
            ))
        })?;
        let hooks = {
            let mut v = self.lock();
            let hooks = match v.hooks.clone() {
                Some(hooks) if v.plain_readers == 0 => hooks,
                _ => return Ok(var.as_tensor().clone()),
            };
            if let Some(t) = &v.cache[idx] {
                return Ok(t.clone());
            }
            let first = !std::mem::replace(&mut v.started, true);
            if !first {
                let t = var.as_tensor().apply_op1(ReadyHook::new(idx, name, hooks))?;
                v.cache[idx] = Some(t.clone());
                return Ok(t);
            }
            hooks
        };
        // First read of a step: let Ddp start the step (outside our lock: it may run collectives).
        hooks.on_view_start()?;
        let t = var.as_tensor().apply_op1(ReadyHook::new(idx, name, hooks))?;
        self.lock().cache[idx] = Some(t.clone());
        Ok(t)
    }

    pub fn named(&self) -> &[(String, Var)] {
        &self.named
    }

    pub fn vars(&self) -> Vec<Var> {
        self.named.iter().map(|(_, v)| v.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.named.len()
    }

    pub fn is_empty(&self) -> bool {
        self.named.is_empty()
    }

    #[doc(hidden)] // the data-parallel wrapper's hook protocol
    pub fn attach(&self, hooks: Arc<dyn ViewHooks>) {
        let mut v = self.lock();
        v.hooks = Some(hooks);
        v.cache.iter_mut().for_each(|c| *c = None);
        v.started = false;
    }

    #[doc(hidden)] // the data-parallel wrapper's hook protocol
    pub fn detach(&self) {
        let mut v = self.lock();
        v.hooks = None;
        v.cache.iter_mut().for_each(|c| *c = None);
        v.started = false;
    }

    /// Drops the current step's hooked copies so the next read sees the `Var`s' current values.
    /// Ddp's backward does this; call it yourself after changing parameter values between a
    /// forward and the next backward other than through an optimizer step after backward
    /// (`ParamModule::load_state_dict` calls it).
    pub fn refresh_view(&self) {
        self.lock().cache.iter_mut().for_each(|c| *c = None);
    }

    /// Reads bypass the hooks until the matching `end_plain` (nested handles count).
    #[doc(hidden)] // the data-parallel wrapper's hook protocol
    pub fn begin_plain(&self) {
        self.lock().plain_readers += 1;
    }

    #[doc(hidden)] // the data-parallel wrapper's hook protocol
    pub fn end_plain(&self) {
        let mut v = self.lock();
        v.plain_readers = v.plain_readers.saturating_sub(1);
    }

    /// Ends the current step's view; returns whether one had been started.
    #[doc(hidden)] // the data-parallel wrapper's hook protocol
    pub fn end_view(&self) -> bool {
        let mut v = self.lock();
        v.cache.iter_mut().for_each(|c| *c = None);
        std::mem::replace(&mut v.started, false)
    }
}
