//! Fsdp's behaviour beyond the torch comparison: gradient accumulation without communication,
//! a model without a sharded root whose first unit reads plain data, parameters that hold
//! values only while gathered, and the errors for calls out of order and parameters read
//! outside their unit.
mod common;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Linear, VarBuilder, VarMap};
use common::*;
use tandem_fsdp::{Fsdp, FsdpOptions, Units};
use tandem_optim::{SgdConfig, TorchSgd};
use tandem_testutil::run_tcp_world;

fn sgd(params: Vec<Var>) -> TorchSgd {
    let cfg =
        SgdConfig { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    TorchSgd::new(params, cfg).unwrap()
}

/// Two half-batches with gradient sync off for the first, each loss halved, give the weights
/// of one step on the whole batch.
#[test]
fn accumulating_without_sync_equals_one_step_on_the_whole_batch() {
    let out = run_tcp_world(2, |pg| {
        let f = fixture(2);
        let tokens = tokens(&f, 0, pg.rank());
        let run = |microbatches: usize| {
            let varmap = VarMap::new();
            let (fsdp, gpt) = Gpt::new(&varmap, &f).shard(&varmap, &pg, options());
            let mut opt = sgd(fsdp.params());
            let mut grads = None;
            for m in 0..microbatches {
                fsdp.set_requires_gradient_sync(m + 1 == microbatches);
                let part = tokens.narrow(0, m * 2 / microbatches, 2 / microbatches).unwrap();
                let loss = fsdp
                    .forward(|| gpt.loss(&part)?.affine(1.0 / microbatches as f64, 0.0))
                    .unwrap();
                let g = fsdp.backward(&loss).unwrap();
                let held = fsdp.params().iter().filter(|p| g.get(p.as_tensor()).is_some()).count();
                if m + 1 < microbatches {
                    assert_eq!(held, 0, "a backward without sync returned shard gradients");
                }
                grads = Some(g);
            }
            opt.step(&grads.unwrap()).unwrap();
            fsdp.full_state_dict().unwrap()
        };
        (run(1), run(2))
    });
    for (rank, (whole, halves)) in out.iter().enumerate() {
        for ((name, a), (_, b)) in whole.iter().zip(halves) {
            let d = max_abs_diff(a, b);
            assert!(d <= 1e-6, "rank {rank}: `{name}` differs by {d} after accumulation");
        }
    }
}

/// An evaluation forward (`forward_no_grad`: FSDP2's forward under `torch.no_grad()`)
/// computes what a training forward computes, keeps no graph (its result's backward reaches no
/// parameter), leaves no step open and every parameter freed; training after it runs as usual.
#[test]
fn an_evaluation_forward_computes_the_forward_keeps_no_graph_and_frees_everything() {
    let out = run_tcp_world(2, |pg| {
        let f = fixture(2);
        let tokens = tokens(&f, 0, pg.rank());
        let varmap = VarMap::new();
        let (fsdp, gpt) = Gpt::new(&varmap, &f).shard(&varmap, &pg, options());
        fsdp.take_comm_stats();
        let eval = fsdp.forward_no_grad(|| gpt.loss(&tokens)).unwrap();
        let gathers = fsdp.take_comm_stats().all_gathers as usize;
        let reached = eval.backward().unwrap();
        let mut vars = varmap.all_vars();
        vars.extend(fsdp.params());
        let graph = vars.iter().filter(|v| reached.get(v.as_tensor()).is_some()).count();
        let freed = varmap.all_vars().iter().all(|v| v.as_tensor().sum_all().is_err());
        let open = fsdp.backward(&Tensor::new(1f32, &Device::Cpu).unwrap()).is_ok();
        let loss = fsdp.forward(|| gpt.loss(&tokens)).unwrap();
        let grads = fsdp.backward(&loss).unwrap();
        let held = fsdp.params().iter().filter(|p| grads.get(p.as_tensor()).is_some()).count();
        let losses = (eval.to_scalar::<f32>().unwrap(), loss.to_scalar::<f32>().unwrap());
        // (Every shard, the frozen one too; the trained ones.)
        let sizes = (fsdp.shards().len(), fsdp.params().len());
        (losses, gathers, graph, freed, open, held, sizes)
    });
    let rows = out.into_iter().enumerate();
    for (rank, ((eval, train), gathers, graph, freed, open, held, (shards, n))) in rows {
        assert_eq!(eval, train, "rank {rank}: the evaluation forward's loss");
        assert_eq!(gathers, shards, "rank {rank}: every parameter gathered once, no more");
        assert_eq!(graph, 0, "rank {rank}: the evaluation kept a graph to {graph} variables");
        assert!(freed, "rank {rank}: a parameter holds values after the evaluation");
        assert!(!open, "rank {rank}: a backward was accepted after the evaluation");
        assert_eq!(held, n, "rank {rank}: a training step after it has every shard's gradient");
    }
}

struct Mlp {
    l1: Linear,
    l2: Linear,
}

fn mlp(varmap: &VarMap) -> Mlp {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    Mlp {
        l1: candle_nn::linear(5, 7, vb.pp("l1")).unwrap(),
        l2: candle_nn::linear(7, 3, vb.pp("l2")).unwrap(),
    }
}

fn data(rank: usize) -> Tensor {
    let v: Vec<f32> = (0..20).map(|i| ((i * 7 + rank * 13) % 11) as f32 / 5.0 - 1.0).collect();
    Tensor::from_vec(v, (4, 5), &Device::Cpu).unwrap()
}

fn mlp_loss(l1: &dyn Module, l2: &dyn Module, x: &Tensor) -> candle_core::Result<Tensor> {
    l2.forward(&l1.forward(x)?.tanh()?)?.sqr()?.mean_all()
}

/// Every parameter in a unit, the root unsharded, the first unit reading plain data: one SGD
/// step gives the weights of the plain model stepped with the average of the ranks' gradients.
#[test]
fn units_without_a_root_step_as_the_averaged_plain_model() {
    let out = run_tcp_world(3, |pg| {
        let varmap = VarMap::new();
        let model = mlp(&varmap);
        let opts = FsdpOptions {
            units: Units::prefixes(["l1", "l2"]),
            shard_root: false,
            ..FsdpOptions::default()
        };
        // Every rank starts from rank 0's values (sync_module_states): keep them for the check.
        let init: Vec<(String, Tensor)> = {
            let mut v: Vec<_> = varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
        let (l1, l2) =
            (fsdp.fully_shard("l1", model.l1).unwrap(), fsdp.fully_shard("l2", model.l2).unwrap());
        let mut opt = sgd(fsdp.params());
        let x = data(pg.rank());
        let loss = fsdp.forward(|| mlp_loss(&l1, &l2, &x)).unwrap();
        opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
        (init, fsdp.full_state_dict().unwrap())
    });
    // The plain model from rank 0's initial values, its gradient averaged over the 3 ranks' data.
    let varmap = VarMap::new();
    let plain = mlp(&varmap);
    let vars: Vec<(String, Var)> = {
        let mut v: Vec<_> =
            varmap.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    for ((_, var), (_, t)) in vars.iter().zip(&out[0].0) {
        var.set(t).unwrap();
    }
    let mut avg: Vec<Tensor> = Vec::new();
    for rank in 0..3 {
        let grads = mlp_loss(&plain.l1, &plain.l2, &data(rank)).unwrap().backward().unwrap();
        for (i, (_, var)) in vars.iter().enumerate() {
            let g = (grads.get(var.as_tensor()).unwrap() / 3.0).unwrap();
            if rank == 0 {
                avg.push(g)
            } else {
                avg[i] = (&avg[i] + g).unwrap()
            }
        }
    }
    for (rank, (_, stepped)) in out.iter().enumerate() {
        for (((name, var), g), (got_name, got)) in vars.iter().zip(&avg).zip(stepped) {
            assert_eq!(name, got_name);
            let want = (var.as_tensor() - (g * 0.1).unwrap()).unwrap();
            let d = max_abs_diff(&want, got);
            assert!(d <= 1e-6, "rank {rank}: `{name}` is {d} from the plain model's step");
        }
    }
}

/// Between steps the model's variables hold nothing (their storage is freed); inside
/// `summon_full_params` they hold the full values, those `full_state_dict` returns.
#[test]
fn parameters_hold_values_only_while_gathered() {
    run_tcp_world(2, |pg| {
        let f = fixture(2);
        let varmap = VarMap::new();
        let (fsdp, gpt) = Gpt::new(&varmap, &f).shard(&varmap, &pg, options());
        let loss = fsdp.forward(|| gpt.loss(&tokens(&f, 0, pg.rank()))).unwrap();
        fsdp.backward(&loss).unwrap();
        let var = |name: &str| varmap.data().lock().unwrap()[name].clone();
        // A freed variable keeps its shape and tensor dtype; its storage is empty, of a dtype
        // no op computes with, so a read is an error (candle caches the dtype in the tensor).
        let freed = |name: &str| {
            let read = var(name).flatten_all().and_then(|t| t.to_vec1::<f32>());
            read.is_err_and(|e| e.to_string().to_ascii_lowercase().contains("f8e8m0"))
        };
        for name in ["wte.weight", "blocks.0.fc1.weight", "blocks.1.ln2.bias", "wpe.weight"] {
            assert!(freed(name), "`{name}` still holds its values");
        }
        let full = fsdp.full_state_dict().unwrap();
        fsdp.summon_full_params(|| {
            for (name, t) in &full {
                assert_eq!(max_abs_diff(var(name).as_tensor(), t), 0.0, "`{name}`");
            }
        })
        .unwrap();
        assert!(freed("wte.weight"), "summon_full_params left `wte.weight` gathered");
        let shards = fsdp.shards();
        let wte = &shards.iter().find(|s| s.name == "wte.weight").unwrap().var;
        assert_eq!(wte.dims(), [if pg.rank() == 0 { 19 } else { 18 }, DIM], "37 rows on 2 ranks");
    });
}

/// A block that also reads another block's weight: with units resharded after forward the read
/// fails in the forward, naming the unit and why; with units kept gathered it is caught in
/// backward, naming the parameter. Calls out of order are errors, not hangs.
#[test]
fn misuse_is_an_error_naming_the_unit_or_parameter() {
    run_tcp_world(2, |pg| {
        for reshard in [true, false] {
            let varmap = VarMap::new();
            let model = mlp(&varmap);
            let stolen = model.l1.weight().clone();
            let opts = FsdpOptions {
                units: Units::prefixes(["l1", "l2"]),
                reshard_after_forward: reshard,
                ..FsdpOptions::default()
            };
            let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
            let l1 = fsdp.fully_shard("l1", model.l1).unwrap();
            let l2 = model.l2;
            let x = data(pg.rank());
            let result = fsdp.forward(|| {
                let h = l1.forward(&x)?;
                let w = stolen.clone();
                let l2 = l2.clone();
                let y = fsdp
                    .run_unit("l2", &h, move |h| l2.forward(h)?.broadcast_add(&w.sum_all()?))
                    .map_err(candle_core::Error::wrap)?;
                y.sqr()?.mean_all()
            });
            if reshard {
                let e = result.unwrap_err().to_string();
                assert!(e.contains("unit `l2`") && e.contains("f8e8m0"), "{e}");
                fsdp.reshard().unwrap();
            } else {
                let e = fsdp.backward(&result.unwrap()).unwrap_err().to_string();
                assert!(e.contains("parameter `l1.weight` of unit `l1`"), "{e}");
            }
        }
        let varmap = VarMap::new();
        let model = mlp(&varmap);
        let opts = FsdpOptions { units: Units::prefixes(["l1"]), ..FsdpOptions::default() };
        let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
        let l1 = fsdp.fully_shard("l1", model.l1).unwrap();
        let e = l1.forward(&data(0)).unwrap_err().to_string();
        assert!(e.contains("unit `l1` ran outside Fsdp::forward"), "{e}");
        let e = fsdp.backward(&Tensor::new(1f32, &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(e.contains("without Fsdp::forward"), "{e}");
        let e = fsdp.fully_shard("l3", candle_nn::Activation::Relu).err().unwrap().to_string();
        assert_eq!(e, "no unit named `l3` (the units are `l1`)");
    });
}

/// Ranks given different models: every rank gets an error naming the parameter that differs,
/// before any parameter moves.
#[test]
fn ranks_with_different_models_are_told_which_parameter_differs() {
    let errors = run_tcp_world(2, |pg| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        candle_nn::linear(5, 7 - pg.rank(), vb.pp("l1")).unwrap();
        Fsdp::from_varmap(&varmap, &pg, FsdpOptions::default()).err().map(|e| e.to_string())
    });
    for e in errors {
        let e = e.expect("an error on every rank");
        assert_eq!(
            e,
            "rank 1 and rank 0 were given different models: parameter 0 is `l1.bias` [6] on rank \
             1, `l1.bias` [7] on rank 0"
        );
    }
}

/// HSDP on a 2x2 mesh (parameters sharded within a row, replicated across the rows) steps as
/// FSDP over the 4 ranks: the same averaged gradients, reduced in two stages.
#[test]
fn hsdp_on_a_two_by_two_mesh_steps_as_fsdp_over_four_ranks() {
    let out = run_tcp_world(4, |pg| {
        let run = |mesh: Option<&tandem_comm::DeviceMesh>| {
            let varmap = VarMap::new();
            let model = mlp(&varmap);
            // The same weights in both runs (candle's CPU initialisers are not seeded).
            for (n, var) in varmap.data().lock().unwrap().iter() {
                let v: Vec<f32> = (0..var.elem_count())
                    .map(|i| ((i * 31 + n.len() * 7) % 17) as f32 / 17.0 - 0.5)
                    .collect();
                var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
            }
            let opts =
                FsdpOptions { units: Units::prefixes(["l1", "l2"]), ..FsdpOptions::default() };
            let named = {
                use tandem_nn::ParamModule;
                tandem_nn::NamedVars::from_varmap(&varmap).named_parameters()
            };
            let fsdp = match mesh {
                Some(mesh) => Fsdp::on_mesh(named, mesh, opts).unwrap(),
                None => Fsdp::new(named, &pg, opts).unwrap(),
            };
            let (l1, l2) = (
                fsdp.fully_shard("l1", model.l1).unwrap(),
                fsdp.fully_shard("l2", model.l2).unwrap(),
            );
            let mut opt = sgd(fsdp.params());
            for step in 0..2 {
                let x = (data(pg.rank()) * (1.0 + step as f64)).unwrap();
                let loss = fsdp.forward(|| mlp_loss(&l1, &l2, &x)).unwrap();
                let mut grads = fsdp.backward(&loss).unwrap();
                fsdp.clip_grad_norm(&mut grads, 0.05).unwrap();
                opt.step(&grads).unwrap();
            }
            (fsdp.world_size(), fsdp.full_state_dict().unwrap())
        };
        let mesh =
            tandem_comm::DeviceMesh::new(&pg, &[2, 2], Some(&["replicate", "shard"])).unwrap();
        (run(Some(&mesh)), run(None))
    });
    for (rank, ((hsdp_world, hsdp), (fsdp_world, fsdp))) in out.iter().enumerate() {
        assert_eq!((*hsdp_world, *fsdp_world), (2, 4), "shards over a row of 2, or over all 4");
        for ((name, a), (_, b)) in hsdp.iter().zip(fsdp) {
            let d = max_abs_diff(a, b);
            assert!(d <= 1e-6, "rank {rank}: `{name}` is {d} from FSDP's over 4 ranks");
        }
    }
}

/// A unit holding a BatchNorm in training mode: its running statistics are updated once per
/// step, by the forward, not again when backward recomputes the unit.
#[test]
fn a_recomputed_unit_updates_batch_norm_statistics_once() {
    struct Bn(tandem_nn::FastBatchNorm2d);
    impl Module for Bn {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            candle_core::ModuleT::forward_t(&self.0, x, true)
        }
    }
    let tracked = run_tcp_world(2, |pg| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let lin = candle_nn::linear(5, 3, vb.pp("lin")).unwrap();
        let bn = Bn(tandem_nn::fast_batch_norm2d(3, vb.pp("bn")).unwrap());
        let opts = FsdpOptions {
            units: Units::prefixes(["bn"]),
            activation_checkpointing: true,
            ..FsdpOptions::default()
        };
        let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
        let bn = fsdp.fully_shard("bn", bn).unwrap();
        let x = data(pg.rank());
        let loss = fsdp
            .forward(|| bn.forward(&lin.forward(&x)?.reshape((4, 3, 1, 1))?)?.sqr()?.mean_all())
            .unwrap();
        fsdp.backward(&loss).unwrap();
        let count = bn.inner().0.num_batches_tracked().to_scalar::<i64>().unwrap();
        count
    });
    assert_eq!(tracked, [1, 1], "num_batches_tracked after one step, by rank");
}

/// FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`: inside a unit the weights are the master
/// shards rounded to bf16 (exactly), the all-gathers move half the bytes, gradients are
/// reduce-scattered in bf16 (one SGD step lands within bf16's rounding of the float32 step),
/// and the master weights stay float32: `full_state_dict` gathers them exactly.
#[test]
fn bf16_collectives_round_the_gathered_weights_and_keep_float32_masters() {
    use std::sync::{Arc, Mutex};
    use tandem_fsdp::MixedPrecisionPolicy;
    let out = run_tcp_world(2, |pg| {
        let step = |param_dtype: Option<DType>| {
            let varmap = VarMap::new();
            let model = mlp(&varmap);
            // The same weights in both runs, not bf16 values.
            let mut vars: Vec<(String, Var)> =
                varmap.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, (_, var)) in vars.iter().enumerate() {
                let n = var.elem_count();
                let v: Vec<f32> = (0..n).map(|i| ((i * 7 + k) as f32 * 0.37).sin() * 0.7).collect();
                var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap()).unwrap();
            }
            let mixed_precision = MixedPrecisionPolicy { param_dtype, reduce_dtype: None };
            let opts = FsdpOptions {
                units: Units::prefixes(["l1", "l2"]),
                shard_root: false,
                mixed_precision,
                ..FsdpOptions::default()
            };
            let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
            let init = fsdp.full_state_dict().unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (w1, l1) = (model.l1.weight().clone(), model.l1);
            let record = Arc::clone(&seen);
            let l2 = fsdp.fully_shard("l2", model.l2).unwrap();
            let x = data(pg.rank());
            let mut opt = sgd(fsdp.params());
            let loss = fsdp
                .forward(|| {
                    let h = fsdp
                        .run_unit("l1", &x, move |x| {
                            record.lock().unwrap().push(w1.flatten_all()?.to_vec1::<f32>()?);
                            l1.forward(x)
                        })
                        .map_err(candle_core::Error::wrap)?;
                    l2.forward(&h.tanh()?)?.sqr()?.mean_all()
                })
                .unwrap();
            opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
            let stats = fsdp.take_comm_stats();
            let seen = seen.lock().unwrap()[0].clone();
            (init, seen, fsdp.full_state_dict().unwrap(), stats.all_gather_bytes)
        };
        (step(None), step(Some(DType::BF16)))
    });
    for (rank, ((init, seen32, after32, bytes32), (init16, seen16, after16, bytes16))) in
        out.iter().enumerate()
    {
        let w1 = |sd: &[(String, Tensor)]| {
            let t = &sd.iter().find(|(n, _)| n == "l1.weight").unwrap().1;
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(w1(init), *seen32, "rank {rank}: float32 gathers are the weights");
        let rounded: Vec<f32> =
            w1(init16).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert_eq!(rounded, *seen16, "rank {rank}: bf16 gathers are the weights rounded");
        assert_ne!(w1(init16), rounded, "rank {rank}: the test's weights are not bf16 already");
        assert_eq!(w1(init), w1(init16), "the same initial weights");
        assert_eq!(*bytes16 * 2, *bytes32, "rank {rank}: bf16 all-gathers move half the bytes");
        for ((name, a), (_, b)) in after32.iter().zip(after16) {
            let d = max_abs_diff(a, b);
            assert!(d > 0.0 && d < 2e-3, "rank {rank}: `{name}` {d} from the float32 step");
            // Masters: the stepped values are float32, not bf16 roundings.
            let v = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(v.iter().any(|&x| half::bf16::from_f32(x).to_f32() != x), "{name}");
        }
    }
}

/// A policy moving a dtype the collectives do not carry is refused by name.
#[test]
fn a_mixed_precision_policy_of_another_dtype_is_refused() {
    run_tcp_world(1, |pg| {
        let varmap = VarMap::new();
        let _model = mlp(&varmap);
        let policy = tandem_fsdp::MixedPrecisionPolicy {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::U8),
        };
        let opts = FsdpOptions { mixed_precision: policy, ..FsdpOptions::default() };
        let err = Fsdp::from_varmap(&varmap, &pg, opts).err().unwrap().to_string();
        assert!(err.contains("reduce_dtype") && err.contains("U8"), "{err}");
    });
}

