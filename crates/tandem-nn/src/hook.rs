//! The per-parameter backward hook candle lacks: an identity `CustomOp1` wrapped around a
//! parameter. Candle runs a node's backward only after every consumer has added its share, so
//! when `bwd` runs the parameter's gradient is complete; we hand it to the [`ViewHooks`] sink (Ddp) and return no
//! gradient for the `Var` itself (Ddp builds the `GradStore` from the averaged buckets).
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// The data-parallel wrapper's side of the hooks (implemented by Ddp; a [`crate::ParamSet`]
/// calls it while a hooked view is attached).
pub trait ViewHooks: Send + Sync {
    /// The first parameter read of a forward pass.
    fn on_view_start(&self) -> candle_core::Result<()>;
    /// Parameter `idx`'s local gradient is complete.
    fn on_grad_ready(&self, idx: usize, grad: &Tensor) -> candle_core::Result<()>;
}

pub(crate) struct ReadyHook {
    idx: usize,
    name: String,
    sink: Arc<dyn ViewHooks>,
}

impl ReadyHook {
    pub(crate) fn new(idx: usize, name: &str, sink: Arc<dyn ViewHooks>) -> Self {
        ReadyHook { idx, name: name.to_string(), sink }
    }
}

impl CustomOp1 for ReadyHook {
    fn name(&self) -> &'static str {
        "ddp-grad-ready-hook"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("parameter `{}` is not contiguous", self.name)
        };
        let out = match storage {
            CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
            CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
            other => candle_core::bail!(
                "parameter `{}` has unsupported dtype {:?}",
                self.name,
                other.dtype()
            ),
        };
        Ok((out, layout.shape().clone()))
    }

    /// The same identity on a CUDA parameter: a device-side copy into fresh storage.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendDevice;
        let shape = layout.shape().clone();
        // SAFETY: every element is written by the strided copy below before anyone reads it.
        let mut out = unsafe { storage.device().alloc_uninit(&shape, storage.dtype())? };
        storage.copy_strided_src(&mut out, 0, layout)?;
        Ok((out, shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.sink.on_grad_ready(self.idx, grad)?;
        Ok(None)
    }
}
