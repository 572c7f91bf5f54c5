//! A differentiable all-reduce: `y = sum over ranks of x`, whose backward is again the sum over
//! ranks of the incoming gradients (every rank's output depends on every rank's input). It is
//! what turns a BatchNorm into a SyncBatchNorm in candle's autograd: the statistics are
//! reduced in forward and their gradients in backward, in the same order on every rank because
//! every rank builds the same graph.
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use tandem_comm::Collectives;

struct AllReduceSum {
    comm: Arc<dyn Collectives>,
    what: Arc<str>,
}

impl CustomOp1 for AllReduceSum {
    fn name(&self) -> &'static str {
        "all-reduce-sum"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let mut buf =
            tandem_nn::contiguous_f32(storage, layout, &self.what, "all-reduce")?.to_vec();
        self.comm.all_reduce_sum(&mut buf).map_err(|e| {
            candle_core::Error::Msg(format!(
                "{}: all_reduce(sum) failed on rank {}: {e}",
                self.what,
                self.comm.rank()
            ))
        })?;
        Ok((CpuStorage::F32(buf), layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let op = AllReduceSum { comm: self.comm.clone(), what: self.what.clone() };
        Ok(Some(grad.contiguous()?.apply_op1(op)?))
    }
}

/// The element-wise sum of `x` over all ranks of `comm`, differentiable (see the module docs).
/// A collective: every rank must call it with the same shape, and in backward every rank runs
/// the matching all-reduce of the gradient. `what` names the caller in errors. PyTorch's
/// `torch.distributed.nn.functional.all_reduce` with `op=SUM`; any device and float dtype.
pub fn all_reduce_sum(
    x: &Tensor,
    comm: &Arc<dyn Collectives>,
    what: &str,
) -> candle_core::Result<Tensor> {
    let op = AllReduceSum { comm: comm.clone(), what: what.into() };
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        return x.contiguous()?.apply_op1(op);
    }
    // Other devices and dtypes: the bytes travel through host memory as f32 (both moves are
    // differentiable, so the gradient comes back the same way).
    let (device, dtype) = (x.device().clone(), x.dtype());
    let y = x.to_dtype(candle_core::DType::F32)?.to_device(&candle_core::Device::Cpu)?;
    y.contiguous()?.apply_op1(op)?.to_device(&device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use tandem_comm::LocalGroup;

    #[test]
    fn forward_sums_over_ranks_and_backward_sums_the_gradients() {
        let hs: Vec<_> = LocalGroup::new(3)
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let r = g.rank() as f32;
                    let comm: Arc<dyn Collectives> = Arc::new(g);
                    let x = Var::new(&[r, 1.0], &Device::Cpu).unwrap();
                    let y = all_reduce_sum(x.as_tensor(), &comm, "test").unwrap();
                    // Rank r weighs the sum by (r + 1): d(sum_k L_k)/dx = sum_k (k + 1) = 6.
                    let loss = (y * (r as f64 + 1.0)).unwrap().sum_all().unwrap();
                    let grads = loss.backward().unwrap();
                    let y = all_reduce_sum(x.as_tensor(), &comm, "test").unwrap();
                    (y.to_vec1::<f32>().unwrap(), grads.get(&x).unwrap().to_vec1::<f32>().unwrap())
                })
            })
            .collect();
        for h in hs {
            let (y, g) = h.join().unwrap();
            assert_eq!(y, [3.0, 3.0]);
            assert_eq!(g, [6.0, 6.0]);
        }
    }

    #[test]
    fn half_precision_inputs_come_back_in_their_dtype_with_gradients() {
        let out = LocalGroup::run(2, |comm| {
            let x = Var::new(&[1.0f32 + comm.rank() as f32, 2.0], &Device::Cpu).unwrap();
            let half = x.as_tensor().to_dtype(candle_core::DType::BF16).unwrap();
            let y = all_reduce_sum(&half, &comm, "test").unwrap();
            let g =
                y.to_dtype(candle_core::DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
            (
                y.dtype(),
                y.to_dtype(candle_core::DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                g.get(&x).unwrap().to_vec1::<f32>().unwrap(),
            )
        });
        for (dtype, y, g) in out {
            assert_eq!(dtype, candle_core::DType::BF16);
            assert_eq!(y, [3.0, 4.0]);
            assert_eq!(g, [2.0, 2.0]);
        }
    }
}
