//! Gradient buckets as tensors on the gradients' own device (the CUDA path, `device.rs`): each
//! bucket of the reducer's plan is its gradients concatenated into one flat tensor, handed to a
//! [`FlatReducer`] (NCCL on a GPU), and every parameter's gradient comes back as a view into
//! its reduced bucket. Engine-side and device-agnostic, so the layout logic is tested on the CPU.
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use tandem_comm::Collectives;

use crate::comm_hooks::DeviceWire;
use crate::error::{DdpError, Result};

/// Averages flat buckets over the group.
pub(crate) trait FlatReducer {
    /// Starts averaging `flat` over the group and returns the tensor that will hold the result
    /// (`flat` itself when reduced in place). May return before the device has finished.
    fn reduce(&mut self, flat: Tensor) -> Result<Tensor>;
    /// Orders whatever reads the gradients after every reduction started so far.
    fn finish(&mut self) -> Result<()>;
    /// The f32 average from what [`FlatReducer::reduce`] returned, once [`FlatReducer::finish`]
    /// has run (a compressed bucket is cast back here). The identity by default.
    fn restore(&mut self, reduced: Tensor) -> Result<Tensor> {
        Ok(reduced)
    }
}

impl DeviceWire {
    fn dtype(self) -> DType {
        match self {
            DeviceWire::F32 => DType::F32,
            DeviceWire::F16 => DType::F16,
            DeviceWire::Bf16 => DType::BF16,
        }
    }

    /// What a compressed bucket sends to be summed over `world` ranks: as the host hooks
    /// compute it (comm_hooks.rs `compressed`), each gradient rounded to the wire type, back to
    /// f32, divided by the world size (a true division, not a product with its inverse), and
    /// rounded again. For [`DeviceWire::F32`], `flat` itself (averaged by the all-reduce).
    pub(crate) fn compress(self, flat: &Tensor, world: usize) -> Result<Tensor> {
        if self == DeviceWire::F32 {
            return Ok(flat.clone());
        }
        let dt = self.dtype();
        let n = Tensor::new(world as f32, flat.device())?;
        let divided = flat.to_dtype(dt)?.to_dtype(DType::F32)?.broadcast_div(&n)?;
        Ok(divided.to_dtype(dt)?)
    }

    /// The f32 gradients from a summed wire bucket.
    pub(crate) fn decompress(self, summed: &Tensor) -> Result<Tensor> {
        Ok(summed.to_dtype(DType::F32)?)
    }
}

/// `no_sync` on the gradients' own device, as the host reducer does it: each no_sync backward
/// adds its gradients to this rank's sums (a parameter without one adds nothing), and the next
/// synchronised backward reduces its own gradients plus the sums, which it empties. The same
/// f32 additions in the same order as the reducer's, so the same bits.
#[derive(Default)]
pub(crate) struct LocalSums {
    sums: Vec<Option<Tensor>>,
}

impl LocalSums {
    pub(crate) fn is_empty(&self) -> bool {
        self.sums.iter().all(Option::is_none)
    }

    /// A no_sync step: adds `grads` and returns the sums so far (what such a step gives).
    pub(crate) fn add(&mut self, vars: &[Var], grads: &GradStore) -> Result<GradStore> {
        self.sums.resize(vars.len(), None);
        let mut out = GradStore::default();
        for ((v, sum), i) in vars.iter().zip(&mut self.sums).zip(0..) {
            if let Some(g) = grads.get(v.as_tensor()) {
                check_shape(v, g, i)?;
                *sum = Some(match sum.take() {
                    Some(s) => (s + g)?,
                    None => g.clone(),
                });
            }
            if let Some(s) = sum {
                out.insert(v.as_tensor(), s.clone());
            }
        }
        Ok(out)
    }

    /// The synchronised step's gradients before reduction: `grads` plus the sums (emptied).
    pub(crate) fn take_with(&mut self, vars: &[Var], grads: &GradStore) -> Result<GradStore> {
        let mut out = GradStore::default();
        for (i, v) in vars.iter().enumerate() {
            let sum = self.sums.get_mut(i).and_then(Option::take);
            let g = match (grads.get(v.as_tensor()), sum) {
                (Some(g), Some(s)) => {
                    check_shape(v, g, i)?;
                    (g + s)?
                }
                (Some(g), None) => g.clone(),
                (None, Some(s)) => s,
                (None, None) => continue,
            };
            out.insert(v.as_tensor(), g);
        }
        Ok(out)
    }

