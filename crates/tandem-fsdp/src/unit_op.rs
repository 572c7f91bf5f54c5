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

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, Var};

use crate::engine::{Engine, UnitFn, UnitGraph};

pub(crate) struct UnitOp {
    engine: Arc<Engine>,
    unit: usize,
    /// The unit's output, until the op's forward takes its values.
    output: Mutex<Option<Tensor>>,
    /// Its graph or how to recompute it, until the op's backward takes it.
    graph: Mutex<Option<Graph>>,
}

enum Graph {
    Kept(Var),
    Recompute(UnitFn),
}

fn taken<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

impl UnitOp {
    /// A unit whose graph, from `input` to `output`, is kept for backward.
    pub fn keeping(engine: Arc<Engine>, unit: usize, input: Var, output: Tensor) -> UnitOp {
        let graph = Mutex::new(Some(Graph::Kept(input)));
        UnitOp { engine, unit, output: Mutex::new(Some(output)), graph }
    }

    /// A unit whose `output` has no graph: `f` is run again in backward.
    pub fn recomputing(engine: Arc<Engine>, unit: usize, f: UnitFn, output: Tensor) -> UnitOp {
        let graph = Mutex::new(Some(Graph::Recompute(f)));
        UnitOp { engine, unit, output: Mutex::new(Some(output)), graph }
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
        let mut slot = self.output.lock().unwrap_or_else(|p| p.into_inner());
        let Some(y) = slot.as_ref() else { candle_core::bail!("fsdp-unit: the op ran twice") };
        let values = (values(y)?, y.shape().clone());
        // A kept graph's output stays for the backward; a recomputed one's is not needed.
        if !matches!(*self.graph.lock().unwrap_or_else(|p| p.into_inner()), Some(Graph::Kept(_))) {
            *slot = None;
        }
        Ok(values)
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
                // A kept graph is differentiated once: its activations go with it.
                Some(Graph::Kept(input)) => match taken(&self.output) {
                    Some(output) => UnitGraph::Kept { input, output },
                    None => candle_core::bail!("fsdp-unit: the backward ran before the forward"),
                },
                Some(Graph::Recompute(f)) => {
                    *slot = Some(Graph::Recompute(Arc::clone(&f)));
                    UnitGraph::Recompute { input: x.clone(), f }
                }
                None => candle_core::bail!(
                    "fsdp-unit: a second backward through one forward (its graph was freed \
                     by the first; recompute with activation checkpointing to differentiate twice)"
                ),
            }
        };
        let gx =
            self.engine.unit_backward(self.unit, grad, graph).map_err(candle_core::Error::wrap)?;
        Ok((gx, None))
    }
}
