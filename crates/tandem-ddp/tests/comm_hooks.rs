//! DDP communication hooks through a real process group: fp16/bf16 compression gives each rank
//! the compressed average of the local gradients (checked against that average computed here),
//! training with compression stays within a stated distance of uncompressed training, a custom
//! hook sees every bucket in launch order, and ranks registering different hooks are named.
mod common;

use std::sync::{Arc, Mutex};

use candle_core::Device;
use common::*;
use half::{bf16, f16};
use tandem_comm::Collectives;
use tandem_comm::CommSource;
use tandem_comm::TransportKind;
use tandem_ddp::comm_hooks::{self, CommHook, GradBucket};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::Mlp;
use tandem_nn::ParamModule;
use tandem_optim::TorchSgd;

/// Gradients per parameter.
type Grads = Vec<Vec<f32>>;

/// Each rank's local gradients and what Ddp handed back, for one step of the MLP.
fn one_step(hook: &'static str, transport: TransportKind) -> Vec<(Grads, Grads)> {
    run_pg(2, transport, move |comm| {
        let rank = comm.rank();
        let (x, y) = data(16, 40 + rank as u64);
        // The local gradients, from an identical unwrapped model.
        let plain = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
        let g = plain.loss(&x, &y).unwrap().backward().unwrap();
        let local: Grads = plain
            .params()
            .iter()
            .map(|v| g.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
        let ddp = Ddp::with_comm(model, comm, DdpOptions::default()).unwrap();
        ddp.register_comm_hook(comm_hooks::builtin(hook).unwrap()).unwrap();
        let grads = ddp.backward(&ddp.module().loss(&x, &y).unwrap()).unwrap();
        let vars = ddp.module().params();
        let reduced: Grads = vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        (local, reduced)
    })
}

fn compressed_average(a: f32, b: f32, to: fn(f32) -> f32) -> f32 {
    // Cast, divide by the world, sum in the wire type (two ranks: one rounding of the sum).
    to(to(to(a) / 2.0) + to(to(b) / 2.0))
}

#[test]
fn fp16_and_bf16_hooks_return_the_compressed_average() {
    let f16r = |v: f32| f16::from_f32(v).to_f32();
    let bf16r = |v: f32| bf16::from_f32(v).to_f32();
    for (hook, round, transport) in [
        ("fp16", f16r as fn(f32) -> f32, TransportKind::Tcp),
        ("bf16", bf16r as fn(f32) -> f32, TransportKind::Shm),
    ] {
        let out = one_step(hook, transport);
        let (l0, l1) = (&out[0].0, &out[1].0);
        assert_eq!(out[0].1, out[1].1, "{hook}: ranks got different gradients");
        let mut inexact = 0;
        for (p, got) in out[0].1.iter().enumerate() {
            for (i, &g) in got.iter().enumerate() {
                let want = compressed_average(l0[p][i], l1[p][i], round);
                assert_eq!(g, want, "{hook}: parameter {p} element {i}");
                inexact += usize::from(g != (l0[p][i] + l1[p][i]) / 2.0);
            }
        }
        assert!(inexact > 0, "{hook}: every gradient is the exact f32 average: no compression");
    }
}

/// Final weights after `steps` SGD steps on 2 ranks with `hook`, and the loss at every step.
fn train(hook: &'static str, steps: usize) -> (Vec<(String, Vec<f32>)>, Vec<f32>) {
    let out = run_pg(2, TransportKind::Tcp, move |comm| {
        let rank = comm.rank();
        let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
        let ddp = Ddp::with_comm(model, comm, DdpOptions::default()).unwrap();
        ddp.register_comm_hook(comm_hooks::builtin(hook).unwrap()).unwrap();
        let mut opt = TorchSgd::new(ddp.module().params(), sgd_cfg()).unwrap();
        let mut losses = Vec::new();
        for s in 0..steps {
            // Four fixed batches per rank, cycled: something to learn.
            let (x, y) = data(32, 10 * (s % 4) as u64 + rank as u64);
            let loss = ddp.module().loss(&x, &y).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            let g = ddp.backward(&loss).unwrap();
            opt.step(&g).unwrap();
        }
        let w = weights(&*ddp.module());
        (w, losses)
    });
    out.into_iter().next().unwrap()
}

#[test]
fn training_with_compression_tracks_uncompressed_training() {
    let steps = 100;
    let (w_ref, loss_ref) = train("none", steps);
    // Tolerances relative to the uncompressed loss at the same step.
    for (hook, tol) in [("fp16", 1e-2f32), ("bf16", 3e-2), ("powersgd", 5e-2)] {
        let (w, loss) = train(hook, steps);
        let worst = loss.iter().zip(&loss_ref).map(|(a, b)| (a - b).abs() / b).fold(0f32, f32::max);
        eprintln!(
            "{hook}: loss {:.4} -> {:.4} (uncompressed {:.4} -> {:.4}); max relative loss gap {worst:.2e}; \
             max weight gap {:.2e}",
            loss[0],
            loss[steps - 1],
            loss_ref[0],
            loss_ref[steps - 1],
            max_abs_diff(&w, &w_ref)
        );
        assert!(worst < tol, "{hook}: loss curve is {worst} from uncompressed (tolerance {tol})");
        assert!(max_abs_diff(&w, &w_ref) > 0.0, "{hook}: bitwise equal to uncompressed");
        if hook == "powersgd" {
            // Its first 10 steps are plain all-reduce: identical to uncompressed.
            assert_eq!(loss[..10], loss_ref[..10]);
        }
        assert!(loss[steps - 1] < 0.97 * loss[0], "{hook}: did not learn: {loss:?}");
    }
}

/// A custom hook: records the buckets it is given, then averages.
struct Recording(Mutex<Vec<(usize, usize)>>);

impl CommHook for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource> {
        self.0.lock().unwrap().push((bucket.index, bucket.buffer.len()));
        comm.all_reduce_avg(bucket.buffer)
    }
}

