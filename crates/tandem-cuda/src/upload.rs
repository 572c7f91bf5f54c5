//! Batches onto a GPU without holding it up: the host values are copied into a pinned
//! (page-locked) staging buffer, and from there to the device on a copy stream of the
//! uploader's own, so the transfer overlaps the kernels of the step in flight; the compute
//! stream waits for the copy only when it first reads the batch (cudarc's events). A few
//! staging buffers take turns, so the host can stage the next batches while earlier copies
//! run; a buffer is refilled only once its last copy has finished.
use std::sync::Arc;

use candle_core::cuda::cudarc::driver::{CudaStream, PinnedHostSlice};
use candle_core::cuda::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Shape, Tensor};

use crate::device::tensor;
use crate::Result;

/// Staging buffers in turn: how many batches the host may stage ahead of the copies.
const STAGING: usize = 3;

/// A device's upload path: a copy stream and pinned staging buffers.
pub struct Uploader {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    staging: Vec<Option<PinnedHostSlice<f32>>>,
    next: usize,
}

impl Uploader {
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let stream = device.cuda_stream().fork().w()?;
        Ok(Uploader {
            device: device.clone(),
            stream,
            staging: (0..STAGING).map(|_| None).collect(),
            next: 0,
        })
    }

    /// The device batches go to.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// `values` as an f32 tensor of `shape` on the device (outside the autograd graph).
    pub fn upload_f32(&mut self, values: &[f32], shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.elem_count() != values.len() {
            candle_core::bail!("upload: {} values for shape {shape:?}", values.len())
        }
        let slot = &mut self.staging[self.next];
        self.next = (self.next + 1) % STAGING;
        if slot.as_ref().is_none_or(|b| b.len() != values.len()) {
            // SAFETY: the buffer is filled whole below before any copy reads it.
            *slot = Some(
                unsafe { self.stream.context().alloc_pinned::<f32>(values.len().max(1)) }.w()?,
            );
        }
        let Some(buffer) = slot.as_mut() else { candle_core::bail!("upload: no staging buffer") };
        // Waits for this buffer's previous copy, then fills it.
        buffer.as_mut_slice().w()?[..values.len()].copy_from_slice(values);
        // SAFETY: the copy below writes every element.
        let mut dst = unsafe { self.stream.alloc::<f32>(values.len().max(1)) }.w()?;
        self.stream.memcpy_htod(buffer, &mut dst).w()?;
        let storage =
            CudaStorage { slice: CudaStorageSlice::F32(dst), device: self.device.clone() };
        Ok(tensor(storage, shape))
    }
}
