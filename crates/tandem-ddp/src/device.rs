//! CUDA gradients reduced on the device by NCCL (feature `cuda`), for groups with a
//! communicator (`pg.nccl(device)`, made before wrapping the model): each bucket of the
//! reducer's plan becomes one device buffer (its gradients concatenated), averaged in place by
//! `ncclAllReduce(ncclAvg)` on the communicator's stream once candle's stream has produced it.
//! All buckets are queued before candle's stream is made to wait for the last one, so the host
//! never blocks and the optimizer step that follows is ordered after the reduction. The
//! returned gradients are views into the buckets, as on the host path.
//!
//! Without a communicator (tcp, shm, mpi groups) CUDA gradients take the host path: the reducer
//! copies each one to host memory, reduces it there, and the averaged bucket is copied back.
use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::cuda::cudarc::driver::DevicePtr;
use candle_core::{DType, Tensor, Var};
use tandem_comm::nccl::{CudaStream, DeviceBuffer, NcclComm, NcclWork};
use tandem_comm::ReduceOp;

use crate::bucketed::{reduce_buckets, FlatReducer};
use crate::error::{DdpError, Result};

/// Whether parameters starting with `first` live on a CUDA device and `comm` can reduce there.
pub(crate) fn reduces_on_device(comm: Option<&NcclComm>, first: Option<&Var>) -> bool {
    comm.is_some() && first.is_some_and(|v| v.device().is_cuda())
}

/// Averages `grads` (one per var, every one present, f32 on the device) over the group, one
/// NCCL all-reduce per bucket of `buckets` (indices into `vars`).
pub(crate) fn all_reduce_buckets(
    comm: &NcclComm,
    vars: &[Var],
    grads: &GradStore,
    buckets: &[Vec<usize>],
) -> Result<GradStore> {
    reduce_buckets(&mut NcclReducer { comm, last: None }, vars, grads, buckets)
}

/// Each bucket all-reduced in place on the communicator's stream.
struct NcclReducer<'a> {
    comm: &'a NcclComm,
    /// The latest collective and the candle stream that must wait for it.
    last: Option<(NcclWork, CudaStream)>,
}

impl FlatReducer for NcclReducer<'_> {
    fn reduce(&mut self, flat: Tensor) -> Result<Tensor> {
        let (buf, stream) = device_buffer(&flat)?;
        // SAFETY: `flat` is a live f32 device buffer of `buf.len` elements on the communicator's
        // device (checked by device_buffer); it outlives the reduction because the returned
        // gradients hold it, and candle's stream waits for the reduction (`finish`) before any
        // later kernel can read or free it.
        let work =
            unsafe { self.comm.all_reduce(buf, ReduceOp::Avg, Some(stream)) }.map_err(|e| {
                DdpError::comm("all_reduce of a gradient bucket (NCCL)", self.comm.rank(), e)
            })?;
        self.last = Some((work, stream));
        Ok(flat)
    }

    /// The communicator's stream runs its collectives in order: waiting for the last one waits
    /// for all, on the device; the host does not block.
    fn finish(&mut self) -> Result<()> {
        if let Some((work, stream)) = self.last.take() {
            work.wait_stream(stream).map_err(|e| {
                DdpError::comm("wait for the gradient buckets (NCCL)", self.comm.rank(), e)
            })?;
        }
        Ok(())
    }
}

/// The device pointer of a contiguous f32 CUDA tensor, and the candle stream that writes it.
fn device_buffer(t: &Tensor) -> Result<(DeviceBuffer, CudaStream)> {
    if t.dtype() != DType::F32 {
        return Err(DdpError::Device(format!("NCCL buckets are f32, got {:?}", t.dtype())));
    }
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cuda) = &*storage else {
        return Err(DdpError::Device(format!("expected a CUDA tensor, got {:?}", t.device())));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(DdpError::Device("a gradient bucket is not contiguous".into()));
    };
    let stream = cuda.device().cuda_stream();
    let slice = cuda.as_cuda_slice::<f32>()?;
    let (ptr, _recorded) = slice.device_ptr(&stream);
    let buf = DeviceBuffer {
        ptr: ptr + (start * std::mem::size_of::<f32>()) as u64,
        len: end - start,
        dtype: tandem_comm::WireType::F32,
    };
    Ok((buf, CudaStream(stream.cu_stream() as *mut c_void)))
}
