//! Ddp's contract beyond numerics: construction checks, unused parameters, hooks overlapping
//! backward, buffers, the wrapped model staying reachable, state dicts.
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor, Var};
use common::*;
use tandem_comm::Collectives;
use tandem_comm::CommSource;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpError, DdpOptions};
use tandem_models::{Cnn, Mlp};
use tandem_nn::{ParamModule, ParamSet};
use tandem_optim::TorchSgd;

#[test]
fn construction_names_the_first_mismatch_and_the_ranks() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let hidden = if comm.rank() == 1 { 33 } else { 32 };
        let model = Mlp::new(&[12, hidden, 5], 1, &Device::Cpu).unwrap();
        Ddp::with_comm(model, comm, DdpOptions::default()).err().map(|e| e.to_string())
    });
    for err in out {
        let err = err.expect("mismatched models must be refused");
        assert!(
            err.contains("fc1.weight [32, 12]") && err.contains("fc1.weight [33, 12]"),
            "{err}"
        );
        assert!(err.contains("rank 0") && err.contains("rank 1"), "{err}");
    }
}

#[test]
fn construction_broadcasts_rank0_parameters_and_buffers() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let rank = comm.rank();
        let model = Cnn::new(1, 8, 8, 10, 3 + rank as u64, &Device::Cpu).unwrap();
        if rank == 1 {
            model.named_buffers()[0].1.set(&Tensor::full(5f32, 8, &Device::Cpu).unwrap()).unwrap();
        }
        let ddp = Ddp::with_comm(model, comm, DdpOptions::default()).unwrap();
        ddp.named_tensors()
            .into_iter()
            .filter(|(_, t)| t.dtype() == candle_core::DType::F32)
            .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect::<Vec<_>>()
    });
    let rank0_init = Cnn::new(1, 8, 8, 10, 3, &Device::Cpu).unwrap();
    let expect: Vec<_> = rank0_init
        .named_tensors()
        .into_iter()
        .filter(|(_, t)| t.dtype() == candle_core::DType::F32)
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    assert_eq!(out[0], expect);
    assert_eq!(out[1], expect);
}

/// `trunk` always used; `head` only when `use_head` (a branch not taken).
struct Branchy {
    params: ParamSet,
    use_head: AtomicBool,
}

impl Branchy {
    fn new() -> Self {
        let d = Device::Cpu;
        let t = Var::from_tensor(
            &Tensor::arange(0f32, 12., &d)
                .unwrap()
                .reshape((4, 3))
                .unwrap()
                .affine(0.1, 0.)
                .unwrap(),
        )
        .unwrap();
        let h =
            Var::from_tensor(&Tensor::ones((1, 4), candle_core::DType::F32, &d).unwrap()).unwrap();
        Branchy {
            params: ParamSet::new(vec![("trunk.weight".into(), t), ("head.weight".into(), h)]),
            use_head: AtomicBool::new(true),
        }
    }
    fn loss(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(&self.params.get(0)?.t()?)?;
        let h = if self.use_head.load(Ordering::SeqCst) {
            h.matmul(&self.params.get(1)?.t()?)?
        } else {
            h
        };
        h.sqr()?.mean_all()
    }
}

impl ParamModule for Branchy {
    fn param_set(&self) -> &ParamSet {
        &self.params
    }
    fn replicate(&self, _: &Device) -> tandem_nn::Result<Self> {
        unimplemented!("not needed here")
    }
}

#[test]
fn unused_parameter_error_names_it_and_the_fix() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let ddp = Ddp::with_comm(Branchy::new(), comm, DdpOptions::default()).unwrap();
        ddp.hooked().use_head.store(false, Ordering::SeqCst);
        let x = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = ddp.backward(&ddp.hooked().loss(&x).unwrap()).unwrap_err();
        assert!(matches!(err, DdpError::UnusedParameters { .. }));
        // The wrapper stays usable: the next step with the branch taken works.
        ddp.hooked().use_head.store(true, Ordering::SeqCst);
        let ok = ddp
            .backward(&ddp.hooked().loss(&x).unwrap())
            .map(|g| g.get(ddp.param_set().named()[1].1.as_tensor()).is_some());
        (err.to_string(), ok.unwrap())
    });
    for (err, ok) in out {
        assert!(
            err.contains("head.weight") && err.contains("find_unused_parameters: true"),
            "{err}"
        );
        assert!(!err.contains("trunk.weight"), "{err}");
        assert!(ok);
    }
}

