//! Against real PyTorch DDP: fixtures/ddp/torch_ddp_mlp.safetensors holds the initial weights,
//! each rank's data and the weights torch DDP reached after K SGD-momentum steps on 2 gloo ranks
//! (made by fixtures/ddp/make_torch_ddp.py). Two tandem Ddp ranks over real ProcessGroups,
//! starting from different weights (rank 0 has torch's init), must reach the same weights.
mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::*;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::Mlp;
use tandem_nn::ParamModule;
use tandem_optim::{SgdConfig, TorchSgd};

fn fixture() -> HashMap<String, Tensor> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ddp/torch_ddp_mlp.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn prefixed(f: &HashMap<String, Tensor>, prefix: &str) -> Vec<(String, Tensor)> {
    ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        .iter()
        .map(|n| (n.to_string(), f[&format!("{prefix}{n}")].clone()))
        .collect()
}

#[test]
fn two_rank_ddp_matches_torch_ddp_gloo_after_k_momentum_steps() {
    let f = fixture();
    let (steps, _, batch, _) = f["x"].dims4().unwrap();
    let out = run_pg(2, TransportKind::Tcp, move |comm| {
        let f = fixture();
        let rank = comm.rank();
        let model = Mlp::new(&[12, 16, 5], 99 + rank as u64, &Device::Cpu).unwrap();
        if rank == 0 {
            model.load_named_tensors(prefixed(&f, "init.")).unwrap();
        }
        let ddp = Ddp::with_comm(model, comm, DdpOptions::default()).unwrap();
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 1e-3,
            nesterov: false,
        };
        let mut opt = TorchSgd::new(ddp.params(), cfg).unwrap();
        for k in 0..steps {
            let x = f["x"].get(k).unwrap().get(rank).unwrap();
            let y = f["y"].get(k).unwrap().get(rank).unwrap().to_dtype(DType::U32).unwrap();
            assert_eq!(x.dims(), &[batch, 12]);
            let grads = ddp.backward(&ddp.hooked().loss(&x, &y).unwrap()).unwrap();
            opt.step(&grads).unwrap();
        }
        let w = weights(&*ddp.module());
        w
    });
    let want: Vec<(String, Vec<f32>)> = prefixed(&f, "final.")
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let init: Vec<(String, Vec<f32>)> = prefixed(&f, "init.")
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    assert!(max_abs_diff(&init, &want) > 1e-2, "fixture's training must move the weights");
    for (rank, w) in out.iter().enumerate() {
        let d = max_abs_diff(w, &want);
        eprintln!("rank {rank}: max abs weight difference {d:e}");
        assert!(d <= 1e-5, "rank {rank}: max |w_tandem - w_torch| = {d}");
    }
}