/// From the second step on, the unit the forward ran last stays gathered for its backward,
/// which runs first (one all-gather of it fewer per step: ViT-L's 340 MB head), and the
/// weights are those of a run that gathers it again: three SGD steps against FSDP2's plain
/// schedule (`reshard_after_forward` kept for the other unit).
#[test]
fn the_last_unit_of_the_forward_stays_gathered_for_its_backward() {
    let out = run_tcp_world(2, |pg| {
        let varmap = VarMap::new();
        let model = mlp(&varmap);
        fixed_weights(&varmap);
        let opts = FsdpOptions {
            units: Units::prefixes(["l1", "l2"]),
            shard_root: false,
            ..FsdpOptions::default()
        };
        let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
        let (l1, l2) =
            (fsdp.fully_shard("l1", model.l1).unwrap(), fsdp.fully_shard("l2", model.l2).unwrap());
        let mut opt = sgd(fsdp.params());
        let x = data(pg.rank());
        let mut gathers = Vec::new();
        for _ in 0..3 {
            let loss = fsdp.forward(|| mlp_loss(&l1, &l2, &x)).unwrap();
            opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
            gathers.push(fsdp.take_comm_stats().all_gathers);
        }
        (gathers, fsdp.full_state_dict().unwrap())
    });
    for (rank, (gathers, _)) in out.iter().enumerate() {
        // Two parameters a unit: forward l1, l2; backward l2 (again the first step), l1.
        assert_eq!(gathers, &[8, 6, 6], "rank {rank}: parameter all-gathers per step");
    }
    // The same weights everywhere, and a plain replica's: the kept unit's values are current.
    let plain = run_tcp_world(1, |pg| {
        let varmap = VarMap::new();
        let model = mlp(&varmap);
        fixed_weights(&varmap);
        let opts = FsdpOptions { shard_root: true, ..FsdpOptions::default() };
        let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
        let mut opt = sgd(fsdp.params());
        for _ in 0..3 {
            let loss = fsdp
                .forward(|| {
                    let (a, b) = (
                        mlp_loss(&model.l1, &model.l2, &data(0))?,
                        mlp_loss(&model.l1, &model.l2, &data(1))?,
                    );
                    (a + b)?.affine(0.5, 0.0)
                })
                .unwrap();
            opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
        }
        fsdp.full_state_dict().unwrap()
    });
    for (rank, (_, sd)) in out.iter().enumerate() {
        for ((name, a), (_, b)) in sd.iter().zip(&plain[0]) {
            let d = max_abs_diff(a, b);
            assert!(d <= 1e-6, "rank {rank}: `{name}` differs by {d} from the plain run");
        }
    }
}

