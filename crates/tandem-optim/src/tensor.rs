//! Moving optimizer state between candle tensors and checkpoint value-tree tensors.
use candle_core::{DType, Tensor};
use tandem_ckpt::{ElemType, TensorData};

use crate::OptimError;

/// A candle tensor (any device) as a contiguous host checkpoint tensor of the same dtype.
pub(crate) fn to_ckpt(t: &Tensor, key: &str) -> Result<TensorData, OptimError> {
    let shape = t.dims().to_vec();
    let flat = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
    let out = match t.dtype() {
        DType::F32 => TensorData::from_f32(&shape, &flat.to_vec1::<f32>()?),
        DType::F64 => TensorData::from_f64(&shape, &flat.to_vec1::<f64>()?),
        DType::F16 => TensorData::from_bytes(
            ElemType::F16,
            &shape,
            bytemuck::cast_slice(&flat.to_vec1::<half::f16>()?).to_vec(),
        ),
        DType::BF16 => TensorData::from_bytes(
            ElemType::BF16,
            &shape,
            bytemuck::cast_slice(&flat.to_vec1::<half::bf16>()?).to_vec(),
        ),
        other => {
            return Err(OptimError::state(
                key,
                format!("cannot store optimizer state of dtype {other:?}"),
            ))
        }
    };
    Ok(out)
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
