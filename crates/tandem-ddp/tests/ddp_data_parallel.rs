//! DataParallel over several CPU devices: torch.chunk splitting, replicas in parallel threads,
//! gathered outputs and gradients equal to one forward/backward over the whole batch.
mod common;

use std::collections::HashSet;
use std::sync::Mutex;

use candle_core::{Device, Tensor};
use common::*;
use tandem_ddp::DataParallel;
use tandem_models::{Cnn, Mlp};
use tandem_nn::ParamModule;
use tandem_optim::TorchSgd;

fn grads_of(m: &impl ParamModule, g: &candle_core::backprop::GradStore) -> Vec<(String, Vec<f32>)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                g.get(v.as_tensor())
                    .expect("gradient present")
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect()
}

#[test]
fn splits_like_torch_chunk_runs_in_threads_and_matches_one_device() {
    for (devices, batch, expect_chunks) in
        [(2, 30, vec![15, 15]), (2, 10, vec![5, 5]), (3, 10, vec![4, 4, 2]), (4, 5, vec![2, 2, 1])]
    {
        let single = Mlp::new(&DIMS, 3, &Device::Cpu).unwrap();
        let (x, y) = data(batch, 11);
        let loss1 = single.loss(&x, &y).unwrap();
        let g1 = grads_of(&single, &loss1.backward().unwrap());
        let out1 = single.forward(&x).unwrap().to_vec2::<f32>().unwrap();

        let dp = DataParallel::new(
            Mlp::new(&DIMS, 3, &Device::Cpu).unwrap(),
            vec![Device::Cpu; devices],
        )
        .unwrap();
        let seen = Mutex::new((Vec::new(), HashSet::new()));
        let (loss, g) = dp
            .forward_backward(&[&x, &y], |m, c| {
                let mut s = seen.lock().unwrap();
                s.0.push(c[0].dim(0).unwrap());
                s.1.insert(std::thread::current().id());
                drop(s);
                m.loss(&c[0], &c[1])
            })
            .unwrap();
        let (mut sizes, threads) = seen.into_inner().unwrap();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(sizes, expect_chunks, "{devices} devices, batch {batch}");
        assert_eq!(threads.len(), expect_chunks.len(), "one thread per replica");
        assert!(!threads.contains(&std::thread::current().id()));
        assert!(
            (loss.to_scalar::<f32>().unwrap() - loss1.to_scalar::<f32>().unwrap()).abs() < 1e-6
        );
        let d = max_abs_diff(&grads_of(dp.module(), &g), &g1);
        assert!(d < 1e-6, "grad diff {d}");
        let out = dp.forward(&x, |m, c| m.forward(c)).unwrap();
        assert_eq!(out.dims(), &[batch, DIMS[3]]);
        let flat = |v: Vec<Vec<f32>>| v.into_iter().flatten().collect::<Vec<f32>>();
        let od = flat(out.to_vec2::<f32>().unwrap())
            .iter()
            .zip(flat(out1.clone()))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(od < 1e-6);
    }
}

#[test]
fn training_steps_refresh_replicas_and_match_single_device() {
    let expect = reference(4, 16, 1);
    let dp =
        DataParallel::new(Mlp::new(&DIMS, 7, &Device::Cpu).unwrap(), vec![Device::Cpu; 2]).unwrap();
    let mut opt = TorchSgd::new(dp.module().params(), sgd_cfg()).unwrap();
    for s in 0..4 {
        let (x, y) = data(16, 100 + s as u64);
        let (_, g) = dp.forward_backward(&[&x, &y], |m, c| m.loss(&c[0], &c[1])).unwrap();
        opt.step(&g).unwrap();
    }
    let d = max_abs_diff(&weights(dp.module()), &expect);
    assert!(d <= 1e-5, "{d}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let err = DataParallel::new(Mlp::new(&DIMS, 7, &Device::Cpu).unwrap(), vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("device_ids is empty"), "{err}");
    let dp =
        DataParallel::new(Cnn::new(1, 8, 8, 10, 1, &Device::Cpu).unwrap(), vec![Device::Cpu; 2])
            .unwrap();
    let x = Tensor::zeros((4, 1, 8, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::zeros(3, candle_core::DType::U32, &Device::Cpu).unwrap();
    let err =
        dp.forward_backward(&[&x, &y], |m, c| m.loss(&c[0], &c[1])).err().unwrap().to_string();
    assert!(err.contains("input #1 has 3 rows"), "{err}");
}
