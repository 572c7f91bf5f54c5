//! Shared helpers for Ddp's multi-rank tests: synthetic data, reference training, and running
//! one closure per rank on threads over a process group.
#![allow(dead_code)]
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use tandem_ddp::comm::{GradComm, LocalGroup};
use tandem_ddp::models::Mlp;
use tandem_ddp::optim::{Optimizer, Sgd, SgdConfig};
use tandem_ddp::Module;

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

pub fn weights(m: &impl Module) -> Vec<(String, Vec<f32>)> {
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
    let mut opt = Sgd::new(model.params().vars(), sgd_cfg()).unwrap();
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
    f: impl Fn(Arc<dyn GradComm>) -> T + Send + Sync + Clone + 'static,
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
/// over loopback TCP (`transport` picks TCP or shared-memory collectives). Panics, never hangs,
/// if the world does not finish within 60 s.
pub fn run_pg<T: Send + 'static>(
    world: usize,
    transport: tandem_comm::TransportKind,
    f: impl Fn(Arc<dyn GradComm>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    use std::sync::mpsc;
    let port = tandem_testutil::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let opts = tandem_comm::InitOptions {
        transport: Some(transport),
        timeout: Duration::from_secs(20),
        init_timeout: Duration::from_secs(20),
        run_id: "ddp-test".into(),
        desync_check: false,
    };
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let (tx, f, url, opts) = (tx.clone(), f.clone(), url.clone(), opts.clone());
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let pg =
                    tandem_comm::init_with(&tandem_comm::InitMethod::tcp(&url, rank, world), &opts)
                        .expect("init process group");
                f(Arc::new(pg))
            }));
            let _ = tx.send((rank, r));
        });
    }
    drop(tx);
    let mut out: Vec<Option<T>> = (0..world).map(|_| None).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for _ in 0..world {
        match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
            Ok((rank, Ok(v))) => out[rank] = Some(v),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or(p.downcast_ref::<&str>().map(|s| s.to_string()));
                panic!("rank {rank} panicked: {msg:?}")
            }
            Err(_) => panic!("world of {world} did not finish within 60 s"),
        }
    }
    out.into_iter().map(|v| v.expect("every rank reported")).collect()
}
