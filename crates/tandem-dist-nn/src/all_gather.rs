//! A differentiable all-gather (PyTorch's `torch.distributed.nn.functional.all_gather`, its
//! pieces concatenated): forward, every rank's tensor concatenated along dim 0 in rank order;
//! backward, this rank's slice of the incoming gradient summed over every rank (every rank's
//! output depends on every rank's input). The shapes must agree: every rank sends its shape with
//! its data, so a mismatch is an error on every rank at once, naming both ranks and shapes,
//! never a hang.
//!
//! arcface_torch multiplies that gradient by the world size ([`GatherGrad::SumTimesWorld`]): the
//! loss it feeds is a mean over the global batch, and DDP then averages the backbone's gradients
//! over ranks, so the factor makes the backbone see the gradient of the global mean.
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};

use tandem_comm::Collectives;

/// What the backward of [`all_gather`] returns for this rank's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GatherGrad {
    /// This rank's slice of the gradient, summed over ranks (PyTorch's semantics).
    #[default]
    Sum,
    /// The same times the world size (arcface_torch's `AllGather`).
    SumTimesWorld,
}

struct AllGather {
    comm: Arc<dyn Collectives>,
    what: Arc<str>,
    grad: GatherGrad,
}

impl CustomOp1 for AllGather {
    fn name(&self) -> &'static str {
        "all-gather"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = tandem_nn::contiguous_f32(storage, layout, &self.what, "all_gather")?;
        let dims = layout.shape().dims();
        // [number of dims][dims as u64][f32 data]
        let mut msg = Vec::with_capacity(8 + dims.len() * 8 + data.len() * 4);
        msg.extend_from_slice(&(dims.len() as u64).to_le_bytes());
        for d in dims {
            msg.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        msg.extend_from_slice(bytemuck::cast_slice(data));
        let me = self.comm.rank();
        let all = self.comm.all_gather_bytes(&msg).map_err(|e| {
            candle_core::Error::Msg(format!("{}: all_gather failed on rank {me}: {e}", self.what))
        })?;
        let mut out = Vec::with_capacity(data.len() * all.len());
        for (r, bytes) in all.iter().enumerate() {
            let (their_dims, data) = decode(bytes).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "{}: all_gather: rank {r} sent a malformed piece ({} bytes)",
                    self.what,
                    bytes.len()
                ))
            })?;
            if their_dims != dims {
                candle_core::bail!(
                    "{}: all_gather: rank {r} has shape {their_dims:?} but rank {me} has shape \
                     {dims:?}: every rank must gather the same shape",
                    self.what
                );
            }
            // Sent in native byte order (bytemuck); read back the same way, without assuming the
            // received buffer is aligned for f32.
            out.extend(data.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])));
        }
        let mut out_dims = dims.to_vec();
        match out_dims.first_mut() {
            Some(d0) => *d0 *= all.len(),
            None => candle_core::bail!("{}: all_gather needs at least one dimension", self.what),
        }
        Ok((CpuStorage::F32(out), Shape::from(out_dims)))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let mut g = grad.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
        self.comm.all_reduce_sum(&mut g).map_err(|e| {
            candle_core::Error::Msg(format!(
                "{}: all_gather backward: all_reduce failed on rank {}: {e}",
                self.what,
                self.comm.rank()
            ))
        })?;
        let n = arg.elem_count();
        let r = self.comm.rank();
        let mut mine = g[r * n..(r + 1) * n].to_vec();
        if self.grad == GatherGrad::SumTimesWorld {
            let w = self.comm.size() as f32;
            mine.iter_mut().for_each(|v| *v *= w);
        }
        Ok(Some(Tensor::from_vec(mine, arg.shape(), &Device::Cpu)?))
    }
}

fn decode(bytes: &[u8]) -> Option<(Vec<usize>, &[u8])> {
    let word = |i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?))
    };
    let rank = word(0)? as usize;
    if rank > 16 {
        return None;
    }
    let dims: Vec<usize> =
        (0..rank).map(|i| word(1 + i).map(|d| d as usize)).collect::<Option<_>>()?;
    let data = bytes.get(8 * (1 + rank)..)?;
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?.checked_mul(4)?;
    (data.len() == n).then_some((dims, data))
}

/// Every rank's `x` concatenated along dim 0 in rank order, differentiable (see the module
/// docs). A collective: every rank must call it, with the same shape, and in backward every rank
/// runs the matching all-reduce of the gradient. `what` names the caller in errors. Works on any
/// device: the bytes travel through host memory.
pub fn all_gather(
    x: &Tensor,
    comm: &Arc<dyn Collectives>,
    grad: GatherGrad,
    what: &str,
) -> candle_core::Result<Tensor> {
    if comm.size() == 1 {
        // A world of one gathers its own tensor, and its gradient is its own (times a world of
        // one): nothing to move, and on a GPU no trip through the host.
        return Ok(x.clone());
    }
    let op = AllGather { comm: comm.clone(), what: what.into(), grad };
    let device = x.device().clone();
    let dtype = x.dtype();
    let y = x
        .to_dtype(candle_core::DType::F32)?
        .to_device(&Device::Cpu)?
        .contiguous()?
        .apply_op1(op)?;
    y.to_device(&device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use tandem_comm::LocalGroup;

    fn run<R: Send + 'static>(
        n: usize,
        f: impl Fn(Arc<dyn Collectives>) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        LocalGroup::run(n, f)
    }

    #[test]
    fn forward_concatenates_in_rank_order_and_backward_sums_this_ranks_slice() {
        for mode in [GatherGrad::Sum, GatherGrad::SumTimesWorld] {
            let out = run(3, move |comm| {
                let r = comm.rank() as f32;
                let x = Var::new(&[[r, 10.0 + r]], &Device::Cpu).unwrap();
                let y = all_gather(x.as_tensor(), &comm, mode, "test").unwrap();
                // Rank k weighs row j by (k + 1) * (j + 1): d(sum_k L_k)/dx_r = 6 * (r + 1).
                let w = Tensor::new(&[[1f32, 1.0], [2.0, 2.0], [3.0, 3.0]], &Device::Cpu).unwrap();
                let loss = (y.mul(&w).unwrap() * (r as f64 + 1.0)).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                (y.to_vec2::<f32>().unwrap(), g.get(&x).unwrap().to_vec2::<f32>().unwrap())
            });
            let scale = if mode == GatherGrad::SumTimesWorld { 3.0 } else { 1.0 };
            for (r, (y, g)) in out.iter().enumerate() {
                assert_eq!(y, &[[0.0, 10.0], [1.0, 11.0], [2.0, 12.0]]);
                let expect = 6.0 * (r as f32 + 1.0) * scale;
                assert_eq!(g, &[[expect, expect]], "rank {r}, {mode:?}");
            }
        }
    }

    #[test]
    fn different_shapes_are_an_error_on_every_rank_naming_both() {
        let out = run(2, |comm| {
            let cols = 2 + comm.rank();
            let x = Tensor::zeros((1, cols), candle_core::DType::F32, &Device::Cpu).unwrap();
            all_gather(&x, &comm, GatherGrad::Sum, "embeddings").unwrap_err().to_string()
        });
        assert!(
            out[0].contains("rank 1 has shape [1, 3] but rank 0 has shape [1, 2]"),
            "{}",
            out[0]
        );
        assert!(
            out[1].contains("rank 0 has shape [1, 2] but rank 1 has shape [1, 3]"),
            "{}",
            out[1]
        );
        assert!(out[0].contains("embeddings"), "{}", out[0]);
    }
}
