//! [`backward`]: candle's `loss.backward()`, with the parameter gradients of tandem's fused ops
//! handed to the gradient store as they are computed.
//!
//! candle's backward adds every gradient an op returns into an accumulator of the argument's
//! shape, which it first creates as zeros (`zeros_like`, then `add`): for a parameter used once
//! that is a memset and a pass over three buffers to copy the gradient, where PyTorch keeps the
//! first gradient as it is. On the bench MLP (two 3–4 MB weights) it was ~10% of the training
//! step. The accumulators are candle's own (`GradStore`'s `or_insert`, crate-private), so the
//! fix is on tandem's side: inside [`backward`], the fused linear and convolution ops give a
//! weight's or bias's gradient to [`take_param_grad`] instead of returning it to candle, and
//! [`backward`] puts it in the store afterwards (adding it to what candle accumulated when the
//! same variable was also used by other ops). Outside [`backward`] — a plain `loss.backward()` —
//! the ops return their gradients to candle as before.
//!
//! The values are candle's: a gradient used once is the same tensor candle would have added to
//! zeros (`0 + g == g`, bar the sign of a zero), and a parameter used by several fused ops is
//! summed in the order candle's backward reaches its uses, so the bits are candle's too. Only a
//! parameter used by fused ops and by candle's own ops (a weight both in a fused linear and in
//! a `matmul`) is summed in another order: the fused ops' part is added to candle's at the end,
//! equal up to rounding — the same bits run after run.
use std::cell::RefCell;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

thread_local! {
    /// The gradients taken by the fused ops during this thread's [`backward`], by parameter;
    /// `None` outside one.
    static TAKEN: RefCell<Option<Vec<(Tensor, Tensor)>>> = const { RefCell::new(None) };
    /// The sink of [`backward_with_sink`] during its backward.
    static SINK: RefCell<Option<&'static dyn GradSink>> = const { RefCell::new(None) };
}

/// Where [`backward_with_sink`] hands parameter gradients the moment a fused op computes them
/// (data parallelism reduces them while backward goes on). The sink may decline a gradient;
/// it is then kept for the store as usual.
pub trait GradSink {
    /// `param`'s gradient from a fused op: `Ok(true)` takes it (it will not be in the store),
    /// `Ok(false)` leaves it to the store. A parameter used by several ops gets a call per
    /// use: a sink that takes gradients must know its model reads each parameter once.
    fn take(&self, param: &Tensor, grad: &Tensor) -> candle_core::Result<bool>;
}

/// [`backward`], with every parameter gradient a fused op computes (convolution, linear,
/// BatchNorm, PReLU weights and biases) offered to `sink` as soon as it is computed.
pub fn backward_with_sink(loss: &Tensor, sink: &dyn GradSink) -> candle_core::Result<GradStore> {
    // SAFETY: (the lifetime extension) the reference is removed from SINK before this
    // function returns (the guard below runs however the backward ends), and only code running
    // inside it, on this thread, reads SINK.
    let sink: &'static dyn GradSink = unsafe { std::mem::transmute::<&dyn GradSink, _>(sink) };
    struct Unset;
    impl Drop for Unset {
        fn drop(&mut self) {
            SINK.with(|s| s.borrow_mut().take());
        }
    }
    SINK.with(|s| *s.borrow_mut() = Some(sink));
    let _unset = Unset;
    backward(loss)
}

/// `loss.backward()`, the gradient store holding the same gradients, without the zeroed
/// accumulators candle makes for the weights and biases of tandem's fused linear and
/// convolution ops (see the module comment). Use it wherever `loss.backward()` is called;
/// [`Ddp::backward`](../tandem_ddp/struct.Ddp.html) and the trainer do.
pub fn backward(loss: &Tensor) -> candle_core::Result<GradStore> {
    let nested = TAKEN.with(|t| t.borrow().is_some());
    if nested {
        // A backward inside an op's backward (none of tandem's does): plain candle.
        return loss.backward();
    }
    /// Ends the scope however the backward ends, so a failed one leaves nothing behind.
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            TAKEN.with(|t| t.borrow_mut().take());
        }
    }
    TAKEN.with(|t| *t.borrow_mut() = Some(Vec::new()));
    let scope = Scope;
    let mut grads = loss.backward()?;
    let taken = TAKEN.with(|t| t.borrow_mut().take()).unwrap_or_default();
    drop(scope);
    for (param, g) in taken {
        let g = match grads.remove(&param) {
            Some(accumulated) => (accumulated + g)?,
            None => g,
        };
        grads.insert(&param, g);
    }
    Ok(grads)
}

/// Whether this thread is inside [`backward`] (where ops may hand parameter gradients to
/// [`take_param_grad`]).
fn in_backward_scope() -> bool {
    TAKEN.with(|t| t.borrow().is_some())
}

/// Fails, naming `op`, unless inside [`backward`]: an op whose parameters are not candle
/// operands hands their gradients to the store, which a plain `loss.backward()` does not have
/// (`lost`: what would be lost there).
pub(crate) fn require_backward_scope(op: &str, lost: &str) -> candle_core::Result<()> {
    if !in_backward_scope() {
        candle_core::bail!(
            "{op}: the backward must be tandem's (tandem_nn::backward, Ddp::backward): under a \
             plain loss.backward() {lost} would be lost"
        )
    }
    Ok(())
}

