//! Gradient buckets as tensors on the gradients' own device (the CUDA path, `device.rs`): each
//! bucket of the reducer's plan is its gradients concatenated into one flat tensor, handed to a
//! [`FlatReducer`] (NCCL on a GPU), and every parameter's gradient comes back as a view into
//! its reduced bucket. Engine-side and device-agnostic, so the layout logic is tested on the CPU.
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::error::{DdpError, Result};

/// Averages flat buckets over the group.
pub(crate) trait FlatReducer {
    /// Starts averaging `flat` over the group and returns the tensor that will hold the average
    /// (`flat` itself when reduced in place). May return before the device has finished.
    fn reduce(&mut self, flat: Tensor) -> Result<Tensor>;
    /// Orders whatever reads the gradients after every reduction started so far.
    fn finish(&mut self) -> Result<()>;
}

/// `grads` (one per var, every one present) averaged by `reducer`, one flat tensor per bucket
/// of `buckets` (indices into `vars`), returned as views keyed by the vars.
pub(crate) fn reduce_buckets(
    reducer: &mut dyn FlatReducer,
    vars: &[Var],
    grads: &GradStore,
    buckets: &[Vec<usize>],
) -> Result<GradStore> {
    let mut out = GradStore::default();
    for bucket in buckets {
        let mut parts = Vec::with_capacity(bucket.len());
        for &i in bucket {
            let g = grads.get(vars[i].as_tensor()).ok_or_else(|| {
                DdpError::Device(format!("parameter {i} has no gradient to put in its bucket"))
            })?;
            parts.push(g.flatten_all()?);
        }
        // A fresh contiguous buffer, owned by the returned views.
        let reduced = reducer.reduce(Tensor::cat(&parts, 0)?)?;
        let mut off = 0;
        for &i in bucket {
            let v = &vars[i];
            out.insert(v.as_tensor(), reduced.narrow(0, off, v.elem_count())?.reshape(v.shape())?);
            off += v.elem_count();
        }
    }
    reducer.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use tandem_comm::{Collectives, LocalGroup};
    use tandem_nn::kernels::with_f32_slice;

    /// The host stand-in for NCCL: all_reduce_avg over an in-process group.
    struct HostReducer<'a>(&'a LocalGroup, usize);

    impl FlatReducer for HostReducer<'_> {
        fn reduce(&mut self, flat: Tensor) -> Result<Tensor> {
            let mut v = with_f32_slice(&flat, |s| s.to_vec())?;
            self.0.all_reduce_avg(&mut v).map_err(|e| DdpError::comm("test", 0, e))?;
            Ok(Tensor::from_vec(v, flat.elem_count(), flat.device())?)
        }
        fn finish(&mut self) -> Result<()> {
            self.1 += 1;
            Ok(())
        }
    }

    #[test]
    fn buckets_average_every_gradient_and_give_it_back_in_its_shape() {
        let groups = LocalGroup::new(2);
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let dev = Device::Cpu;
                    let shapes: [&[usize]; 3] = [&[2, 3], &[4], &[1, 2]];
                    let vars: Vec<Var> = shapes
                        .iter()
                        .map(|s| Var::zeros(*s, candle_core::DType::F32, &dev).unwrap())
                        .collect();
                    let mut grads = GradStore::default();
                    for (i, v) in vars.iter().enumerate() {
                        // Rank r's gradient of var i: 100 i + 10 r + element index.
                        let n = v.elem_count();
                        let vals: Vec<f32> =
                            (0..n).map(|k| (100 * i + 10 * g.rank() + k) as f32).collect();
                        grads.insert(
                            v.as_tensor(),
                            Tensor::from_vec(vals, v.shape(), &dev).unwrap(),
                        );
                    }
                    let mut r = HostReducer(&g, 0);
                    let out =
                        reduce_buckets(&mut r, &vars, &grads, &[vec![2, 0], vec![1]]).unwrap();
                    assert_eq!(r.1, 1, "finish runs once, after the last bucket");
                    vars.iter()
                        .map(|v| {
                            let t = out.get(v.as_tensor()).unwrap();
                            assert_eq!(t.dims(), v.dims());
                            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            let got = h.join().unwrap();
            for (i, g) in got.iter().enumerate() {
                // The average over ranks 0 and 1 of 100 i + 10 r + k is 100 i + 5 + k.
                let want: Vec<f32> = (0..g.len()).map(|k| (100 * i + 5 + k) as f32).collect();
                assert_eq!(g, &want, "var {i}");
            }
        }
    }

    #[test]
    fn a_missing_gradient_is_named_not_skipped() {
        let dev = Device::Cpu;
        let vars = vec![Var::zeros(2, candle_core::DType::F32, &dev).unwrap()];
        let g = LocalGroup::new(1).pop().unwrap();
        let err = reduce_buckets(&mut HostReducer(&g, 0), &vars, &GradStore::default(), &[vec![0]])
            .unwrap_err()
            .to_string();
        assert!(err.contains("parameter 0 has no gradient"), "{err}");
    }
}