    /// The sums, emptied, by parameter index (for the host reducer when a step leaves the
    /// device path).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn take(&mut self) -> Vec<Option<Tensor>> {
        std::mem::take(&mut self.sums)
    }
}

/// A synchronised step on the device path, as the host reducer makes it: this step's `grads`
/// plus the `no_sync` sums (emptied), averaged by `reducer` one flat tensor per bucket of
/// `buckets`. With `finds_unused` (`find_unused_parameters`) this rank's used map (a gradient in
/// this step, not in the sums) is summed over the group through `comm` on every synchronised
/// step — every rank makes the same collectives whatever it used —, missing gradients reduce as
/// zeros, and parameters no rank used are left without one, so optimizers skip them.
pub(crate) fn reduce_step(
    reducer: &mut dyn FlatReducer,
    comm: &dyn Collectives,
    (vars, grads): (&[Var], &GradStore),
    sums: &mut LocalSums,
    buckets: &[Vec<usize>],
    finds_unused: bool,
) -> Result<GradStore> {
    let mut summed = sums.take_with(vars, grads)?;
    if !finds_unused {
        return reduce_buckets(reducer, vars, &summed, buckets);
    }
    let mut used: Vec<f32> =
        vars.iter().map(|v| if grads.get(v.as_tensor()).is_some() { 1.0 } else { 0.0 }).collect();
    comm.all_reduce_sum(&mut used)
        .map_err(|e| DdpError::comm("all_reduce(sum) of the used-parameter map", comm.rank(), e))?;
    for v in vars {
        if summed.get(v.as_tensor()).is_none() {
            summed.insert(v.as_tensor(), Tensor::zeros(v.shape(), v.dtype(), v.device())?);
        }
    }
    let mut reduced = reduce_buckets(reducer, vars, &summed, buckets)?;
    for (v, _) in vars.iter().zip(&used).filter(|(_, &u)| u == 0.0) {
        reduced.remove(v.as_tensor());
    }
    Ok(reduced)
}

fn check_shape(v: &Var, g: &Tensor, i: usize) -> Result<()> {
    if g.dims() != v.dims() {
        return Err(DdpError::Device(format!(
            "parameter {i} is {:?}, its gradient {:?}",
            v.dims(),
            g.dims()
        )));
    }
    Ok(())
}

