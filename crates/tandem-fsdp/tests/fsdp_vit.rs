//! arcface_torch's ViT (tandem-models, fused linear layers, BatchNorm buffers in its head) with
//! a unit per block and one for the head (its BatchNorm inside) through `Vit::run_blocks_with`:
//! two SGD steps under `Fsdp` on 2 ranks give the weights two steps under `Ddp` give, from the
//! same seeded weights and batches, and rank 0's BatchNorm statistics (Ddp broadcasts rank 0's).
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use tandem_ddp::{Ddp, DdpOptions};
use tandem_fsdp::{Fsdp, FsdpOptions, Units};
use tandem_models::{Vit, VitConfig};
use tandem_nn::{NamedVars, ParamModule};
use tandem_optim::{SgdConfig, TorchSgd};
use tandem_testutil::run_tcp_world;

const CFG: VitConfig = VitConfig::new(32, 2, 0.0, 0.0);

fn seeded_vit() -> (VarMap, Vit) {
    let varmap = VarMap::new();
    let vit =
        Vit::new(CFG, 16, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu)).unwrap();
    Vit::reset_parameters(&NamedVars::from_varmap(&varmap).named_parameters(), 7).unwrap();
    (varmap, vit)
}

fn images(rank: usize, step: usize) -> Tensor {
    let n = 2 * 3 * 112 * 112;
    let v: Vec<f32> =
        (0..n).map(|i| (((i + rank * 131 + step * 17) * 37) % 97) as f32 / 48.0 - 1.0).collect();
    Tensor::from_vec(v, (2, 3, 112, 112), &Device::Cpu).unwrap()
}

fn sgd() -> SgdConfig {
    SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false }
}

#[test]
fn a_vit_under_fsdp_steps_as_under_ddp() {
    let out = run_tcp_world(2, |pg| {
        let (varmap, vit) = seeded_vit();
        let opts = DdpOptions { find_unused_parameters: true, ..DdpOptions::default() }; // mask_token: no masking
        let ddp = Ddp::from_varmap(&varmap, &pg, opts).unwrap();
        let mut opt = TorchSgd::new(NamedVars::from_varmap(&varmap).params(), sgd()).unwrap();
        for step in 0..2 {
            let loss = vit
                .forward_t(&images(pg.rank(), step), true)
                .unwrap()
                .sqr()
                .unwrap()
                .mean_all()
                .unwrap();
            opt.step(&ddp.backward(&loss).unwrap()).unwrap();
        }
        let ddp_weights = NamedVars::from_varmap(&varmap).named_parameters();
        let values = |named: Vec<(String, candle_core::Var)>| -> Vec<(String, Vec<f32>)> {
            let f32s =
                |v: &candle_core::Var| v.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            named.iter().map(|(n, v)| (n.clone(), f32s(v).to_vec1().unwrap())).collect()
        };
        let ddp_weights = values(ddp_weights);
        let ddp_buffers = values(NamedVars::from_varmap(&varmap).named_buffers());

        let (varmap, mut vit) = seeded_vit();
        let units = Units::by_name(Vit::unit_of);
        let fsdp = Fsdp::from_varmap(&varmap, &pg, FsdpOptions { units, ..FsdpOptions::default() })
            .unwrap();
        let runner = fsdp.clone();
        vit.run_blocks_with(Arc::new(move |name, x, f| {
            runner.run_unit(name, x, move |x| f(x)).map_err(candle_core::Error::wrap)
        }));
        let mut opt = TorchSgd::new(fsdp.params(), sgd()).unwrap();
        for step in 0..2 {
            let x = images(pg.rank(), step);
            let loss = fsdp.forward(|| vit.forward_t(&x, true)?.sqr()?.mean_all()).unwrap();
            opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
        }
        let fsdp_weights = fsdp.full_state_dict().unwrap();
        let fsdp_buffers = values(NamedVars::from_varmap(&varmap).named_buffers());
        (ddp_weights, fsdp_weights, ddp_buffers, fsdp_buffers)
    });
    // Rank 0's BatchNorm statistics: Ddp broadcasts them, Fsdp keeps each rank's own; the
    // head's recomputation in backward must not have counted its batches again.
    let (_, _, ddp_buffers, fsdp_buffers) = &out[0];
    assert!(ddp_buffers.iter().any(|(n, _)| n == "feature.1.num_batches_tracked"));
    for ((name, want), (_, got)) in ddp_buffers.iter().zip(fsdp_buffers) {
        let d = want.iter().zip(got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-5, "rank 0's `{name}` differs from Ddp's by {d}");
    }
    for (rank, (ddp, fsdp, _, _)) in out.iter().enumerate() {
        assert_eq!(ddp.len(), fsdp.len());
        for ((name, want), (got_name, got)) in ddp.iter().zip(fsdp) {
            assert_eq!(name, got_name);
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let d = want.iter().zip(&got).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(d <= 1e-5, "rank {rank}: `{name}` differs from Ddp's by {d}");
        }
    }
}
