//! The op a unit's output carries: its forward hands on the values the unit computed (without
//! keeping the unit's graph, so neither the full parameters nor the activations inside the
//! unit stay alive), its backward gathers the unit again, recomputes it and differentiates
//! it — FSDP2's pre-/post-backward hooks, which candle's autograd does not have, as an op.
//!
//! The op's arguments are the unit's input and one of the unit's parameters: the parameter, a
//! variable, makes candle track the op even when the input is data (the first unit of a
//! model), and it is how candle orders the op's backward before the input's producers.
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::engine::{Engine, UnitFn};

pub(crate) struct UnitOp {
    engine: Arc<Engine>,
    unit: usize,
    f: UnitFn,
    /// The unit's output, until the op's forward takes it.
    output: Mutex<Option<Tensor>>,
}

impl UnitOp {
    pub fn new(engine: Arc<Engine>, unit: usize, f: UnitFn, output: Tensor) -> UnitOp {
        UnitOp { engine, unit, f, output: Mutex::new(Some(output)) }
    }
}

fn values(t: &Tensor) -> candle_core::Result<CpuStorage> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => CpuStorage::F32(t.to_vec1()?),
        DType::F16 => CpuStorage::F16(t.to_vec1()?),
        DType::BF16 => CpuStorage::BF16(t.to_vec1()?),
        DType::F64 => CpuStorage::F64(t.to_vec1()?),
        other => candle_core::bail!("fsdp: a unit's output of dtype {other:?}"),
    })
}

impl CustomOp2 for UnitOp {
    fn name(&self) -> &'static str {
        "fsdp-unit"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _xl: &Layout,
        _anchor: &CpuStorage,
        _al: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.output.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(y) = y else { candle_core::bail!("fsdp-unit: the op ran twice") };
        Ok((values(&y)?, y.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let gx = self
            .engine
            .unit_backward(self.unit, x, grad, &self.f)
            .map_err(candle_core::Error::wrap)?;
        Ok((gx, None))
    }
}
