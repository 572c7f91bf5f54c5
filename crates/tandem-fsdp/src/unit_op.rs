//! The op a unit's output carries: its forward hands on the values the unit computed, its
//! backward gathers the unit again and differentiates it — on the graph the forward kept
//! (whose reads of the freed parameters see the refilled storage), or, under activation
//! checkpointing, on the unit recomputed then — FSDP2's pre-/post-backward hooks, which
//! candle's autograd does not have, as an op.
//!
//! The op's arguments are the unit's input and one of the unit's parameters: the parameter, a
//! variable, makes candle track the op even when the input is data (the first unit of a
//! model), and it is how candle orders the op's backward before the input's producers.
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::engine::{Engine, UnitGraph};

pub(crate) struct UnitOp {
    engine: Arc<Engine>,
    unit: usize,
    /// The unit's output, until the op's forward takes its values.
    output: Mutex<Option<Tensor>>,
    /// What the backward differentiates, until it takes it (a kept graph goes with its
    /// activations; a recomputation stays for another backward).
    graph: Mutex<Option<UnitGraph>>,
}

impl UnitOp {
    pub fn new(engine: Arc<Engine>, unit: usize, output: Tensor, graph: UnitGraph) -> UnitOp {
        UnitOp { engine, unit, output: Mutex::new(Some(output)), graph: Mutex::new(Some(graph)) }
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
        let graph = {
            let mut slot = self.graph.lock().unwrap_or_else(|p| p.into_inner());
            match slot.take() {
                Some(UnitGraph::Recompute(f)) => {
                    *slot = Some(UnitGraph::Recompute(Arc::clone(&f)));
                    UnitGraph::Recompute(f)
                }
                Some(kept) => kept,
                None => candle_core::bail!(
                    "fsdp-unit: a second backward through one forward (its graph was freed \
                     by the first; recompute with activation checkpointing to differentiate twice)"
                ),
            }
        };
        let gx = self
            .engine
            .unit_backward(self.unit, x, grad, graph)
            .map_err(candle_core::Error::wrap)?;
        Ok((gx, None))
    }
}