#[test]
fn find_unused_parameters_counts_locally_unused_as_zero() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let rank = comm.rank();
        let ddp = Ddp::with_comm(
            Branchy::new(),
            comm,
            DdpOptions { find_unused_parameters: true, ..Default::default() },
        )
        .unwrap();
        let x = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        // Rank 1 skips the head: the head's gradient is rank 0's divided by the world size.
        ddp.hooked().use_head.store(rank == 0, Ordering::SeqCst);
        let g = ddp.backward(&ddp.hooked().loss(&x).unwrap()).unwrap();
        let head = g
            .get(ddp.param_set().named()[1].1.as_tensor())
            .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        // Nobody uses the head: it gets no gradient at all (optimizers skip it, as in torch).
        ddp.hooked().use_head.store(false, Ordering::SeqCst);
        let g2 = ddp.backward(&ddp.hooked().loss(&x).unwrap()).unwrap();
        (head, g2.get(ddp.param_set().named()[1].1.as_tensor()).is_none())
    });
    // Rank 0 alone: loss = mean((x W^T H^T)^2) with one output per row.
    let single = Branchy::new();
    let x = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    let g = single.loss(&x).unwrap().backward().unwrap();
    let want: Vec<f32> = g
        .get(single.params.named()[1].1.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v / 2.0)
        .collect();
    for (head, none_when_globally_unused) in out {
        let head = head.expect("head used on rank 0");
        for (a, b) in head.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "{head:?} vs {want:?}");
        }
        assert!(none_when_globally_unused);
    }
}

/// Wraps a group and counts finished all-reduces (to observe overlap with backward).
#[derive(Clone)]
struct Counting<G> {
    inner: G,
    reduced: Arc<AtomicUsize>,
}

impl<G: Collectives> Collectives for Counting<G> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        let r = self.inner.all_reduce_avg(buf);
        self.reduced.fetch_add(1, Ordering::SeqCst);
        r
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        self.inner.all_reduce_sum(buf)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommSource> {
        self.inner.broadcast(buf, root)
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        self.inner.all_gather_bytes(bytes)
    }
}

/// Identity whose backward waits (bounded) until some bucket has been all-reduced, and records
/// whether that happened: backward is still running at that point (fc1's gradient is not done).
struct Probe {
    reduced: Arc<AtomicUsize>,
    seen: Arc<AtomicBool>,
}

impl CustomOp1 for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a, b) = l.contiguous_offsets().unwrap();
        Ok((CpuStorage::F32(s.as_slice::<f32>()?[a..b].to_vec()), l.shape().clone()))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let t0 = Instant::now();
        while self.reduced.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.seen.store(self.reduced.load(Ordering::SeqCst) > 0, Ordering::SeqCst);
        Ok(Some(g.clone()))
    }
}

#[test]
fn buckets_are_reduced_while_backward_is_still_running() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let reduced = Arc::new(AtomicUsize::new(0));
        let counting = Counting { inner: comm, reduced: reduced.clone() };
        let opts = DdpOptions { bucket_cap_mb: 1e-6, first_bucket_mb: 1e-6, ..Default::default() };
        let ddp =
            Ddp::new(Mlp::new(&[6, 8, 3], 1, &Device::Cpu).unwrap(), &counting, opts).unwrap();
        let seen = Arc::new(AtomicBool::new(false));
        let (x, _) = (Tensor::ones((4, 6), candle_core::DType::F32, &Device::Cpu).unwrap(), ());
        let p = ddp.param_set();
        // fc1 -> probe -> relu -> fc2: the probe's backward runs after fc2's gradients, before fc1's.
        let h = x
            .matmul(&p.get(0).unwrap().t().unwrap())
            .unwrap()
            .broadcast_add(&p.get(1).unwrap())
            .unwrap();
        let h = h
            .apply_op1(Probe { reduced: reduced.clone(), seen: seen.clone() })
            .unwrap()
            .relu()
            .unwrap();
        let out = h
            .matmul(&p.get(2).unwrap().t().unwrap())
            .unwrap()
            .broadcast_add(&p.get(3).unwrap())
            .unwrap();
        ddp.backward(&out.sqr().unwrap().mean_all().unwrap()).unwrap();
        (seen.load(Ordering::SeqCst), reduced.load(Ordering::SeqCst))
    });
    for (seen, reduced) in out {
        assert!(seen, "no bucket was all-reduced before backward reached fc1");
        assert_eq!(reduced, 4, "one all-reduce per parameter bucket");
    }
}

