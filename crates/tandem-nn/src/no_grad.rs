//! A forward that keeps no graph for a backward (PyTorch's `torch.no_grad()`), as far as candle
//! allows: candle records an op whenever it reads a `Var`, and a model's parameters are `Var`s,
//! so a forward for evaluation would keep every activation of the whole model alive until its
//! result is dropped. Under [`no_grad`] a model cuts its graph between its blocks
//! ([`cut_graph`]): each block's activations are freed once the next block has its input, so an
//! evaluation holds one block's at a time, and its result is detached.
use std::cell::Cell;

use candle_core::Tensor;

thread_local! {
    static NO_GRAD: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` as an evaluation that will not be differentiated (see the module docs), then
/// restores the enclosing setting, also when `f` panics.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    crate::scoped::with_cell(&NO_GRAD, true, f)
}

/// Whether this thread's forward may be differentiated (false inside [`no_grad`]).
pub fn grad_enabled() -> bool {
    !NO_GRAD.with(Cell::get)
}

/// `x` for the next block of a model: detached from the graph that made it inside
/// [`no_grad`], itself elsewhere.
pub fn cut_graph(x: Tensor) -> Tensor {
    match grad_enabled() {
        true => x,
        false => x.detach(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn no_grad_cuts_a_graph_only_inside_it_and_restores_the_setting() {
        let w = Var::new(&[2f32, 3.], &Device::Cpu).unwrap();
        let kept = cut_graph(w.as_tensor().sqr().unwrap()).sum_all().unwrap();
        let grads = kept.backward().unwrap();
        assert!(grads.get(w.as_tensor()).is_some(), "outside no_grad the graph stays");
        let cut = no_grad(|| {
            assert!(!grad_enabled());
            let inner = no_grad(|| cut_graph(w.as_tensor().sqr().unwrap()));
            assert!(!grad_enabled(), "a nested no_grad restores the outer one");
            inner
        });
        assert!(grad_enabled());
        assert_eq!(cut.to_vec1::<f32>().unwrap(), [4., 9.]);
        let grads = cut.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(w.as_tensor()).is_none(), "no path back to the parameter");
    }
}