/// Called by a fused op's backward with the gradient of its parameter operand `param`: inside
/// [`backward`], and when `param` is a variable (a model's weight, not a view of one), keeps
/// `grad` for the store and returns `None` (the op hands candle no gradient for it); otherwise
/// returns `grad` for the op to return.
pub(crate) fn take_param_grad(
    param: &Tensor,
    grad: Option<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    let Some(grad) = grad else { return Ok(None) };
    if !param.is_variable() {
        return Ok(Some(grad));
    }
    let in_scope = TAKEN.with(|t| t.borrow().is_some());
    if in_scope {
        if let Some(sink) = SINK.with(|s| *s.borrow()) {
            if sink.take(param, &grad)? {
                return Ok(None);
            }
        }
    }
    TAKEN.with(|t| {
        let mut taken = t.borrow_mut();
        let Some(taken) = taken.as_mut() else { return Ok(Some(grad)) };
        match taken.iter_mut().find(|(p, _)| p.id() == param.id()) {
            // Used again: summed in the order candle reaches the uses, as its accumulator is.
            Some((_, sum)) => *sum = (&*sum + grad)?,
            None => taken.push((param.clone(), grad)),
        }
        Ok(None)
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::backward;
    use crate::functional::fused_linear;
    use crate::kernels::conv2d::{conv2d, ConvParams};

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// A weight used twice by fused linears, a bias, a conv weight and a weight used once: each
    /// gradient has candle's own backward's bits; a weight used by a fused linear and by a
    /// candle op too: the same sum up to rounding (added in another order). The store holds the
    /// same variables.
    #[test]
    fn gradients_equal_candles_backward() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (6, 5), &dev).unwrap();
        let img = Tensor::randn(0f32, 1.0, (2, 3, 6, 6), &dev).unwrap();
        let shared = Var::randn(0f32, 0.5, (5, 5), &dev).unwrap();
        let mixed = Var::randn(0f32, 0.5, (5, 5), &dev).unwrap();
        let bias = Var::randn(0f32, 0.5, 5, &dev).unwrap();
        let once = Var::randn(0f32, 0.5, (4, 5), &dev).unwrap();
        let kernel = Var::randn(0f32, 0.5, (4, 3, 3, 3), &dev).unwrap();
        let loss = || {
            let h = fused_linear(&x, shared.as_tensor(), Some(bias.as_tensor())).unwrap();
            let h = fused_linear(&h.tanh().unwrap(), shared.as_tensor(), None).unwrap();
            let h = fused_linear(&h, mixed.as_tensor(), None).unwrap();
            let h = (h.matmul(mixed.as_tensor()).unwrap() * 0.5).unwrap();
            let out = fused_linear(&h, once.as_tensor(), None).unwrap();
            let p = ConvParams { stride: 1, padding: 1, dilation: 1 };
            let c = conv2d(&img, kernel.as_tensor(), p).unwrap();
            (out.sqr().unwrap().sum_all().unwrap() + c.sqr().unwrap().sum_all().unwrap()).unwrap()
        };
        let ours = backward(&loss()).unwrap();
        let candles = loss().backward().unwrap();
        for (name, v, exact) in [
            ("shared", &shared, true),
            ("bias", &bias, true),
            ("once", &once, true),
            ("kernel", &kernel, true),
            ("mixed", &mixed, false),
        ] {
            let (a, b) = (ours.get(v.as_tensor()), candles.get(v.as_tensor()));
            let (a, b) = (a.unwrap_or_else(|| panic!("{name}: no gradient")), b.unwrap());
            let (a, b) = (values(a), values(b));
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                // `==`: only the sign of a zero may differ (candle's `0 + g`).
                let ok = if exact { p == q } else { (p - q).abs() <= 1e-5 * q.abs().max(1.0) };
                assert!(ok, "{name}[{i}]: {p} vs candle's {q}");
            }
        }
        assert_eq!(ours.get_ids().count(), candles.get_ids().count());
    }

    /// An op whose backward fails.
    struct FailingBackward;
    impl candle_core::CustomOp1 for FailingBackward {
        fn name(&self) -> &'static str {
            "failing-backward"
        }
        fn cpu_fwd(
            &self,
            s: &candle_core::CpuStorage,
            l: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Ok((s.clone(), l.shape().clone()))
        }
        fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> candle_core::Result<Option<Tensor>> {
            candle_core::bail!("this backward fails")
        }
    }

    /// Outside `backward` the ops return their gradients to candle; a failed `backward` says
    /// why and leaves no scope open (the next plain backward is candle's again).
    #[test]
    fn plain_backward_is_untouched_and_a_failure_closes_the_scope() {
        let dev = Device::Cpu;
        let w = Var::randn(0f32, 0.5, (3, 4), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (2, 4), &dev).unwrap();
        let y = fused_linear(&x, w.as_tensor(), None).unwrap();
        assert!(y.sum_all().unwrap().backward().unwrap().get(w.as_tensor()).is_some());
        let failing = y.apply_op1(FailingBackward).unwrap().sum_all().unwrap();
        let err = backward(&failing).unwrap_err().to_string();
        assert!(err.contains("this backward fails"), "{err}");
        assert!(super::TAKEN.with(|t| t.borrow().is_none()));
        assert!(y.sum_all().unwrap().backward().unwrap().get(w.as_tensor()).is_some());
    }
}
