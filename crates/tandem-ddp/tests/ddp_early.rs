//! `DdpOptions::reduce_during_backward`: a VarMap model built of tandem-nn's fused layers
//! (arcface_torch's IResNet) hands its convolution and linear weights and its unfused
//! BatchNorms' parameters to the all-reduce while backward runs (the BatchNorms and PReLUs
//! fused with a convolution — a few values a channel — follow after it), and the averaged
//! gradients are the same bits as reducing after backward,
//! step after step; a model that uses a weight twice gets an error naming it, never a wrong
//! average. MobileFaceNet and the ViT (its blocks composed op by op or each one node) hand theirs
//! too.
mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::ModuleT;
use common::run_pg;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::{IResNet, MobileFaceNet, Vit, VitConfig};
use tandem_nn::OrderedVarMap;

/// arcface_torch's backbone families, small.
#[derive(Clone, Copy, Debug)]
enum Backbone {
    IResNet,
    MobileFaceNet,
    Vit,
    /// The ViT with each block one autograd node (the face recipe's).
    FusedVit,
}

/// One step's averaged gradients (in parameter order) and how many arrived during backward.
fn step(backbone: Backbone, early: bool) -> Vec<(Vec<Vec<f32>>, usize, usize)> {
    run_pg(2, TransportKind::Tcp, move |comm| {
        let rank = comm.rank();
        let vars = OrderedVarMap::new();
        let vb = vars.var_builder(DType::F32, &Device::Cpu);
        let (model, frozen): (Box<dyn ModuleT>, &[&str]) = match backbone {
            Backbone::IResNet => {
                let m = IResNet::new(18, 4, 8, 0.0, vb).unwrap();
                IResNet::reset_parameters(&vars.named(), 3).unwrap();
                (Box::new(m), IResNet::FROZEN)
            }
            Backbone::MobileFaceNet => {
                let m = MobileFaceNet::new([1, 1, 1, 1], 1, 8, vb).unwrap();
                MobileFaceNet::reset_parameters(&vars.named(), 3).unwrap();
                (Box::new(m), &[])
            }
            Backbone::Vit | Backbone::FusedVit => {
                let cfg = VitConfig::new(32, 2, 0.1, 0.1);
                let cfg = if matches!(backbone, Backbone::FusedVit) { cfg.fused() } else { cfg };
                let m = Vit::new(cfg, 8, vb).unwrap();
                Vit::reset_parameters(&vars.named(), 3).unwrap();
                (Box::new(m), &[])
            }
        };
        let named = vars.named_vars().freeze(frozen).unwrap();
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

/// The early count on each rank (equal on both), after checking that reducing during backward
/// gives the same averaged bits as reducing after it, and every rank holds the average.
fn early_count(backbone: Backbone) -> (usize, usize) {
    let after = step(backbone, false);
    let during = step(backbone, true);
    assert_eq!(after[0].1, 0, "{backbone:?}: no early gradients unless asked");
    for rank in 0..2 {
        assert_eq!(
            during[rank].0, after[rank].0,
            "{backbone:?} rank {rank}: the same averaged bits"
        );
    }
    assert_eq!(during[0].0, during[1].0, "{backbone:?}: both ranks hold the average");
    assert_eq!(during[0].1, during[1].1);
    (during[0].1, during[0].2)
}

#[test]
fn fused_layers_hand_their_gradients_to_the_all_reduce_during_backward() {
    // IResNet-18: the 21 convolutions' weights, each block's first BatchNorm (its input is
    // the block's: 8 x 2), the last BatchNorm2d (2), fc weight and bias, the features
    // BatchNorm's bias. The BatchNorms fused with the convolution before them (and their
    // PReLUs: conv -> BatchNorm -> PReLU is one op) go after backward, through the op's
    // `cat(γ, β, a)` operand.
    let (count, params) = early_count(Backbone::IResNet);
    assert_eq!(count, 21 + 16 + 2 + 2 + 1, "IResNet: {count} of {params} early");
}

#[test]
fn mobilefacenet_and_vit_reduce_during_backward_too() {
    // MobileFaceNet: every convolution's weight (22 at this size, depthwise ones included),
    // the linear layer's and the features BatchNorm1d's γ and β. Each BatchNorm2d follows a
    // convolution and is fused with it (and with its PReLU), so those ops' BatchNorm and
    // PReLU gradients are reduced after backward (as IResNet's).
    let (count, params) = early_count(Backbone::MobileFaceNet);
    assert_eq!(count, 22 + 1 + 2, "MobileFaceNet: {count} of {params} early");
    // ViT: all but pos_embed, mask_token and the patch convolution's weight (read through a
    // reshape), which backward reaches last anyway; the LayerNorms' included.
    let (count, params) = early_count(Backbone::Vit);
    assert_eq!(count, params - 3, "ViT: {count} of {params} early");
    // Each block one autograd node: its parameters' gradients go early all the same, and they
    // are the op-by-op model's bits.
    let (fused, _) = early_count(Backbone::FusedVit);
    assert_eq!(fused, count, "fused ViT: {fused} of {params} early");
    let (a, b) = (step(Backbone::Vit, true), step(Backbone::FusedVit, true));
    assert_eq!(a[0].0, b[0].0, "fused ViT: the op-by-op model's averaged gradients");
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