/// A model that reads its Vars directly, bypassing the hooked view: Ddp still averages (after
/// backward, without overlap).
#[test]
fn forward_that_bypasses_the_view_still_gets_averaged_gradients() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let rank = comm.rank() as f32;
        let ddp = Ddp::with_comm(
            Mlp::new(&[2, 2], 1, &Device::Cpu).unwrap(),
            comm,
            DdpOptions::default(),
        )
        .unwrap();
        let w = ddp.param_set().named()[0].1.clone();
        let b = ddp.param_set().named()[1].1.clone();
        let x = Tensor::new(&[[1f32 + rank, 2.0]], &Device::Cpu).unwrap();
        let loss = x
            .matmul(&w.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(b.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap();
        let g = ddp.backward(&loss).unwrap();
        g.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap()
    });
    // d(sum(x W^T + b))/dW = [x; x]; averaged over x = [1,2] and [2,2].
    for g in out {
        assert_eq!(g, vec![vec![1.5, 2.0], vec![1.5, 2.0]]);
    }
}

#[test]
fn broadcast_buffers_copies_rank0_running_stats_every_forward() {
    for broadcast_buffers in [true, false] {
        let out = run_pg(2, TransportKind::Tcp, move |comm| {
            let rank = comm.rank();
            let ddp = Ddp::with_comm(
                Cnn::new(1, 8, 8, 10, 3, &Device::Cpu).unwrap(),
                comm,
                DdpOptions { broadcast_buffers, ..Default::default() },
            )
            .unwrap();
            // Rank 1's statistics drift between steps; the same batch on both ranks.
            if rank == 1 {
                ddp.named_buffers()[0]
                    .1
                    .set(&Tensor::full(9f32, 8, &Device::Cpu).unwrap())
                    .unwrap();
            }
            let x = Tensor::arange(0f32, 2. * 64., &Device::Cpu)
                .unwrap()
                .reshape((2, 1, 8, 8))
                .unwrap()
                .affine(0.01, 0.)
                .unwrap();
            let y = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
            let g = ddp.backward(&ddp.hooked().loss(&x, &y).unwrap()).unwrap();
            assert_eq!(g.get(ddp.param_set().named()[2].1.as_tensor()).unwrap().dims(), &[8]);
            ddp.named_buffers()[0].1.as_tensor().to_vec1::<f32>().unwrap()
        });
        assert_eq!(
            out[0] == out[1],
            broadcast_buffers,
            "broadcast_buffers={broadcast_buffers}: {out:?}"
        );
    }
}

