//! `Ddp::join` (PyTorch's `with Join([ddp]):`): ranks with uneven inputs keep answering the
//! others' collectives after their data runs out, and all end with the last ranks' model.

use candle_core::Var;
use tandem_nn::ParamModule;

use super::{broadcast_vars, Ddp, Shared};
use crate::error::{DdpError, Result};

/// `Ddp::join`'s settings (PyTorch's `DistributedDataParallel.join` arguments).
#[derive(Clone, Copy, Debug)]
pub struct JoinOptions {
    /// Divide the summed gradients by the world size, as when every rank takes part (PyTorch's
    /// default), so a step with fewer active ranks takes a proportionally smaller step. `false`
    /// divides by the ranks still active: the step then equals one process training on the
    /// union of their batches.
    pub divide_by_initial_world_size: bool,
}

impl Default for JoinOptions {
    fn default() -> Self {
        JoinOptions { divide_by_initial_world_size: true }
    }
}

/// What `Ddp::join` keeps while ranks may run out of data.
pub(crate) struct JoinState {
    pub(crate) opts: JoinOptions,
    /// The ranks active in the latest round that had any: the last joiners hold the final model.
    pub(crate) last_active: Vec<bool>,
}

/// One join round's answer: which ranks are still training, and whether any of them
/// synchronises gradients this step (false when all are inside `no_sync`).
pub(crate) struct Round {
    pub(crate) active: Vec<bool>,
    pub(crate) any_sync: bool,
}

impl Round {
    pub(crate) fn root(&self) -> Option<usize> {
        self.active.iter().position(|&a| a)
    }
}

impl Shared {
    /// Every rank says whether it is still training (and synchronising): one small all-reduce
    /// that each step of an active rank and each shadow step of a joined rank start with.
    pub(crate) fn join_round(&self, active: bool, sync: bool) -> Result<Round> {
        let n = self.comm.size();
        let mut flags = vec![0f32; n + 1];
        if active {
            flags[self.comm.rank()] = 1.0;
            flags[n] = if sync { 1.0 } else { 0.0 };
        }
        self.comm
            .all_reduce_sum(&mut flags)
            .map_err(|e| DdpError::comm("all_reduce of the join round", self.comm.rank(), e))?;
        let round = Round {
            active: flags[..n].iter().map(|&f| f > 0.5).collect(),
            any_sync: flags[n] > 0.5,
        };
        if round.root().is_some() {
            if let Some(j) = self.join_state().as_mut() {
                j.last_active = round.active.clone();
            }
        }
        Ok(round)
    }
}

impl<M: ParamModule> Ddp<M> {
    /// Training with uneven inputs, PyTorch's `with Join([ddp]):` — ranks may run `f` over
    /// different numbers of batches. While ranks are still training, a rank whose `f` has
    /// returned keeps answering their collectives: each of their steps starts with a small
    /// all-reduce saying who is still active, and the joined rank contributes zero gradients to
    /// the bucket all-reduces and receives the buffers, which come from the first active rank.
    /// When every rank is done, all ranks take the parameters and buffers of the last ones to
    /// finish (the joined ranks skipped optimizer steps), and `join` returns `f`'s result.
    ///
    /// Gradients are summed over the active ranks and divided as `opts` says (see
    /// [`JoinOptions`]). The optimizer state of a joined rank is left as it was. Collectives
    /// made inside `f` other than Ddp's own (a SyncBatchNorm, a metric all-reduce) cannot be
    /// answered by joined ranks: keep them outside `f`. If `f` fails on one rank, `join` returns
    /// that error there, and the other ranks' next collective times out naming it.
    pub fn join<T, E: From<DdpError>>(
        &self,
        opts: JoinOptions,
        f: impl FnOnce(&Self) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let world = self.shared.comm.size();
        *self.shared.join_state() = Some(JoinState { opts, last_active: vec![true; world] });
        struct Leave<'a>(&'a Shared);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                *self.0.join_state() = None;
                self.0.reducer().set_join_step(0, 1.0);
            }
        }
        let _leave = Leave(&self.shared);
        let out = f(self)?;
        self.shadow_until_all_joined()?;
        Ok(out)
    }

    /// A joined rank's loop (see [`Ddp::join`]), then the final parameter broadcast.
    fn shadow_until_all_joined(&self) -> Result<()> {
        let shared = &self.shared;
        loop {
            let round = shared.join_round(false, false)?;
            let Some(root) = round.root() else { break };
            if shared.broadcast_buffers && shared.comm.size() > 1 && !shared.buffers.is_empty() {
                broadcast_vars(shared.comm.as_ref(), &shared.buffers, root)?;
            }
            if round.any_sync {
                let mut r = shared.reducer();
                r.set_join_step(root, 1.0);
                r.shadow_step()?;
            }
        }
        let last = shared.join_state().as_ref().and_then(|j| j.last_active.iter().position(|&a| a));
        if shared.comm.size() > 1 {
            let everything: Vec<(String, Var)> = self
                .module
                .named_parameters()
                .into_iter()
                .chain(shared.buffers.iter().cloned())
                .collect();
            broadcast_vars(shared.comm.as_ref(), &everything, last.unwrap_or(0))?;
            self.module.param_set().refresh_view();
        }
        Ok(())
    }
}
