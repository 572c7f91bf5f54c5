//! `DataParallel`: one process, several candle devices (PyTorch's `nn.DataParallel`). Each
//! call splits the batch along dim 0 in `torch.chunk` sizes, refreshes the replicas from the
//! module on `device_ids[0]` (parameters and buffers), runs every replica's forward (and
//! backward) in its own thread, then gathers outputs on the output device and sums gradients
//! onto `device_ids[0]`.
//!
//! Training differs from PyTorch in one visible way: candle has no autograd across threads, so
//! the loss is computed per replica by `forward_backward`'s closure (a *mean* over its chunk)
//! and weighted by chunk size / batch size; the sum is the mean over the whole batch, and the
//! gradients equal those of one forward over the whole batch.
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use crate::error::{DdpError, Result};
use tandem_nn::ParamModule;

/// `torch.chunk(n, parts)` sizes along one dimension: chunks of `ceil(n / parts)`, the last one
/// smaller, possibly fewer than `parts` chunks (30 → [15, 15] for 2; 10 → [3, 3, 3, 1] for 4;
/// 5 → [2, 2, 1] for 4).
pub fn chunk_sizes(n: usize, parts: usize) -> Vec<usize> {
    if n == 0 || parts == 0 {
        return Vec::new();
    }
    let size = n.div_ceil(parts);
    let mut out = Vec::new();
    let mut left = n;
    while left > 0 {
        let s = size.min(left);
        out.push(s);
        left -= s;
    }
    out
}

pub struct DataParallel<M: ParamModule> {
    replicas: Vec<M>,
    devices: Vec<Device>,
    output_device: Device,
}

fn all_vars<M: ParamModule>(m: &M) -> Vec<(String, Var)> {
    m.named_parameters().into_iter().chain(m.named_buffers()).collect()
}

impl<M: ParamModule> DataParallel<M> {
    /// `module` must live on `device_ids[0]`; the output device is `device_ids[0]`.
    pub fn new(module: M, device_ids: Vec<Device>) -> Result<Self> {
        let Some(first) = device_ids.first().cloned() else {
            return Err(DdpError::DataParallel("device_ids is empty".into()));
        };
        if let Some((name, v)) =
            all_vars(&module).into_iter().find(|(_, v)| !v.device().same_device(&first))
        {
            return Err(DdpError::DataParallel(format!(
                "module must be on device_ids[0] ({first:?}) but `{name}` is on {:?}",
                v.device()
            )));
        }
        let mut replicas = vec![];
        for d in &device_ids[1..] {
            replicas.push(module.replicate(d)?);
        }
        replicas.insert(0, module);
        Ok(DataParallel { replicas, devices: device_ids, output_device: first })
    }

    /// Gather outputs on `device` instead of `device_ids[0]`.
    pub fn with_output_device(mut self, device: Device) -> Self {
        self.output_device = device;
        self
    }

    pub fn module(&self) -> &M {
        &self.replicas[0]
    }

    pub fn into_inner(mut self) -> M {
        self.replicas.swap_remove(0)
    }

    pub fn device_ids(&self) -> &[Device] {
        &self.devices
    }

    /// Copies parameters and buffers of replica 0 into the others.
    fn refresh_replicas(&self, used: usize) -> Result<()> {
        let src = all_vars(&self.replicas[0]);
        for r in &self.replicas[1..used] {
            for ((_, s), (_, d)) in src.iter().zip(all_vars(r)) {
                d.set(&s.as_tensor().to_device(d.device())?)?;
            }
        }
        Ok(())
    }

    /// Splits every input along dim 0 and moves the pieces to their replica's device.
    fn scatter(&self, inputs: &[&Tensor]) -> Result<Vec<Vec<Tensor>>> {
        let Some(first) = inputs.first() else {
            return Err(DdpError::DataParallel("no inputs".into()));
        };
        let n = first.dim(0)?;
        for (i, t) in inputs.iter().enumerate() {
            if t.dim(0)? != n {
                return Err(DdpError::DataParallel(format!(
                    "input #{i} has {} rows, input #0 has {n}",
                    t.dim(0)?
                )));
            }
        }
        let sizes = chunk_sizes(n, self.devices.len());
        let mut start = 0;
        let mut per_replica = Vec::with_capacity(sizes.len());
        for (r, &len) in sizes.iter().enumerate() {
            let pieces = inputs
                .iter()
                .map(|t| t.narrow(0, start, len)?.to_device(&self.devices[r]))
                .collect::<candle_core::Result<Vec<_>>>()?;
            per_replica.push(pieces);
            start += len;
        }
        Ok(per_replica)
    }