#[test]
fn wrapped_model_methods_and_state_dict_stay_reachable() {
    let model = Mlp::new(&[4, 3, 2], 5, &Device::Cpu).unwrap();
    let x = Tensor::ones((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let y = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
    let before = model.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    let ddp = Ddp::new(model, &tandem_comm::SingleProcess, DdpOptions::default()).unwrap();
    // hooked(): the model's own loss() through the wrapper; module(): the plain model.
    assert_eq!(ddp.hooked().loss(&x, &y).unwrap().to_scalar::<f32>().unwrap(), before);
    assert_eq!(ddp.module().loss(&x, &y).unwrap().to_scalar::<f32>().unwrap(), before);
    let keys: Vec<String> = ddp.named_tensors().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
    // Load another model's state through the wrapper; a bad key is named.
    let other = Mlp::new(&[4, 3, 2], 6, &Device::Cpu).unwrap();
    ddp.load_named_tensors(other.named_tensors()).unwrap();
    assert_eq!(
        ddp.hooked().loss(&x, &y).unwrap().to_scalar::<f32>().unwrap(),
        other.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap()
    );
    let mut bad = other.named_tensors();
    bad[0].0 = "module.fc1.weight".into();
    let err = ddp.load_named_tensors(bad).unwrap_err().to_string();
    assert!(err.contains("module.fc1.weight") && err.contains("fc1.weight"), "{err}");
    let inner = ddp.into_inner();
    assert_eq!(
        inner.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap(),
        other.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap()
    );
}

/// A world of one skips hooks and buckets when it can; it must behave exactly like any world:
/// gradients equal plain backward, an unused parameter is the same clear error, and no_sync
/// accumulation adds up.
#[test]
fn world_of_one_keeps_ddp_semantics() {
    let x = Tensor::new(&[[1f32, 2., 3., 4.], [0.5, -1., 2., 0.]], &Device::Cpu).unwrap();
    let y = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
    let grads_of = |g: &candle_core::backprop::GradStore, vars: &[Var]| -> Vec<Vec<f32>> {
        vars.iter()
            .map(|v| g.get(v.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };

    // Plain candle backward on the same weights is the reference.
    let plain = Mlp::new(&[4, 3, 2], 9, &Device::Cpu).unwrap();
    let plain_vars = plain.params();
    let reference = grads_of(&plain.loss(&x, &y).unwrap().backward().unwrap(), &plain_vars);

    let ddp = Ddp::new(
        Mlp::new(&[4, 3, 2], 9, &Device::Cpu).unwrap(),
        &tandem_comm::SingleProcess,
        DdpOptions::default(),
    )
    .unwrap();
    let vars = ddp.params();
    let g = ddp.backward(&ddp.hooked().loss(&x, &y).unwrap()).unwrap();
    assert_eq!(grads_of(&g, &vars), reference);

    // no_sync twice, then a synced step: the gradient is the sum of the three backwards.
    ddp.no_sync(|d| d.backward(&d.hooked().loss(&x, &y).unwrap()).unwrap());
    ddp.no_sync(|d| d.backward(&d.hooked().loss(&x, &y).unwrap()).unwrap());
    let summed = grads_of(&ddp.backward(&ddp.hooked().loss(&x, &y).unwrap()).unwrap(), &vars);
    for (s, r) in summed.iter().flatten().zip(reference.iter().flatten()) {
        assert!((s - 3.0 * r).abs() <= 1e-5 * (1.0 + r.abs()), "accumulated {s} vs 3 x {r}");
    }
    // ...and the next step starts from scratch again.
    assert_eq!(
        grads_of(&ddp.backward(&ddp.hooked().loss(&x, &y).unwrap()).unwrap(), &vars),
        reference
    );

    // An unused parameter is the same error as in a bigger world.
    let branchy =
        Ddp::new(Branchy::new(), &tandem_comm::SingleProcess, DdpOptions::default()).unwrap();
    branchy.hooked().use_head.store(false, Ordering::SeqCst);
    let x3 = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    let err = branchy.backward(&branchy.hooked().loss(&x3).unwrap()).unwrap_err().to_string();
    assert!(err.contains("head.weight") && err.contains("find_unused_parameters: true"), "{err}");
}

/// PyTorch's `ddp.module` is the plain model: rank 0 alone evaluates mid-training (BatchNorm in
/// eval mode) without starting a step or broadcasting buffers, which would wait for rank 1 until
/// the group timeout. The result equals an unwrapped copy's, and training carries on after.
#[test]
fn module_is_the_plain_model_so_one_rank_can_evaluate_alone() {
    let x = Tensor::arange(0f32, 4. * 64., &Device::Cpu)
        .unwrap()
        .reshape((4, 1, 8, 8))
        .unwrap()
        .affine(0.01, -0.5)
        .unwrap();
    let y = Tensor::new(&[1u32, 2, 3, 4], &Device::Cpu).unwrap();
    let xe = x.clone();
    // A hang would surface as run_pg's 20 s collective timeout: an error, then a panic here.
    let out = run_pg(2, TransportKind::Tcp, move |comm| {
        let rank = comm.rank();
        let model = Cnn::new(1, 8, 8, 10, 3, &Device::Cpu).unwrap();
        let ddp = Ddp::with_comm(model, comm, DdpOptions::default()).unwrap();
        let mut opt = TorchSgd::new(ddp.params(), sgd_cfg()).unwrap();
        let mut train_step = || {
            let g = ddp.backward(&ddp.hooked().loss(&x, &y).unwrap()).unwrap();
            opt.step(&g).unwrap();
        };
        train_step();
        let mut evaluated = None;
        if rank == 0 {
            let plain = ddp.module();
            plain.set_training(false);
            let logits = plain.forward(&xe).expect("rank 0 evaluates alone");
            plain.set_training(true);
            // The same weights and running statistics in a model Ddp never saw.
            let copy = Cnn::new(1, 8, 8, 10, 99, &Device::Cpu).unwrap();
            copy.load_named_tensors(ddp.named_tensors()).unwrap();
            copy.set_training(false);
            let expect = copy.forward(&xe).unwrap();
            evaluated = Some((logits.to_vec2::<f32>().unwrap(), expect.to_vec2::<f32>().unwrap()));
        }
        // Both ranks keep training together afterwards, with hooks and buffer broadcasts.
        train_step();
        let w = weights(&*ddp.module());
        (evaluated, w)
    });
    let (logits, expect) = out[0].0.clone().expect("rank 0 evaluated");
    assert_eq!(logits, expect);
    assert_eq!(out[0].1, out[1].1, "ranks diverged after the rank-0-only evaluation");
}
