//! Shared helpers for Ddp's multi-rank tests: synthetic data, reference training, and running
//! one closure per rank on threads over a process group.
#![allow(dead_code)]
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use tandem_comm::{Collectives, LocalGroup};
use tandem_models::Mlp;
use tandem_nn::ParamModule;
use tandem_optim::{SgdConfig, TorchSgd};

pub const DIMS: [usize; 4] = [12, 32, 16, 5];

/// Deterministic inputs `[n, DIMS[0]]` and labels in `0..5`.
pub fn data(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * DIMS[0]).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..DIMS[3] as u32)).collect();
    (
        Tensor::from_vec(x, (n, DIMS[0]), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
    )
}

pub fn sgd_cfg() -> SgdConfig {
    SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 1e-3, nesterov: false }
}

pub fn weights(m: &impl ParamModule) -> Vec<(String, Vec<f32>)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

pub fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut m = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            m = m.max((x - y).abs());
        }
    }
    m
}

/// One process, whole batch, `micro` gradient-accumulation micro-batches per step.
pub fn reference(steps: usize, batch: usize, micro: usize) -> Vec<(String, Vec<f32>)> {
    let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
    let mut opt = TorchSgd::new(model.params(), sgd_cfg()).unwrap();
    for s in 0..steps {
        let (x, y) = data(batch, 100 + s as u64);
        let m = batch / micro;
        let mut total: Option<candle_core::backprop::GradStore> = None;
        for k in 0..micro {
            let loss = model
                .loss(&x.narrow(0, k * m, m).unwrap(), &y.narrow(0, k * m, m).unwrap())
                .unwrap();
            let g = loss.backward().unwrap();
            match &mut total {
                None => total = Some(g),
                Some(t) => t.extend(g).unwrap(),
            }
        }
        opt.step(&total.unwrap()).unwrap();
    }
    weights(&model)
}

/// Runs `f(rank, group)` on `world` threads over an in-process group.
pub fn run_local<T: Send + 'static>(
    world: usize,
    f: impl Fn(Arc<dyn Collectives>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = LocalGroup::with_timeout(world, Duration::from_secs(30))
        .into_iter()
        .map(|g| {
            let f = f.clone();
            std::thread::spawn(move || f(Arc::new(g)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// Runs `f(group)` on `world` threads, each with a real tandem-comm `ProcessGroup` rendezvoused
/// over loopback TCP (`transport` picks TCP or shared-memory collectives), with a 20 s
/// collective timeout. Panics, never hangs, if the world does not finish within 60 s.
pub fn run_pg<T: Send + 'static>(
    world: usize,
    transport: tandem_comm::TransportKind,
    f: impl Fn(Arc<dyn Collectives>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let mut opts = tandem_testutil::test_options(transport);
    opts.timeout = Duration::from_secs(20);
    tandem_testutil::run_world(world, opts, Duration::from_secs(60), move |pg| f(Arc::new(pg)))
}
