//! SyncBatchNorm over a process group: a [`tandem_nn::StatsReducer`] that sums through
//! [`all_reduce_sum`](crate::all_reduce_sum), and PyTorch's `convert_sync_batchnorm`.
use std::sync::Arc;

use candle_core::Tensor;
use tandem_comm::Collectives;
use tandem_nn::{HasBatchNorm, StatsReducer};

/// Batch statistics summed over `comm`'s ranks (differentiably).
pub struct CommStats(pub Arc<dyn Collectives>);

impl StatsReducer for CommStats {
    fn all_reduce_sum(&self, x: &Tensor, what: &str) -> candle_core::Result<Tensor> {
        crate::all_reduce_sum(x, &self.0, what)
    }
}

/// PyTorch's `nn.SyncBatchNorm.convert_sync_batchnorm(model, group)`: every BatchNorm layer of
/// `model` reduces its statistics over `comm`. Those are collectives on the main thread: give
/// the layers a group of their own (`group.new_group(&all_ranks)`) when the model is wrapped by
/// a Ddp that overlaps its bucket all-reduces with backward (a `ParamSet` model), so the two
/// streams of collectives cannot interleave differently on different ranks; a VarMap model's
/// buckets are reduced after backward, so the Ddp group itself is safe there. Returns how many
/// layers were switched.
pub fn convert_sync_batchnorm(
    model: &(impl HasBatchNorm + ?Sized),
    comm: Arc<dyn Collectives>,
) -> usize {
    let layers = model.batch_norms();
    let stats: Arc<dyn StatsReducer> = Arc::new(CommStats(comm));
    for bn in &layers {
        bn.set_sync(Some(stats.clone()));
    }
    layers.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};
    use candle_nn::{ModuleT, VarBuilder, VarMap};
    use tandem_comm::LocalGroup;
    use tandem_nn::fast_batch_norm2d;

    fn input(seed: u32, n: usize) -> Tensor {
        let data: Vec<f32> = (0..n * 3 * 2 * 2)
            .map(|i| ((i as u32 * 7919 + seed * 104729) % 97) as f32 / 13.0)
            .collect();
        Tensor::from_vec(data, (n, 3, 2, 2), &Device::Cpu).unwrap()
    }

    /// Two synchronised ranks with halves of a batch give the outputs, statistics and input
    /// gradients of one unsynchronised layer on the whole batch.
    #[test]
    fn synchronised_halves_equal_the_whole_batch() {
        let whole = Tensor::cat(&[&input(1, 2), &input(2, 3)], 0).unwrap();
        let reference = {
            let vm = VarMap::new();
            let bn = fast_batch_norm2d(3, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))
                .unwrap();
            let x = Var::from_tensor(&whole).unwrap();
            let y = bn.forward_t(x.as_tensor(), true).unwrap();
            let weights = Tensor::arange(0f32, y.elem_count() as f32, &Device::Cpu)
                .unwrap()
                .reshape(y.shape())
                .unwrap();
            let g = (y.clone() * weights).unwrap().sum_all().unwrap().backward().unwrap();
            (y, g.get(x.as_tensor()).unwrap().clone(), bn.running_var().clone())
        };
        let hs: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let rank = g.rank();
                    let vm = VarMap::new();
                    let bn = fast_batch_norm2d(
                        3,
                        VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
                    )
                    .unwrap();
                    bn.set_sync(Some(Arc::new(CommStats(Arc::new(g)))));
                    let (n, start) = if rank == 0 { (2, 0) } else { (3, 2) };
                    let x = Var::from_tensor(&input(rank as u32 + 1, n)).unwrap();
                    let y = bn.forward_t(x.as_tensor(), true).unwrap();
                    let weights = Tensor::arange(
                        (start * 12) as f32,
                        ((start + n) * 12) as f32,
                        &Device::Cpu,
                    )
                    .unwrap()
                    .reshape(y.shape())
                    .unwrap();
                    let g = (y.clone() * weights).unwrap().sum_all().unwrap().backward().unwrap();
                    (y, g.get(x.as_tensor()).unwrap().clone(), bn.running_var().clone())
                })
            })
            .collect();
        let parts: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let cat = |f: fn(&(Tensor, Tensor, Tensor)) -> &Tensor| {
            Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap()
        };
        let close = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "max difference {d}");
        };
        close(&cat(|p| &p.0), &reference.0);
        close(&cat(|p| &p.1), &reference.1);
        close(&parts[0].2, &reference.2);
        close(&parts[1].2, &reference.2);
    }
}
