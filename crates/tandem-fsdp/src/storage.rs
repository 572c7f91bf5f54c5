//! A model's parameter `Var` as FSDP2's *unsharded parameter*: the model reads the `Var` it was
//! built with, so FSDP fills that `Var`'s storage with the all-gathered values for a unit's
//! forward and backward and frees it afterwards, in place (candle's `InplaceOp1` hands over
//! the storage itself; `Var::set` would copy and keep the allocation).
//!
//! A freed parameter keeps its shape but holds an empty storage of `F8E8M0`, a dtype no candle
//! op computes with: reading it outside its unit's forward is an error from the op that reads
//! it ("unsupported dtype f8e8m0" or a dtype mismatch), never a read of memory that is not
//! there. [`FREED_HINT`] explains such an error.
use std::sync::Mutex;

use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};

/// Appended to an error that mentions the freed parameters' dtype.
pub(crate) const FREED_HINT: &str = "(a parameter reads as f8e8m0 when its unit is resharded: \
     run the model inside Fsdp::forward, each unit through its FullyShard wrapper, or inside \
     Fsdp::summon_full_params)";

/// Whether `e` is the error of an op that read a freed parameter.
pub(crate) fn read_freed(e: &candle_core::Error) -> bool {
    e.to_string().to_ascii_lowercase().contains("f8e8m0")
}

fn contiguous_from_zero(layout: &Layout, op: &str) -> candle_core::Result<()> {
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        candle_core::bail!("{op}: the parameter is a strided view, not a variable")
    }
    Ok(())
}

/// Replaces a parameter's storage with `values` (its full, row-major contents).
struct Fill(Mutex<Option<Vec<f32>>>);

impl InplaceOp1 for Fill {
    fn name(&self) -> &'static str {
        "fsdp-fill"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        contiguous_from_zero(layout, self.name())?;
        let values = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(values) = values else { candle_core::bail!("fsdp-fill: applied twice") };
        if values.len() != layout.shape().elem_count() {
            candle_core::bail!(
                "fsdp-fill: {} values for a parameter of shape {:?}",
                values.len(),
                layout.shape()
            )
        }
        *storage = CpuStorage::F32(values);
        Ok(())
    }
}

/// Frees a parameter's storage (see the module docs).
struct Free;

impl InplaceOp1 for Free {
    fn name(&self) -> &'static str {
        "fsdp-free"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        contiguous_from_zero(layout, self.name())?;
        *storage = CpuStorage::F8E8M0(Vec::new());
        Ok(())
    }
}

pub(crate) fn fill(var: &Tensor, values: Vec<f32>) -> candle_core::Result<()> {
    var.inplace_op1(&Fill(Mutex::new(Some(values))))
}

pub(crate) fn free(var: &Tensor) -> candle_core::Result<()> {
    var.inplace_op1(&Free)
}
