//! The head's margin and split cross-entropy on a GPU (`cuda` builds): tandem-cuda's kernels
//! behind candle ops, so the logits never leave the device. Only a world of several ranks
//! reads each row's maximum and sums back to combine them over the process group (a few
//! hundred floats per step); a world of one reads nothing but the loss, when the caller asks.
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor};
use tandem_comm::Collectives;
use tandem_cuda::rows::{self, Margin, RowReduce};

use crate::margin::CombinedMarginLoss;

/// `labels` as an i64 tensor on `device`.
fn device_labels(labels: &[i64], device: &candle_core::Device) -> candle_core::Result<Tensor> {
    Tensor::from_slice(labels, labels.len(), device)
}

fn kernel_margin(m: &CombinedMarginLoss) -> Margin {
    Margin {
        s: m.s as f32,
        m2: m.m2 as f32,
        m3: m.m3 as f32,
        threshold: m.interclass_filtering_threshold as f32,
        kind: if m.is_arcface() { 0 } else { 1 },
    }
}

/// The margin as a candle op: forward and backward on the device.
struct MarginOp {
    labels: Tensor,
    margin: Margin,
}

impl CustomOp1 for MarginOp {
    fn name(&self) -> &'static str {
        "tandem-margin-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("tandem-margin-cuda runs on CUDA tensors only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((rows::margin((s, l), &self.labels, self.margin)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        rows::margin_backward(x, &self.labels, &g.to_dtype(DType::F32)?, self.margin).map(Some)
    }
}

/// `s·margin(logits)` of f32 CUDA logits (already clamped), `labels` this rank's columns.
pub(crate) fn margin(
    m: &CombinedMarginLoss,
    logits: &Tensor,
    labels: &[i64],
) -> candle_core::Result<Tensor> {
    let labels = device_labels(labels, logits.device())?;
    let op = MarginOp { labels, margin: kernel_margin(m) };
    logits.to_dtype(DType::F32)?.contiguous()?.apply_op1(op)
}

/// Combines the rows' maxima and sums over the ranks through host collectives.
struct CommRows<'a> {
    comm: &'a Arc<dyn Collectives>,
}

impl CommRows<'_> {
    fn err(&self, what: &str, e: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "dist_cross_entropy: rank {}: {what} failed: {e}",
            self.comm.rank()
        ))
    }
}

impl RowReduce for CommRows<'_> {
    fn max(&mut self, v: Tensor) -> candle_core::Result<Tensor> {
        let local: Vec<f32> = v.to_vec1()?;
        let all = self
            .comm
            .all_gather_bytes(bytemuck::cast_slice(&local))
            .map_err(|e| self.err("all_gather of row maxima", e))?;
        let mut max = local.clone();
        for (r, bytes) in all.iter().enumerate() {
            if bytes.len() != local.len() * 4 {
                candle_core::bail!(
                    "dist_cross_entropy: rank {r} has {} rows but rank {} has {}",
                    bytes.len() / 4,
                    self.comm.rank(),
                    local.len()
                );
            }
            let theirs =
                bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
            max.iter_mut().zip(theirs).for_each(|(m, t)| *m = m.max(t));
        }
        Tensor::from_vec(max, local.len(), v.device())
    }

    fn sum(&mut self, v: Tensor) -> candle_core::Result<Tensor> {
        let mut sums: Vec<f32> = v.to_vec1()?;
        self.comm.all_reduce_sum(&mut sums).map_err(|e| self.err("all_reduce of row sums", e))?;
        Tensor::from_vec(sums, v.dims1()?, v.device())
    }
}

/// The split cross-entropy's graph node: the forward is computed before the op is applied
/// (its collectives cannot run inside candle's op), the op hands candle the loss and keeps the
/// softmax for backward.
struct CrossEntropyOp {
    loss: Tensor,
    softmax: Tensor,
    labels: Tensor,
}

impl CustomOp1 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "tandem-dist-cross-entropy-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("tandem-dist-cross-entropy-cuda runs on CUDA tensors only")
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (storage, layout) = self.loss.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, Shape::from(()))),
            _ => candle_core::bail!("dist_cross_entropy: the loss left the GPU"),
        }
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = g.reshape(1)?;
        rows::cross_entropy_backward(&self.softmax, &self.labels, &g).map(Some)
    }
}

/// The mean softmax cross-entropy of CUDA logits whose classes are split over `comm`'s ranks.
pub(crate) fn dist_cross_entropy(
    logits: &Tensor,
    labels: &[i64],
    comm: &Arc<dyn Collectives>,
) -> candle_core::Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let labels = device_labels(labels, logits.device())?;
    let out = if comm.size() == 1 {
        rows::cross_entropy(&logits.detach(), &labels, &mut rows::OneRank)?
    } else {
        rows::cross_entropy(&logits.detach(), &labels, &mut CommRows { comm })?
    };
    logits.apply_op1(CrossEntropyOp { loss: out.loss, softmax: out.softmax, labels })
}