    fn parallel<T: Send>(
        &self,
        chunks: Vec<Vec<Tensor>>,
        f: impl Fn(usize, &M, &[Tensor]) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = chunks
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    let f = &f;
                    let m = &self.replicas[r];
                    s.spawn(move || f(r, m, c))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().map_err(|_| DdpError::DataParallel(format!("replica {r} panicked")))?
                })
                .collect()
        })
    }

    /// Forward only: outputs of `f(replica, chunk)` concatenated along dim 0 on the output device.
    pub fn forward<F>(&self, x: &Tensor, f: F) -> Result<Tensor>
    where
        F: Fn(&M, &Tensor) -> candle_core::Result<Tensor> + Sync,
    {
        let chunks = self.scatter(&[x])?;
        self.refresh_replicas(chunks.len())?;
        let outs = self.parallel(chunks, |_, m, c| {
            Ok(f(m, &c[0])?.detach().to_device(&self.output_device)?)
        })?;
        Ok(Tensor::cat(&outs, 0)?)
    }

    /// Forward and backward in parallel: `loss_fn(replica, chunks)` returns the mean loss over
    /// its chunk of `inputs` (split along dim 0). Returns the batch-mean loss on the output
    /// device and the gradients, summed onto `device_ids[0]`, keyed by `module()`'s `Var`s.
    pub fn forward_backward<F>(&self, inputs: &[&Tensor], loss_fn: F) -> Result<(Tensor, GradStore)>
    where
        F: Fn(&M, &[Tensor]) -> candle_core::Result<Tensor> + Sync,
    {
        let chunks = self.scatter(inputs)?;
        let total: usize =
            chunks.iter().map(|c| c[0].dim(0)).sum::<candle_core::Result<usize>>()?;
        self.refresh_replicas(chunks.len())?;
        let dev0 = &self.devices[0];
        let results = self.parallel(chunks, |_, m, c| {
            let weight = c[0].dim(0)? as f64 / total as f64;
            let loss = (loss_fn(m, c)? * weight)?;
            let grads = tandem_nn::backward(&loss)?;
            let gs = m
                .param_set()
                .named()
                .iter()
                .map(|(_, v)| grads.get(v.as_tensor()).map(|g| g.to_device(dev0)).transpose())
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok((loss.detach(), gs))
        })?;
        let mut loss = Tensor::zeros((), candle_core::DType::F32, &self.output_device)?;
        let mut sums: Vec<Option<Tensor>> = vec![None; self.replicas[0].params().len()];
        for (l, gs) in results {
            loss = (loss + l.to_device(&self.output_device)?.to_dtype(candle_core::DType::F32)?)?;
            for (slot, g) in sums.iter_mut().zip(gs) {
                if let Some(g) = g {
                    *slot = Some(match slot.take() {
                        None => g,
                        Some(acc) => (acc + g)?,
                    });
                }
            }
        }
        let mut store = GradStore::default();
        for ((_, v), g) in self.replicas[0].param_set().named().iter().zip(sums) {
            if let Some(g) = g {
                store.insert(v.as_tensor(), g);
            }
        }
        Ok((loss, store))
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_sizes;

    #[test]
    fn chunk_sizes_match_torch_chunk() {
        assert_eq!(chunk_sizes(30, 2), vec![15, 15]);
        assert_eq!(chunk_sizes(10, 2), vec![5, 5]);
        assert_eq!(chunk_sizes(10, 4), vec![3, 3, 3, 1]);
        assert_eq!(chunk_sizes(5, 4), vec![2, 2, 1]);
        assert_eq!(chunk_sizes(7, 3), vec![3, 3, 1]);
        assert_eq!(chunk_sizes(1, 3), vec![1]);
    }
}
