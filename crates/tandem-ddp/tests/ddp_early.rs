//! `DdpOptions::reduce_during_backward`: a VarMap model built of tandem-nn's fused layers
//! (arcface_torch's IResNet) hands its convolution and linear weights, its BatchNorm and PReLU
//! parameters to the all-reduce while backward runs (the BatchNorms fused with a convolution
//! follow after it), and the averaged gradients are the same bits as reducing after backward,
//! step after step; a model that uses a weight twice gets an error naming it, never a wrong
//! average.
mod common;

use candle_core::{DType, Device, Tensor};
use common::run_pg;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::IResNet;
use tandem_nn::OrderedVarMap;

/// One step's averaged gradients (in parameter order) and how many arrived during backward.
fn step(early: bool) -> Vec<(Vec<Vec<f32>>, usize, usize)> {
    run_pg(2, TransportKind::Tcp, move |comm| {
        let rank = comm.rank();
        let vars = OrderedVarMap::new();
        let model =
            IResNet::new(18, 4, 8, 0.0, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
        IResNet::reset_parameters(&vars.named(), 3).unwrap();
        let named = vars.named_vars().freeze(IResNet::FROZEN).unwrap();
        // Small buckets: several of them, so some can go while backward still runs.
        let opts = DdpOptions {
            bucket_cap_mb: 0.01,
            first_bucket_mb: 0.01,
            reduce_during_backward: early,
            ..DdpOptions::default()
        };
        let ddp = Ddp::new(named, &comm, opts).unwrap();
        let x = (Tensor::arange(0f32, (2 * 3 * 112 * 112) as f32, &Device::Cpu).unwrap() * 1e-4)
            .unwrap()
            .affine(1.0 + rank as f64, 0.0)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((2, 3, 112, 112))
            .unwrap();
        // Two steps: the second runs with the buckets rebuilt in arrival order.
        let mut out = (Vec::new(), 0, 0);
        for _ in 0..2 {
            let emb = model.forward_t(&x, true).unwrap();
            let loss = emb.sqr().unwrap().sum_all().unwrap();
            let grads = ddp.backward(&loss).unwrap();
            let params = ddp.params();
            let values: Vec<Vec<f32>> = params
                .iter()
                .map(|p| {
                    grads.get(p.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
                })
                .collect();
            out.0.extend(values);
            out.1 = ddp.grads_reduced_during_backward();
            out.2 = params.len();
        }
        out
    })
}

#[test]
fn fused_layers_hand_their_gradients_to_the_all_reduce_during_backward() {
    let after = step(false);
    let during = step(true);
    assert_eq!(after[0].1, 0, "no early gradients unless asked");
    for rank in 0..2 {
        let (count, params) = (during[rank].1, during[rank].2);
        // IResNet-18: 21 convolutions, 21 BatchNorms of which 12 fused with a convolution,
        // 9 PReLUs, fc weight and bias, the features BatchNorm's bias.
        assert!(count >= params / 2 && count < params, "rank {rank}: {count} of {params} early");
        assert_eq!(during[rank].0, after[rank].0, "rank {rank}: the same averaged bits");
    }
    assert_eq!(during[0].0, during[1].0, "both ranks hold the average");
}

#[test]
fn a_weight_used_twice_is_an_error_naming_it() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let vars = OrderedVarMap::new();
        let vb = vars.var_builder(DType::F32, &Device::Cpu);
        let shared = tandem_nn::fast_linear_no_bias(4, 4, vb.pp("shared")).unwrap();
        let head = tandem_nn::fast_linear_no_bias(4, 2, vb.pp("head")).unwrap();
        let opts = DdpOptions { reduce_during_backward: true, ..DdpOptions::default() };
        let ddp = Ddp::new(vars.named_vars(), &comm, opts).unwrap();
        let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu).unwrap();
        use candle_core::Module;
        let h = shared.forward(&shared.forward(&x).unwrap()).unwrap();
        let loss = head.forward(&h).unwrap().sum_all().unwrap();
        ddp.backward(&loss).err().map(|e| e.to_string())
    });
    for err in out {
        let err = err.expect("a weight used twice must not be averaged early");
        assert!(err.contains("shared.weight") && err.contains("more than once"), "{err}");
    }
}