/// `grads` (one per var, every one present) averaged by `reducer`, one flat tensor per bucket
/// of `buckets` (indices into `vars`), returned as views keyed by the vars.
fn reduce_buckets(
    reducer: &mut dyn FlatReducer,
    vars: &[Var],
    grads: &GradStore,
    buckets: &[Vec<usize>],
) -> Result<GradStore> {
    let mut out = GradStore::default();
    let mut pending = Vec::with_capacity(buckets.len());
    for bucket in buckets {
        let mut parts = Vec::with_capacity(bucket.len());
        for &i in bucket {
            let g = grads.get(vars[i].as_tensor()).ok_or_else(|| {
                DdpError::Device(format!("parameter {i} has no gradient to put in its bucket"))
            })?;
            parts.push(g.flatten_all()?);
        }
        // A fresh contiguous buffer, owned by the returned views.
        pending.push(reducer.reduce(Tensor::cat(&parts, 0)?)?);
    }
    reducer.finish()?;
    for (bucket, reduced) in buckets.iter().zip(pending) {
        let reduced = reducer.restore(reduced)?;
        let mut off = 0;
        for &i in bucket {
            let v = &vars[i];
            out.insert(v.as_tensor(), reduced.narrow(0, off, v.elem_count())?.reshape(v.shape())?);
            off += v.elem_count();
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use tandem_comm::LocalGroup;

    use crate::comm_hooks::BucketParam;
    use tandem_nn::kernels::with_f32_slice;

    /// The host reducer over `numels`, finding unused parameters, in one-parameter buckets.
    fn host_reducer(
        comm: &std::sync::Arc<dyn Collectives>,
        numels: Vec<usize>,
    ) -> crate::reducer::Reducer {
        let cfg = crate::reducer::ReducerConfig {
            first_bucket_bytes: 8,
            bucket_bytes: 8,
            find_unused_parameters: true,
            rebuild_buckets: false,
        };
        let names = (0..numels.len()).map(|i| format!("p{i}")).collect();
        crate::reducer::Reducer::new(names, numels, comm.clone(), cfg).unwrap()
    }

    /// The host stand-in for NCCL: all_reduce_avg over an in-process group.
    struct HostReducer<'a>(&'a dyn Collectives, usize);

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

    /// The host stand-in for the NCCL path with a compressing hook: the bucket compressed and
    /// restored by the tensor ops the GPU runs, summed in the wire type over the group.
    struct CompressingReducer<'a>(&'a LocalGroup, DeviceWire);

    impl FlatReducer for CompressingReducer<'_> {
        fn reduce(&mut self, flat: Tensor) -> Result<Tensor> {
            let wire = self.1.compress(&flat, self.0.size())?;
            let dev = wire.device().clone();
            let err = |e| DdpError::comm("test", 0, e);
            Ok(match self.1 {
                DeviceWire::F16 => {
                    let mut v = wire.to_vec1::<half::f16>()?;
                    self.0.all_reduce_sum_f16(&mut v).map_err(err)?;
                    Tensor::from_vec(v, wire.elem_count(), &dev)?
                }
                DeviceWire::Bf16 => {
                    let mut v = wire.to_vec1::<half::bf16>()?;
                    self.0.all_reduce_sum_bf16(&mut v).map_err(err)?;
                    Tensor::from_vec(v, wire.elem_count(), &dev)?
                }
                DeviceWire::F32 => unreachable!("HostReducer stands in for f32"),
            })
        }
        fn finish(&mut self) -> Result<()> {
            Ok(())
        }
        fn restore(&mut self, reduced: Tensor) -> Result<Tensor> {
            self.1.decompress(&reduced)
        }
    }

    /// no_sync on the device path (LocalSums, then `reduce_step` with find_unused_parameters)
    /// gives the host reducer's bits: each
    /// no_sync step's sums and the synchronised step's average, with a parameter left out of
    /// one no_sync step, and one used only in no_sync steps (no gradient after the synchronised
    /// step, as on the host).
    #[test]
    fn device_no_sync_sums_equal_the_host_reducers() {
        use std::sync::Arc;
        let out = LocalGroup::run(2, |comm: Arc<dyn Collectives>| {
            let dev = Device::Cpu;
            let rank = comm.rank();
            let shapes: [&[usize]; 3] = [&[3], &[2, 2], &[2]];
            let vars: Vec<Var> = shapes
                .iter()
                .map(|s| Var::zeros(*s, candle_core::DType::F32, &dev).unwrap())
                .collect();
            let mut host = host_reducer(&comm, vec![3, 4, 2]);
            let mut sums = LocalSums::default();
            let value = |step: usize, i: usize, k: usize| {
                0.1 * (step * 7 + i * 3 + k) as f32 + 1e-3 * rank as f32 + 1.0 / 3.0
            };
            // Steps 0..3 are no_sync (parameter 1 unused in step 1); step 3 synchronises
            // without parameter 2.
            let mut mismatches = Vec::new();
            for step in 0..4 {
                let sync = step == 3;
                let used: &[usize] = match step {
                    1 => &[0, 2],
                    3 => &[0, 1],
                    _ => &[0, 1, 2],
                };
                let mut grads = GradStore::default();
                host.prepare_for_backward(sync);
                for &i in used {
                    let v: Vec<f32> =
                        (0..vars[i].elem_count()).map(|k| value(step, i, k)).collect();
                    grads.insert(
                        vars[i].as_tensor(),
                        Tensor::from_vec(v.clone(), vars[i].shape(), &dev).unwrap(),
                    );
                    host.mark_ready(i, &v).unwrap();
                }
                host.finalize().unwrap();
                let device = if sync {
                    reduce_step(
                        &mut HostReducer(comm.as_ref(), 0),
                        comm.as_ref(),
                        (&vars, &grads),
                        &mut sums,
                        &[vec![0], vec![1], vec![2]],
                        true,
                    )
                    .unwrap()
                } else {
                    sums.add(&vars, &grads).unwrap()
                };
                for (i, v) in vars.iter().enumerate() {
                    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let d = device
                        .get(v.as_tensor())
                        .map(|t| bits(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap()));
                    let h = host.grad(i).map(bits);
                    if d != h {
                        mismatches.push((step, i, d, h));
                    }
                }
            }
            assert!(sums.is_empty(), "the synchronised step empties the sums");
            assert!(host.grad(2).is_none(), "no rank used parameter 2 in the synchronised step");
            mismatches
        });
        for (rank, m) in out.iter().enumerate() {
            assert!(m.is_empty(), "rank {rank}: {m:?}");
        }
    }

    /// find_unused_parameters on the device path gives the host reducer's result: a parameter
    /// one rank left out averages its zeros in; one no rank used gets no gradient.
    #[test]
    fn device_unused_parameters_equal_the_host_reducers() {
        use std::sync::Arc;
        let out = LocalGroup::run(2, |comm: Arc<dyn Collectives>| {
            let dev = Device::Cpu;
            let rank = comm.rank();
            let vars: Vec<Var> =
                (0..3).map(|_| Var::zeros(2, candle_core::DType::F32, &dev).unwrap()).collect();
            let mut host = host_reducer(&comm, vec![2; 3]);
            // Parameter 0 used by both ranks, 1 by rank 0 alone, 2 by none.
            let used: &[usize] = if rank == 0 { &[0, 1] } else { &[0] };
            let mut grads = GradStore::default();
            host.prepare_for_backward(true);
            for &i in used {
                let v = vec![1.5 + i as f32 + rank as f32 * 0.25, -0.75 * (rank + 1) as f32];
                grads.insert(vars[i].as_tensor(), Tensor::from_vec(v.clone(), 2, &dev).unwrap());
                host.mark_ready(i, &v).unwrap();
            }
            host.finalize().unwrap();
            let reduced = reduce_step(
                &mut HostReducer(comm.as_ref(), 0),
                comm.as_ref(),
                (&vars, &grads),
                &mut LocalSums::default(),
                &[vec![0], vec![1], vec![2]],
                true,
            )
            .unwrap();
            (0..3)
                .map(|i| {
                    let device =
                        reduced.get(vars[i].as_tensor()).map(|t| t.to_vec1::<f32>().unwrap());
                    (device, host.grad(i).map(<[f32]>::to_vec))
                })
                .collect::<Vec<_>>()
        });
        for (rank, params) in out.iter().enumerate() {
            for (i, (device, host)) in params.iter().enumerate() {
                assert_eq!(device, host, "rank {rank}, parameter {i}");
            }
            assert!(params[1].1.is_some() && params[2].1.is_none(), "rank {rank}: {params:?}");
        }
    }

    /// The GPU path's compression gives the host hooks' bits: each rank's buckets through
    /// CompressingReducer against Fp16Compress / Bf16Compress on the same values, with values
    /// that round, overflow f16 and underflow it.
    #[test]
    fn compressed_buckets_equal_the_host_hooks_bit_for_bit() {
        use crate::comm_hooks::{Bf16Compress, CommHook, Fp16Compress, GradBucket};
        for (wire, hook) in [
            (DeviceWire::F16, std::sync::Arc::new(Fp16Compress) as std::sync::Arc<dyn CommHook>),
            (DeviceWire::Bf16, std::sync::Arc::new(Bf16Compress)),
        ] {
            let handles: Vec<_> = LocalGroup::new(3)
                .into_iter()
                .map(|g| {
                    let hook = hook.clone();
                    std::thread::spawn(move || {
                        let dev = Device::Cpu;
                        let vals: Vec<f32> = (0..200)
                            .map(|k| {
                                let x = ((k * 37 + g.rank() * 11) % 101) as f32 - 50.0;
                                x * [1e-3, 0.123_456_7, 7e4, 1e-8][k % 4]
                            })
                            .collect();
                        let var = Var::zeros(200, candle_core::DType::F32, &dev).unwrap();
                        let mut grads = GradStore::default();
                        grads.insert(
                            var.as_tensor(),
                            Tensor::from_vec(vals.clone(), 200, &dev).unwrap(),
                        );
                        let mut r = CompressingReducer(&g, wire);
                        let out =
                            reduce_buckets(&mut r, std::slice::from_ref(&var), &grads, &[vec![0]])
                                .unwrap();
                        let got: Vec<f32> = out.get(var.as_tensor()).unwrap().to_vec1().unwrap();
                        let mut host = vals;
                        let params = [BucketParam { index: 0, offset: 0, shape: vec![200] }];
                        hook.reduce(
                            &g,
                            GradBucket { index: 0, buffer: &mut host, params: &params },
                        )
                        .unwrap();
                        (got, host)
                    })
                })
                .collect();
            for h in handles {
                let (got, host) = h.join().unwrap();
                let differ =
                    got.iter().zip(&host).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{wire:?}: {differ} of 200 differ from the host hook");
                assert!(got.iter().any(|v| v.is_infinite()) == (wire == DeviceWire::F16));
            }
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