/// The same weights in every process (candle's init draws them afresh).
fn fixed_weights(varmap: &VarMap) {
    let mut vars: Vec<(String, Var)> =
        varmap.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, (_, var)) in vars.iter().enumerate() {
        let v: Vec<f32> =
            (0..var.elem_count()).map(|i| ((i * 7 + k) as f32 * 0.37).sin() * 0.7).collect();
        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap()).unwrap();
    }
}

/// FSDP2 keeps a unit's graph from its forward to its backward: the unit runs once a step,
/// and its backward differentiates that graph after the parameters it read were freed and
/// gathered again. Under activation checkpointing it runs twice (backward recomputes it).
/// Both give the same weights, bit for bit.
#[test]
fn a_unit_runs_once_a_step_unless_activation_checkpointing_recomputes_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let out = run_tcp_world(2, |pg| {
        [false, true].map(|activation_checkpointing| {
            let varmap = VarMap::new();
            let model = mlp(&varmap);
            fixed_weights(&varmap);
            let opts = FsdpOptions {
                units: Units::prefixes(["l1", "l2"]),
                activation_checkpointing,
                ..FsdpOptions::default()
            };
            let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
            let mut opt = sgd(fsdp.params());
            let runs = Arc::new(AtomicUsize::new(0));
            let x = data(pg.rank());
            for _ in 0..3 {
                let loss = fsdp
                    .forward(|| {
                        let (l1, n) = (model.l1.clone(), Arc::clone(&runs));
                        let h = fsdp
                            .run_unit("l1", &x, move |x| {
                                n.fetch_add(1, Ordering::SeqCst);
                                l1.forward(x)?.tanh()
                            })
                            .map_err(candle_core::Error::wrap)?;
                        // l1 is resharded by now: its graph holds freed parameters.
                        let l2 = model.l2.clone();
                        let y = fsdp
                            .run_unit("l2", &h, move |h| l2.forward(h))
                            .map_err(candle_core::Error::wrap)?;
                        y.sqr()?.mean_all()
                    })
                    .unwrap();
                opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
            }
            (runs.load(Ordering::SeqCst), fsdp.full_state_dict().unwrap())
        })
    });
    for (rank, [(kept_runs, kept), (ac_runs, ac)]) in out.iter().enumerate() {
        assert_eq!((*kept_runs, *ac_runs), (3, 6), "rank {rank}: runs of unit l1 in 3 steps");
        for ((name, a), (_, b)) in kept.iter().zip(ac) {
            assert_eq!(max_abs_diff(a, b), 0.0, "rank {rank}: `{name}` differs");
        }
        let moved =
            kept.iter().map(|(_, w)| max_abs_diff(w, &w.zeros_like().unwrap())).sum::<f32>();
        assert!(moved > 0.0, "rank {rank}: trained weights");
    }
}
