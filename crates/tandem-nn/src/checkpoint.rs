//! [`checkpoint`]: PyTorch's `torch.utils.checkpoint` — a function of one input whose
//! activations are not kept for backward but recomputed there, so a deep model trains in the
//! memory of its block inputs.
//!
//! candle's autograd has no hook for this, so it is an op: the forward runs `f` on a detached
//! input and keeps only the output (every intermediate is freed with the graph `f` built); the
//! op's backward runs `f` again on the saved input, differentiates `⟨f(x), ∂out⟩` with a nested
//! backward, returns the input's gradient to candle, and hands each parameter's gradient to
//! [`crate::backward`] the way tandem's fused ops do. That last part needs [`crate::backward`]
//! (which `Ddp::backward` and the trainer use): under a plain `loss.backward()` the op fails
//! naming it rather than drop the parameters' gradients. `f` must compute the same values
//! twice: draw any randomness (dropout masks) before and capture it.
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, Var};

use crate::backward::{in_backward_scope, take_param_grad};

/// The function a checkpoint recomputes.
pub type CheckpointFn = Arc<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// `f(x)`, recomputed in backward instead of kept (see the module docs). `params`: the
/// variables `f` reads, whose gradients the backward hands on.
pub fn checkpoint(x: &Tensor, f: CheckpointFn, params: Vec<Tensor>) -> candle_core::Result<Tensor> {
    let y = f(&x.detach())?.detach();
    x.apply_op2(&y, Checkpoint { f, params })
}

struct Checkpoint {
    f: CheckpointFn,
    params: Vec<Tensor>,
}

impl CustomOp2 for Checkpoint {
    fn name(&self) -> &'static str {
        "tandem-checkpoint"
    }

    /// The output is `f(x)`, already computed: a copy of it.
    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((contiguous_copy(s2, l2)?, l2.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s1: &candle_core::CudaStorage,
        _l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let mut out = s2.device().zeros_impl(l2.shape(), s2.dtype())?;
        s2.copy_strided_src(&mut out, 0, l2)?;
        Ok((out, l2.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _y: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        if !in_backward_scope() {
            candle_core::bail!(
                "checkpoint: the backward must be tandem's (tandem_nn::backward, Ddp::backward): \
                 under a plain loss.backward() the recomputed block's parameter gradients would \
                 be lost"
            )
        }
        let input = Var::from_tensor(&x.detach())?;
        let y = (self.f)(input.as_tensor())?;
        let inner = (y * grad.detach())?.sum_all()?;
        let mut grads = inner.backward()?;
        for p in &self.params {
            if let Some(g) = grads.remove(p) {
                if take_param_grad(p, Some(g))?.is_some() {
                    candle_core::bail!("checkpoint: parameter {:?} is not a variable", p.id())
                }
            }
        }
        Ok((grads.remove(input.as_tensor()), None))
    }
}

/// A contiguous copy of the storage `s` viewed through `l`.
fn contiguous_copy(s: &CpuStorage, l: &Layout) -> candle_core::Result<CpuStorage> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    let mut out = s.device().zeros_impl(l.shape(), s.dtype())?;
    s.copy_strided_src(&mut out, 0, l)?;
    Ok(out)
}
