//! [`MixedPrecisionPolicy`]: the dtype the collectives move parameters and gradients in, and
//! the collectives in flight in that dtype, each giving back float32 when waited for.
use candle_core::DType;
use half::{bf16, f16};
use tandem_comm::{ProcessGroup, ReduceOp, Work};

use crate::error::{comm, FsdpError, Result};

/// FSDP2's `MixedPrecisionPolicy`, for what crosses the wire: the shards (the optimizer's
/// master weights) stay float32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MixedPrecisionPolicy {
    /// The dtype the all-gathers move parameters in (`param_dtype`: bf16 or f16): every rank's
    /// gathered weights are the shards rounded to it — FSDP2's unsharded parameters — held
    /// in float32 storage, so the model computes in the dtype its own layers (or autocast)
    /// choose. `None`: float32.
    pub param_dtype: Option<DType>,
    /// The dtype gradients are reduce-scattered (averaged) in (`reduce_dtype`); `None`:
    /// `param_dtype`'s, as FSDP2 defaults.
    pub reduce_dtype: Option<DType>,
}

/// A dtype the collectives move values in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wire {
    F32,
    Bf16,
    F16,
}

impl Wire {
    fn of(dtype: Option<DType>, what: &'static str) -> Result<Wire> {
        match dtype {
            None | Some(DType::F32) => Ok(Wire::F32),
            Some(DType::BF16) => Ok(Wire::Bf16),
            Some(DType::F16) => Ok(Wire::F16),
            Some(other) => Err(FsdpError::InvalidOption {
                what,
                why: format!("{other:?}: the collectives move f32, bf16 or f16"),
            }),
        }
    }

    /// The all-gathers' and the reduce-scatters' dtypes of `policy`.
    pub fn of_policy(policy: &MixedPrecisionPolicy) -> Result<(Wire, Wire)> {
        let gather = Wire::of(policy.param_dtype, "param_dtype")?;
        let reduce = Wire::of(policy.reduce_dtype.or(policy.param_dtype), "reduce_dtype")?;
        Ok((gather, reduce))
    }

    /// Bytes of one value on the wire.
    pub fn size(self) -> u64 {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 | Wire::F16 => 2,
        }
    }

    /// Starts an all-gather of `input` (float32, converted to this dtype first).
    pub fn all_gather(self, group: &ProcessGroup, input: Vec<f32>) -> InFlight {
        let n = input.len() * group.size();
        match self {
            Wire::F32 => InFlight::F32(group.all_gather_async(input, vec![0f32; n])),
            Wire::Bf16 => {
                InFlight::Bf16(group.all_gather_async(to_bf16(&input), vec![bf16::ZERO; n]))
            }
            Wire::F16 => InFlight::F16(group.all_gather_async(to_f16(&input), vec![f16::ZERO; n])),
        }
    }

    /// Starts a reduce-scatter (average) of `input` into `len` values per rank.
    pub fn reduce_scatter(self, group: &ProcessGroup, input: Vec<f32>, len: usize) -> InFlight {
        let avg = ReduceOp::Avg;
        match self {
            Wire::F32 => InFlight::F32(group.reduce_scatter_async(input, vec![0f32; len], avg)),
            Wire::Bf16 => InFlight::Bf16(group.reduce_scatter_async(
                to_bf16(&input),
                vec![bf16::ZERO; len],
                avg,
            )),
            Wire::F16 => {
                InFlight::F16(group.reduce_scatter_async(to_f16(&input), vec![f16::ZERO; len], avg))
            }
        }
    }
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn to_f16(v: &[f32]) -> Vec<f16> {
    v.iter().map(|&x| f16::from_f32(x)).collect()
}

/// A collective in flight in some wire dtype.
pub(crate) enum InFlight {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<bf16>>),
    F16(Work<Vec<f16>>),
}

impl InFlight {
    /// Its output in float32 (the float32 buffer itself, without a copy, when it moved f32).
    pub fn wait(self, what: &'static str) -> Result<Vec<f32>> {
        Ok(match self {
            InFlight::F32(w) => w.wait().map_err(comm(what))?,
            InFlight::Bf16(w) => w.wait().map_err(comm(what))?.iter().map(|x| x.to_f32()).collect(),
            InFlight::F16(w) => w.wait().map_err(comm(what))?.iter().map(|x| x.to_f32()).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reduce_dtype_defaults_to_the_param_dtype_and_other_dtypes_are_refused() {
        let policy = |p, r| MixedPrecisionPolicy { param_dtype: p, reduce_dtype: r };
        assert_eq!(Wire::of_policy(&policy(None, None)).unwrap(), (Wire::F32, Wire::F32));
        let bf16 = Some(DType::BF16);
        assert_eq!(Wire::of_policy(&policy(bf16, None)).unwrap(), (Wire::Bf16, Wire::Bf16));
        let f32 = Some(DType::F32);
        assert_eq!(Wire::of_policy(&policy(bf16, f32)).unwrap(), (Wire::Bf16, Wire::F32));
        let err = Wire::of_policy(&policy(Some(DType::F64), None)).unwrap_err().to_string();
        assert!(err.contains("param_dtype") && err.contains("F64"), "{err}");
    }
}
