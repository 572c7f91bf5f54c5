//! Mixed precision on a GPU, as `torch.autocast("cuda", dtype)`: inside [`autocast`], the
//! convolutions and linear layers of tandem-nn cast their input and weights to the 16-bit
//! type and compute on tensor cores; BatchNorm and PReLU take the 16-bit activations and keep
//! their parameters and statistics in f32 (as PyTorch's `cudnn_batch_norm`); what the caller
//! computes outside the scope (losses, softmax, the optimizer) stays f32. Gradients flow back
//! through the casts to the f32 master weights.
//!
//! The scope is per thread and applies to CUDA tensors only: on the CPU, where tandem's
//! kernels compute in f32, layers ignore it (the recipes' CPU path rounds values instead).
use std::cell::Cell;

use candle_core::{DType, Device, Tensor};

thread_local! {
    static DTYPE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Runs `f` with autocast to `dtype` (f16 or bf16; `None`: f32, as outside any scope), then
/// restores the enclosing scope's setting, also when `f` panics.
pub fn autocast<R>(dtype: Option<DType>, f: impl FnOnce() -> R) -> R {
    let dtype = dtype.filter(|d| matches!(d, DType::F16 | DType::BF16));
    crate::scoped::with_cell(&DTYPE, dtype, f)
}

/// The type a layer computes in for an input on `device`: the scope's 16-bit type on a GPU,
/// else `None` (as given).
pub fn compute_dtype(device: &Device) -> Option<DType> {
    if device.is_cpu() {
        return None;
    }
    DTYPE.with(Cell::get)
}

/// The enclosing [`autocast`] scope's 16-bit type, whatever the device (what a recomputation
/// must run under to repeat a forward).
pub(crate) fn scope() -> Option<DType> {
    DTYPE.with(Cell::get)
}

/// `t` in the scope's compute type for `device`, or as it is.
pub(crate) fn cast(t: &Tensor, device: &Device) -> candle_core::Result<Tensor> {
    match compute_dtype(device) {
        Some(dt) if t.dtype() != dt => t.to_dtype(dt),
        _ => Ok(t.clone()),
    }
}

/// Mixed precision for a model whose CPU kernels compute in f32 (tandem-nn's convolutions): the input and the
/// logits pass through the 16-bit type (rounded as autocast's f16/bf16 tensors are), and the
/// GradScaler scales the loss as with any f16 run. `None`: f32 throughout.
#[derive(Clone, Copy, Debug, Default)]
pub struct Autocast(pub Option<DType>);

impl Autocast {
    /// Autocast to `dtype` (f32: none).
    pub fn to(dtype: DType) -> Self {
        Autocast((dtype != DType::F32).then_some(dtype))
    }

    /// `x` rounded to the 16-bit type and back (differentiable; the identity without autocast).
    pub fn round(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.0 {
            Some(dt) => x.to_dtype(dt)?.to_dtype(DType::F32),
            None => Ok(x.clone()),
        }
    }

    /// `f(x)` under this precision, as f32. On a GPU, real mixed precision: `f` runs inside
    /// [`autocast`] (convolutions and matmuls in the 16-bit type on tensor cores).
    /// On the CPU, whose kernels compute in f32, values are rounded instead: the output, and
    /// the input too when `round_input`.
    pub fn apply(
        &self,
        x: &Tensor,
        round_input: bool,
        f: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match self.0 {
            Some(dt) if !x.device().is_cpu() => autocast(Some(dt), || f(x))?.to_dtype(DType::F32),
            _ if round_input => self.round(&f(&self.round(x)?)?),
            _ => self.round(&f(x)?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_nests_applies_to_gpus_only_and_is_restored() {
        let gpu = Device::Cpu; // a CPU device stands in for "not a GPU"
        assert_eq!(compute_dtype(&gpu), None);
        autocast(Some(DType::F16), || {
            assert_eq!(DTYPE.with(Cell::get), Some(DType::F16));
            assert_eq!(compute_dtype(&Device::Cpu), None, "CPU layers keep f32");
            autocast(None, || assert_eq!(DTYPE.with(Cell::get), None));
            assert_eq!(DTYPE.with(Cell::get), Some(DType::F16), "restored after the inner scope");
            let r = std::panic::catch_unwind(|| autocast(Some(DType::BF16), || panic!("inner")));
            assert!(r.is_err());
            assert_eq!(DTYPE.with(Cell::get), Some(DType::F16), "restored after a panic");
        });
        assert_eq!(DTYPE.with(Cell::get), None);
        autocast(Some(DType::F32), || {
            assert_eq!(DTYPE.with(Cell::get), None, "f32 is no autocast")
        });
    }
}