#[test]
fn a_custom_hook_sees_every_bucket_in_launch_order() {
    let out = run_local(2, |comm| {
        let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
        // Small buckets: several per step.
        let opts = DdpOptions {
            bucket_cap_mb: 0.001,
            first_bucket_mb: 0.001,
            rebuild_buckets: false,
            ..Default::default()
        };
        let ddp = Ddp::with_comm(model, comm.clone(), opts).unwrap();
        let hook = Arc::new(Recording(Mutex::new(Vec::new())));
        ddp.register_comm_hook(hook.clone()).unwrap();
        let (x, y) = data(8, comm.rank() as u64);
        ddp.backward(&ddp.module().loss(&x, &y).unwrap()).unwrap();
        let seen = hook.0.lock().unwrap().clone();
        (seen, ddp.bucket_params().len())
    });
    let (seen, buckets) = &out[0];
    assert!(*buckets > 1, "the test needs several buckets");
    let order: Vec<usize> = seen.iter().map(|s| s.0).collect();
    assert_eq!(order, (0..*buckets).collect::<Vec<_>>());
    let total: usize = seen.iter().map(|s| s.1).sum();
    let params: usize = DIMS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    assert_eq!(total, params);
    assert_eq!(out[0].0, out[1].0);
}

#[test]
fn ranks_registering_different_hooks_are_named() {
    let out = run_local(2, |comm| {
        let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
        let ddp = Ddp::with_comm(model, comm.clone(), DdpOptions::default()).unwrap();
        let name = if comm.rank() == 0 { "fp16" } else { "bf16" };
        ddp.register_comm_hook(comm_hooks::builtin(name).unwrap()).unwrap_err().to_string()
    });
    assert!(out[0].contains("rank 0 registered `fp16` but rank 1 registered `bf16`"), "{}", out[0]);
    assert!(out[1].contains("rank 1 registered `bf16` but rank 0 registered `fp16`"), "{}", out[1]);
}
