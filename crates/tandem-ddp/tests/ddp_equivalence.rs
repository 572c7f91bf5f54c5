//! K steps of 2-rank Ddp (per-rank batch B/2) reach the same weights as K steps of one process
//! on batch B: with and without no_sync accumulation, with one parameter per bucket and with
//! everything in one bucket.
mod common;

use std::sync::Arc;

use candle_core::Device;
use common::*;
use tandem_comm::Collectives;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::Mlp;
use tandem_optim::TorchSgd;

const STEPS: usize = 4;
const BATCH: usize = 16;

/// Rank r trains on rows [r*B/world, (r+1)*B/world) of each step's batch; `micro` no_sync
/// micro-batches per step. Rank 1 starts from different weights: Ddp::new must broadcast rank 0's.
type Weights = Vec<(String, Vec<f32>)>;

fn ddp_rank(
    comm: Arc<dyn Collectives>,
    opts: DdpOptions,
    micro: usize,
) -> (Weights, Vec<Vec<usize>>) {
    let (rank, world) = (comm.rank(), comm.size());
    let model = Mlp::new(&DIMS, 7 + rank as u64 * 1000, &Device::Cpu).unwrap();
    let ddp = Ddp::with_comm(model, comm, opts).unwrap();
    let mut opt = TorchSgd::new(ddp.params(), sgd_cfg()).unwrap();
    let per_rank = BATCH / world;
    let m = per_rank / micro;
    for s in 0..STEPS {
        let (x, y) = data(BATCH, 100 + s as u64);
        let x = x.narrow(0, rank * per_rank, per_rank).unwrap();
        let y = y.narrow(0, rank * per_rank, per_rank).unwrap();
        for k in 0..micro - 1 {
            ddp.no_sync(|ddp| {
                let loss = ddp
                    .hooked()
                    .loss(&x.narrow(0, k * m, m).unwrap(), &y.narrow(0, k * m, m).unwrap())
                    .unwrap();
                ddp.backward(&loss).unwrap();
            });
        }
        let k = micro - 1;
        let loss = ddp
            .hooked()
            .loss(&x.narrow(0, k * m, m).unwrap(), &y.narrow(0, k * m, m).unwrap())
            .unwrap();
        let grads = ddp.backward(&loss).unwrap();
        opt.step(&grads).unwrap();
    }
    let w = weights(&*ddp.module());
    (w, ddp.bucket_params())
}

fn check(opts: DdpOptions, micro: usize) -> Vec<Vec<usize>> {
    check_on(opts, micro, TransportKind::Tcp)
}

/// Over real `ProcessGroup`s (threads, loopback sockets).
fn check_on(opts: DdpOptions, micro: usize, transport: TransportKind) -> Vec<Vec<usize>> {
    let expect = reference(STEPS, BATCH, micro);
    let out = run_pg(2, transport, move |c| ddp_rank(c, opts.clone(), micro));
    for (rank, (w, _)) in out.iter().enumerate() {
        let d = max_abs_diff(w, &expect);
        eprintln!("rank {rank}: max abs weight difference {d:e}");
        assert!(d <= 1e-5, "rank {rank}: max |w_ddp - w_single| = {d}");
    }
    out.into_iter().next().unwrap().1
}

#[test]
fn two_ranks_match_one_process_default_buckets() {
    check(DdpOptions::default(), 1);
}

#[test]
fn two_ranks_match_one_process_tiny_buckets() {
    // bucket_cap_mb 0.001 = 1048 bytes: several buckets (weights of >= 262 floats fill one alone).
    let opts = DdpOptions { bucket_cap_mb: 0.001, first_bucket_mb: 0.001, ..Default::default() };
    let buckets = check(opts, 1);
    assert!(buckets.len() >= 2, "{buckets:?}");
    // A cap below every parameter's size: exactly one parameter per bucket.
    let opts = DdpOptions { bucket_cap_mb: 1e-6, first_bucket_mb: 1e-6, ..Default::default() };
    let buckets = check(opts, 1);
    assert_eq!(buckets.len(), 6, "{buckets:?}");
    assert!(buckets.iter().all(|b| b.len() == 1));
    // Rebuilt in arrival order: backward reaches the last layer (fc3 = params 4, 5) first.
    let first_two: Vec<usize> = buckets[..2].iter().map(|b| b[0]).collect();
    assert!(first_two.contains(&4) && first_two.contains(&5), "{buckets:?}");
}

#[test]
fn two_ranks_match_one_process_single_big_bucket() {
    let opts = DdpOptions { bucket_cap_mb: 100.0, first_bucket_mb: 100.0, ..Default::default() };
    let buckets = check(opts, 1);
    assert_eq!(buckets.len(), 1);
}

#[test]
fn two_ranks_with_no_sync_accumulation_match_one_process() {
    check(DdpOptions::default(), 2);
    check(DdpOptions { bucket_cap_mb: 0.001, first_bucket_mb: 0.001, ..Default::default() }, 2);
}

#[test]
fn shared_memory_transport_and_in_process_group_agree_too() {
    check_on(DdpOptions::default(), 2, TransportKind::Shm);
    let expect = reference(STEPS, BATCH, 1);
    for (w, _) in run_local(2, |c| ddp_rank(c, DdpOptions::default(), 1)) {
        assert!(max_abs_diff(&w, &expect) <= 1e-5);
    }
}
