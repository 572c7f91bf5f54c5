//! Moving optimizer state between candle tensors and checkpoint value-tree tensors.
use candle_core::{DType, Tensor};
use tandem_ckpt::TensorData;

use crate::OptimError;

/// A new tensor holding `t`'s values and nothing more, on `t`'s device. candle's
/// `Tensor::copy` clones the whole storage under a view (`CpuStorage::try_clone` ignores the
/// layout): a momentum buffer copied from a gradient that Ddp hands out as a view into its
/// averaged bucket would hold the whole bucket, once per parameter. Negating twice is exact
/// (signs of zero and NaNs kept) and allocates only the view's elements.
pub(crate) fn fresh_copy(t: &Tensor) -> candle_core::Result<Tensor> {
    t.neg()?.neg()
}

/// A candle tensor (any device) as a contiguous host checkpoint tensor of the same dtype:
/// copied once, or lent inside `tandem_nn::convert::lend` (a synchronous save's momentum
/// stages no copy).
pub(crate) fn to_ckpt(t: &Tensor, key: &str) -> Result<TensorData, OptimError> {
    if !matches!(t.dtype(), DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(OptimError::state(
            key,
            format!("cannot store optimizer state of dtype {:?}", t.dtype()),
        ));
    }
    tandem_nn::convert::to_ckpt(t).map_err(|e| OptimError::state(key, e.to_string()))
}

/// A checkpoint tensor as a candle tensor shaped, typed and placed like `like` (torch casts
/// loaded state to the parameter's dtype and device the same way). Shapes must match exactly.
pub(crate) fn from_ckpt(t: &TensorData, like: &Tensor, key: &str) -> Result<Tensor, OptimError> {
    if !t.dtype.is_float() {
        return Err(OptimError::state(
            key,
            format!("expected a floating-point tensor, found {}", t.dtype),
        ));
    }
    if t.shape != like.dims() {
        return Err(OptimError::state(
            key,
            format!("shape {:?} does not match the parameter's shape {:?}", t.shape, like.dims()),
        ));
    }
    // f64 holds every f32/f16/bf16 value exactly, so this round trip loses nothing.
    let host = Tensor::from_vec(t.to_f64_vec(), like.dims(), &candle_core::Device::Cpu)?;
    Ok(host.to_dtype(like.dtype())?.to_device(like.device())?)
}

#[cfg(test)]
mod fresh_copy_tests {
    use candle_core::{Device, Tensor};

    /// The elements behind `t`'s storage (not only those its layout shows).
    fn storage_len(t: &Tensor) -> usize {
        let (storage, _) = t.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(s) => s.as_slice::<f32>().unwrap().len(),
            _ => unreachable!("a CPU test"),
        }
    }

    #[test]
    fn a_copy_of_a_view_holds_the_view_only_with_the_same_bits() {
        let bucket = Tensor::new(&[1.5f32, -0.0, 3.0, f32::NAN, -2.0, 7.0], &Device::Cpu).unwrap();
        let view = bucket.narrow(0, 1, 4).unwrap().reshape((2, 2)).unwrap();
        // What candle's own copy does: the whole bucket comes along.
        assert_eq!(storage_len(&view.copy().unwrap()), 6);
        let fresh = super::fresh_copy(&view).unwrap();
        assert_eq!(storage_len(&fresh), 4);
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(&fresh), bits(&view));
    }
}
