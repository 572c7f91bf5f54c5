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
//! twice: draw any randomness (dropout masks) before and capture it. The recomputation runs
//! under the [`crate::autocast`] scope of the forward (as torch's checkpoint restores its
//! autocast state), not under whatever scope the backward happens to run in.
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, Var};

use crate::backward::{require_backward_scope, take_param_grad};

/// The function a checkpoint recomputes.
pub type CheckpointFn = Arc<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// `f(x)`, recomputed in backward instead of kept (see the module docs). `params`: the
/// variables `f` reads, whose gradients the backward hands on.
pub fn checkpoint(x: &Tensor, f: CheckpointFn, params: Vec<Tensor>) -> candle_core::Result<Tensor> {
    let y = f(&x.detach())?.detach();
    x.apply_op2(&y, Checkpoint { f, params, autocast: crate::autocast::scope() })
}

struct Checkpoint {
    f: CheckpointFn,
    params: Vec<Tensor>,
    /// The forward's autocast scope, re-entered for the recomputation.
    autocast: Option<candle_core::DType>,
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
        require_backward_scope("checkpoint", "the recomputed block's parameter gradients")?;
        let input = Var::from_tensor(&x.detach())?;
        let y = crate::recompute(|| {
            crate::autocast::autocast(self.autocast, || (self.f)(input.as_tensor()))
        })?;
        let inner = (&y * grad.to_dtype(y.dtype())?.detach())?.sum_all()?;
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
pub(crate) fn contiguous_copy(s: &CpuStorage, l: &Layout) -> candle_core::Result<CpuStorage> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    let mut out = s.device().zeros_impl(l.shape(), s.dtype())?;
    s.copy_strided_src(&mut out, 0, l)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use candle_core::{DType, Device};

    use super::*;

    /// The recomputation in backward sees the forward's autocast scope, though the backward
    /// runs outside it; and the gradients are those of the plain function.
    #[test]
    fn the_recomputation_runs_under_the_forwards_autocast_scope() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let w = Var::from_vec(vec![2f32, -1.0, 0.5], 3, &Device::Cpu).unwrap();
        let f: CheckpointFn = {
            let (seen, w) = (Arc::clone(&seen), w.as_tensor().clone());
            Arc::new(move |x: &Tensor| {
                seen.lock().unwrap().push(crate::autocast::scope());
                x.mul(&w)?.sqr()
            })
        };
        let x = Var::from_vec(vec![1f32, 2.0, 3.0], 3, &Device::Cpu).unwrap();
        let y = crate::autocast::autocast(Some(DType::F16), || {
            checkpoint(x.as_tensor(), Arc::clone(&f), vec![w.as_tensor().clone()])
        })
        .unwrap();
        let grads = crate::backward(&y.sum_all().unwrap()).unwrap();
        assert_eq!(*seen.lock().unwrap(), [Some(DType::F16), Some(DType::F16)]);
        // d/dx Σ (x·w)² = 2·x·w², d/dw = 2·x²·w.
        let gx: Vec<f32> = grads.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        let gw: Vec<f32> = grads.get(w.as_tensor()).unwrap().to_vec1().unwrap();
        assert_eq!(gx, [8.0, 4.0, 1.5]);
        assert_eq!(gw, [4.0, -8.0, 9.0]);
    }

    /// A BatchNorm inside a checkpointed function counts the batch once: the recomputation in
    /// backward leaves its running statistics alone.
    #[test]
    fn a_recomputed_batch_norm_updates_its_statistics_once() {
        use candle_nn::{VarBuilder, VarMap};
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let bn = Arc::new(crate::fast_batch_norm2d(2, vb).unwrap());
        let vars = varmap.data().lock().unwrap().clone();
        let params = vec![vars["weight"].as_tensor().clone(), vars["bias"].as_tensor().clone()];
        let f: CheckpointFn = {
            let bn = Arc::clone(&bn);
            Arc::new(move |x: &Tensor| candle_core::ModuleT::forward_t(&*bn, x, true))
        };
        let x = Var::from_vec(vec![1f32, 2.0, 3.0, 5.0], (2, 2, 1, 1), &Device::Cpu).unwrap();
        let y = checkpoint(x.as_tensor(), f, params).unwrap();
        crate::backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
        assert_eq!(bn.num_batches_tracked().to_scalar::<i64>().unwrap(), 1);
    }
}
