//! CUDA gradients reduced on the device by NCCL (feature `cuda`), for groups with a
//! communicator (`pg.nccl(device)`, made before wrapping the model): each bucket of the
//! reducer's plan becomes one device buffer (its gradients concatenated), averaged in place by
//! `ncclAllReduce(ncclAvg)` on the communicator's stream once candle's stream has produced it
//! — or, under the fp16/bf16 compression hooks, cast to the 16-bit type and divided by the
//! world size as the hooks do, summed by NCCL in that type, and cast back once the
//! collectives are done (the same bits as the host hooks: `bucketed.rs` tests the math).
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
use tandem_comm::{Collectives, ReduceOp, WireType};

use crate::bucketed::{reduce_step, FlatReducer, LocalSums};
use crate::comm_hooks::DeviceWire;
use crate::error::{DdpError, Result};

/// Whether parameters starting with `first` live on a CUDA device and `comm` can reduce there.
pub(crate) fn reduces_on_device(comm: Option<&NcclComm>, first: Option<&Var>) -> bool {
    comm.is_some() && first.is_some_and(|v| v.device().is_cuda())
}

/// A synchronised step's `grads` (f32 on the device) plus the `no_sync` sums averaged over the
/// group ([`reduce_step`]), one NCCL all-reduce per bucket of `buckets` (indices into `vars`),
/// as `wire` says: f32 averaged in place, or compressed to 16 bits, summed, and cast back (the
/// fp16/bf16 hooks). `group` carries find_unused_parameters' used map.
pub(crate) fn all_reduce_step(
    (comm, group): (&NcclComm, &dyn Collectives),
    step: (&[Var], &GradStore),
    sums: &mut LocalSums,
    buckets: &[Vec<usize>],
    (wire, finds_unused): (DeviceWire, bool),
) -> Result<GradStore> {
    let mut reducer = NcclReducer { comm, wire, last: None };
    reduce_step(&mut reducer, group, step, sums, buckets, finds_unused)
}

/// Each bucket all-reduced in place on the communicator's stream.
struct NcclReducer<'a> {
    comm: &'a NcclComm,
    wire: DeviceWire,
    /// The latest collective and the candle stream that must wait for it.
    last: Option<(NcclWork, CudaStream)>,
}

impl FlatReducer for NcclReducer<'_> {
    fn reduce(&mut self, flat: Tensor) -> Result<Tensor> {
        // The compressed bucket is made by candle's stream, which the collective waits for.
        let sent = self.wire.compress(&flat, self.comm.size())?;
        let (buf, stream) = device_buffer(&sent)?;
        let op = if self.wire == DeviceWire::F32 { ReduceOp::Avg } else { ReduceOp::Sum };
        // SAFETY: `sent` is a live contiguous device buffer of `buf.len` elements of its dtype
        // on the communicator's device (checked by device_buffer); it outlives the reduction
        // because the returned gradients (or their restored copy, made after `finish`) hold
        // it, and candle's stream waits for the reduction (`finish`) before any later kernel
        // can read or free it.
        let work = unsafe { self.comm.all_reduce(buf, op, Some(stream)) }.map_err(|e| {
            DdpError::comm("all_reduce of a gradient bucket (NCCL)", self.comm.rank(), e)
        })?;
        self.last = Some((work, stream));
        Ok(sent)
    }

    /// A compressed bucket back to f32, on candle's stream, after `finish` ordered it behind
    /// the collectives.
    fn restore(&mut self, reduced: Tensor) -> Result<Tensor> {
        self.wire.decompress(&reduced)
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

/// The device pointer of a contiguous f32, f16 or bf16 CUDA tensor, and the candle stream that
/// writes it.
fn device_buffer(t: &Tensor) -> Result<(DeviceBuffer, CudaStream)> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cuda) = &*storage else {
        return Err(DdpError::Device(format!("expected a CUDA tensor, got {:?}", t.device())));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(DdpError::Device("a gradient bucket is not contiguous".into()));
    };
    let stream = cuda.device().cuda_stream();
    let (ptr, dtype) = match t.dtype() {
        DType::F32 => (cuda.as_cuda_slice::<f32>()?.device_ptr(&stream).0, WireType::F32),
        DType::F16 => (cuda.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0, WireType::F16),
        DType::BF16 => (cuda.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0, WireType::BF16),
        other => {
            return Err(DdpError::Device(format!(
                "NCCL buckets are f32, f16 or bf16, got {other:?}"
            )))
        }
    };
    let buf = DeviceBuffer {
        ptr: ptr + (start * t.dtype().size_in_bytes()) as u64,
        len: end - start,
        dtype,
    };
    Ok((buf, CudaStream(stream.cu_stream() as *mut c_void)))
}
