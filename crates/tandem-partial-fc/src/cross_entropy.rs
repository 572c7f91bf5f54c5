//! The distributed softmax cross-entropy of PartialFC: each rank holds the logits of the global
//! batch against its own classes (`[N, K_r]`); the softmax runs over all ranks' classes without
//! gathering them. Forward: the global row maximum (gathered), the global sum of exponentials
//! and the target probability (all-reduced; a row's target lives on one rank), then
//! `-mean(log(max(p, 1e-30)))` over the global batch. Backward, on each rank's own logits:
//! `(softmax - one_hot) / N` times the incoming gradient — no collective needed.
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};
use tandem_comm::Collectives;

struct DistCrossEntropy {
    comm: Arc<dyn Collectives>,
    labels: Arc<[i64]>,
    /// The softmax of the forward pass, for the backward.
    softmax: Mutex<Vec<f32>>,
}

fn comm_err(rank: usize, what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("dist_cross_entropy: rank {rank}: {what} failed: {e}"))
}

impl CustomOp1 for DistCrossEntropy {
    fn name(&self) -> &'static str {
        "dist-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = layout.shape().dims2()?;
        let (Some((start, end)), CpuStorage::F32(v)) = (layout.contiguous_offsets(), storage)
        else {
            candle_core::bail!(
                "dist_cross_entropy needs contiguous f32 logits, got {:?}",
                storage.dtype()
            )
        };
        let x = &v[start..end];
        let rank = self.comm.rank();
        // Global row maxima: only for numerical stability, any common value would do.
        let local_max: Vec<f32> = (0..n)
            .map(|i| x[i * k..(i + 1) * k].iter().copied().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        let all = self
            .comm
            .all_gather_bytes(bytemuck::cast_slice(&local_max))
            .map_err(|e| comm_err(rank, "all_gather of row maxima", e))?;
        let mut max = local_max.clone();
        for (r, bytes) in all.iter().enumerate() {
            if bytes.len() != n * 4 {
                candle_core::bail!(
                    "dist_cross_entropy: rank {r} has {} rows but rank {rank} has {n}",
                    bytes.len() / 4
                );
            }
            // A received buffer need not be aligned for f32: read it bytewise.
            let theirs =
                bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
            for (m, t) in max.iter_mut().zip(theirs) {
                *m = m.max(t);
            }
        }
        let mut p: Vec<f32> = x.iter().enumerate().map(|(j, v)| (v - max[j / k]).exp()).collect();
        let mut sums: Vec<f32> = (0..n).map(|i| p[i * k..(i + 1) * k].iter().sum()).collect();
        self.comm.all_reduce_sum(&mut sums).map_err(|e| comm_err(rank, "all_reduce of sums", e))?;
        for (j, v) in p.iter_mut().enumerate() {
            *v /= sums[j / k];
        }
        let mut target: Vec<f32> = (0..n)
            .map(|i| match usize::try_from(self.labels[i]) {
                Ok(c) if c < k => p[i * k + c],
                _ => 0.0,
            })
            .collect();
        self.comm
            .all_reduce_sum(&mut target)
            .map_err(|e| comm_err(rank, "all_reduce of target probabilities", e))?;
        let loss = -target.iter().map(|t| t.max(1e-30).ln()).sum::<f32>() / n as f32;
        *self.softmax.lock().unwrap_or_else(|e| e.into_inner()) = p;
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (n, k) = arg.dims2()?;
        let g = grad.to_dtype(candle_core::DType::F32)?.to_vec0::<f32>()? / n as f32;
        let mut d = self.softmax.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if d.len() != n * k {
            candle_core::bail!("dist_cross_entropy: backward without a forward");
        }
        for (i, &label) in self.labels.iter().enumerate() {
            if let Ok(c) = usize::try_from(label) {
                if c < k {
                    d[i * k + c] -= 1.0;
                }
            }
        }
        d.iter_mut().for_each(|v| *v *= g);
        Ok(Some(Tensor::from_vec(d, (n, k), &Device::Cpu)?))
    }
}

/// The softmax cross-entropy of `logits` `[N, K_r]` (this rank's classes) over the classes of
/// every rank of `comm` (see the module docs); `labels[i]` is row `i`'s target column on this
/// rank or -1 when its class lives on another rank. A collective: every rank calls it with the
/// same `N`. Returns the scalar loss, the same on every rank.
pub fn dist_cross_entropy(
    logits: &Tensor,
    labels: &[i64],
    comm: &Arc<dyn Collectives>,
) -> candle_core::Result<Tensor> {
    let (n, _) = logits.dims2()?;
    if labels.len() != n {
        candle_core::bail!("dist_cross_entropy: {} labels for {n} rows", labels.len());
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return crate::cuda::dist_cross_entropy(logits, labels, comm);
    }
    let op = DistCrossEntropy {
        comm: comm.clone(),
        labels: labels.into(),
        softmax: Mutex::new(Vec::new()),
    };
    let device = logits.device().clone();
    let loss = logits
        .to_dtype(candle_core::DType::F32)?
        .to_device(&Device::Cpu)?
        .contiguous()?
        .apply_op1(op)?;
    loss.to_device(&device)
}
