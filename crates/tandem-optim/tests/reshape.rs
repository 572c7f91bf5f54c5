//! What a model-parallel or sharded state needs of an optimizer when the world re-forms: a
//! parameter replaced by one of another shape (PartialFC's rows re-split), and a sharded
//! optimizer's owners in another world and its repartition (ZeRO-1's shards re-split); an
//! optimizer that cannot do either says so.
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use tandem_optim::zero::Partition;
use tandem_optim::{SgdConfig, TorchOptimizer, TorchSgd, ZeroRedundancyOptimizer};
use tandem_testutil::run_tcp_world;

fn var(shape: &[usize], value: f64) -> Var {
    let t = Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap().affine(0.0, value).unwrap();
    Var::from_tensor(&t).unwrap()
}

fn sgd() -> SgdConfig {
    SgdConfig { lr: 0.5, momentum: 0.9, ..SgdConfig::default() }
}

/// Steps `opt` with every parameter's gradient all ones.
fn step_ones(opt: &mut impl TorchOptimizer) {
    let mut grads = GradStore::default();
    for p in opt.params() {
        grads.insert(p.as_tensor(), p.as_tensor().ones_like().unwrap());
    }
    opt.step(&grads).unwrap();
}

#[test]
fn a_replaced_parameter_takes_another_shape_and_starts_without_state() {
    let (a, b) = (var(&[2, 2], 1.0), var(&[3], 1.0));
    let mut opt = TorchSgd::with_groups(vec![(vec![a], sgd()), (vec![b.clone()], sgd())]).unwrap();
    step_ones(&mut opt);
    assert!(opt.param_state(0).unwrap().get("momentum_buffer").is_some());
    // Parameter 0 becomes a [4, 2] one: no state until loaded; the other keeps its own.
    let bigger = var(&[4, 2], 2.0);
    opt.set_param(0, bigger.clone()).unwrap();
    assert_eq!(opt.param_state(0).unwrap(), tandem_ckpt::Value::None);
    assert!(opt.param_state(1).unwrap().get("momentum_buffer").is_some());
    assert_eq!(opt.params()[0].as_tensor().id(), bigger.as_tensor().id());
    assert_eq!(opt.params()[1].as_tensor().id(), b.as_tensor().id());
    // It steps as a fresh parameter: 2 - 0.5 * 1.
    step_ones(&mut opt);
    let got: Vec<f32> = bigger.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got, vec![1.5; 8]);
    // A state dict with an entry of the new shape loads.
    let sd = opt.state_dict().unwrap();
    let mut again = TorchSgd::with_groups(vec![
        (vec![var(&[4, 2], 0.0)], sgd()),
        (vec![var(&[3], 0.0)], sgd()),
    ])
    .unwrap();
    again.load_state_dict(&sd).unwrap();
    assert_eq!(again.state_dict().unwrap(), sd);
    // Out of range, or not floating point: refused by index.
    let e = opt.set_param(2, var(&[1], 0.0)).unwrap_err().to_string();
    assert!(e.contains('2') && e.contains("no such parameter"), "{e}");
    let ints = Var::from_tensor(&Tensor::zeros(2, DType::U32, &Device::Cpu).unwrap()).unwrap();
    let e = opt.set_param(1, ints).unwrap_err().to_string();
    assert!(e.contains("floating-point"), "{e}");
}

#[test]
fn only_a_sharded_optimizer_has_owners_and_repartitions() {
    let mut plain = TorchSgd::new(vec![var(&[2], 1.0)], sgd()).unwrap();
    assert_eq!(plain.owners_for(3), None);
    let e = plain.repartition(&plain.state_dict().unwrap()).unwrap_err().to_string();
    assert!(e.contains("not sharded"), "{e}");

    let owners = run_tcp_world(2, |pg| {
        let ps = vec![var(&[4, 3], 1.0), var(&[4], 1.0), var(&[2, 4], 1.0), var(&[2], 1.0)];
        let numels: Vec<usize> = ps.iter().map(|p| p.elem_count()).collect();
        let make = |shard| Ok(Box::new(TorchSgd::new(shard, sgd())?) as _);
        let mut zero = ZeroRedundancyOptimizer::new(ps, Arc::new(pg), make).unwrap();
        step_ones(&mut zero);
        let mine = zero.owned_params().unwrap();
        // The same world: the partition it has; another world: torch's split for it.
        assert_eq!(zero.owners_for(2).unwrap(), zero.partition().owner);
        assert_eq!(zero.owners_for(3).unwrap(), Partition::new(&numels, 3).owner);
        // Repartitioning over the same world with its own entries keeps its state.
        let shard = zero.shard().unwrap().unwrap();
        let full = tandem_optim::OptimizerShard::full(&shard.groups, shard.entries.clone());
        zero.repartition(&full).unwrap();
        let again = zero.shard().unwrap().unwrap();
        assert_eq!(again.entries, shard.entries);
        (mine, again.indices)
    });
    for (r, (mine, after)) in owners.iter().enumerate() {
        assert_eq!(mine, after, "rank {r} owns the same parameters after repartition");
    }
}
