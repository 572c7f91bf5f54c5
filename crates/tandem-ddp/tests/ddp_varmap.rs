//! Ddp around a stock candle-nn model (layers from a `VarBuilder` on a `VarMap`, nothing
//! tandem-specific in the model): rank 0's values everywhere, averaged gradients that candle-nn's
//! own optimizer steps with, training equal to one process on the union of the batches, and
//! BatchNorm statistics handled as buffers.
mod common;

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use candle_nn::{BatchNorm, Linear, Optimizer, VarBuilder, VarMap, SGD};
use common::run_pg;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpOptions};
use tandem_nn::ParamModule;
use tandem_optim::{SgdConfig, TorchSgd};

/// What a user already has: a candle-nn model built from a VarBuilder.
struct Net {
    fc1: Linear,
    bn: Option<BatchNorm>,
    fc2: Linear,
}

impl Net {
    fn new(vb: VarBuilder, with_bn: bool) -> candle_core::Result<Net> {
        Ok(Net {
            fc1: candle_nn::linear(6, 8, vb.pp("fc1"))?,
            bn: if with_bn { Some(candle_nn::batch_norm(8, 1e-5, vb.pp("bn"))?) } else { None },
            fc2: candle_nn::linear(8, 3, vb.pp("fc2"))?,
        })
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.fc1.forward(x)?;
        if let Some(bn) = &self.bn {
            h = bn.forward_t(&h, true)?;
        }
        let logits = self.fc2.forward(&h.relu()?)?;
        candle_nn::loss::cross_entropy(&logits, y)
    }
}

fn batch(step: usize, n: usize) -> (Tensor, Tensor) {
    let x = Tensor::arange(0f32, (n * 6) as f32, &Device::Cpu)
        .unwrap()
        .reshape((n, 6))
        .unwrap()
        .affine(0.013 * (step + 1) as f64, -0.4)
        .unwrap()
        .sin()
        .unwrap();
    let y: Vec<u32> = (0..n).map(|i| ((i + step) % 3) as u32).collect();
    (x, Tensor::new(y.as_slice(), &Device::Cpu).unwrap())
}

fn values(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let data = varmap.data().lock().unwrap();
    let mut v: Vec<_> = data
        .iter()
        .map(|(n, var)| (n.clone(), var.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

const STEPS: usize = 4;
const PER_RANK: usize = 5;

#[test]
fn a_varmap_model_trains_like_one_process_on_the_union_of_the_batches() {
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let out = run_pg(2, transport, |comm| {
            let rank = comm.rank();
            // Each rank initialises differently (candle's random init); Ddp makes them equal.
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let net = Net::new(vb, false).unwrap();
            let ddp = Ddp::from_varmap(&varmap, &comm, DdpOptions::default()).unwrap();
            let init = values(&varmap);
            let mut opt = SGD::new(varmap.all_vars(), 0.1).unwrap();
            for step in 0..STEPS {
                let (x, y) = batch(step, 2 * PER_RANK);
                let (x, y) = (
                    x.narrow(0, rank * PER_RANK, PER_RANK).unwrap(),
                    y.narrow(0, rank * PER_RANK, PER_RANK).unwrap(),
                );
                let grads = ddp.backward(&net.loss(&x, &y).unwrap()).unwrap();
                opt.step(&grads).unwrap();
            }
            (init, values(&varmap))
        });
        assert_eq!(
            out[0].0, out[1].0,
            "{transport:?}: construction must broadcast rank 0's values"
        );
        assert!(max_diff(&out[0].1, &out[1].1) == 0.0, "{transport:?}: ranks diverged");

        // One process, rank 0's initial values, the whole batch each step.
        let varmap = VarMap::new();
        let net =
            Net::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), false).unwrap();
        {
            let data = varmap.data().lock().unwrap();
            for (name, v) in &out[0].0 {
                let var = &data[name];
                var.set(&Tensor::from_slice(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
            }
        }
        let mut opt = SGD::new(varmap.all_vars(), 0.1).unwrap();
        for step in 0..STEPS {
            let (x, y) = batch(step, 2 * PER_RANK);
            opt.backward_step(&net.loss(&x, &y).unwrap()).unwrap();
        }
        let d = max_diff(&out[0].1, &values(&varmap));
        assert!(d < 1e-5, "{transport:?}: Ddp vs one process differ by {d}");
    }
}

#[test]
fn batchnorm_statistics_are_buffers_broadcast_from_rank0_and_torch_exact_optimizers_work() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let net =
            Net::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), true).unwrap();
        let ddp = Ddp::from_varmap(&varmap, &comm, DdpOptions::default()).unwrap();
        let buffers: Vec<String> = ddp.named_buffers().into_iter().map(|(n, _)| n).collect();
        assert_eq!(buffers, ["bn.running_mean", "bn.running_var"]);
        // Not parameters: no "received no gradient" error although they get none.
        let mut opt = TorchSgd::new(
            ddp.params(),
            SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() },
        )
        .unwrap();
        let mut stats_after_forward = Vec::new();
        for step in 0..3 {
            // Different data per rank, so the local statistics differ.
            let (x, y) = batch(step + 10 * rank, PER_RANK);
            let loss = net.loss(&x, &y).unwrap();
            stats_after_forward.push(values(&varmap));
            opt.step(&ddp.backward(&loss).unwrap()).unwrap();
        }
        (stats_after_forward, values(&varmap))
    });
    let stat = |v: &[(String, Vec<f32>)], name: &str| {
        v.iter().find(|(n, _)| n == name).map(|(_, x)| x.clone()).unwrap()
    };
    for name in ["bn.running_mean", "bn.running_var"] {
        // Before the broadcast the ranks' statistics differ; after it both hold rank 0's.
        assert_ne!(stat(&out[0].0[2], name), stat(&out[1].0[2], name));
        assert_eq!(stat(&out[0].1, name), stat(&out[1].1, name));
        assert_eq!(stat(&out[0].1, name), stat(&out[0].0[2], name));
    }
    assert!(max_diff(&out[0].1, &out[1].1) == 0.0, "parameters diverged");
}

#[test]
fn rank_local_parameters_keep_their_own_gradients_beside_the_averaged_model() {
    let out = run_pg(2, TransportKind::Tcp, |comm| {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let net =
            Net::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), false).unwrap();
        let ddp = Ddp::from_varmap(&varmap, &comm, DdpOptions::default()).unwrap();
        // A rank-local parameter (a model-parallel head's share): different on every rank.
        let local = candle_core::Var::new(&[1.0f32 + rank as f32, 2.0], &Device::Cpu).unwrap();
        let (x, y) = batch(0, 4);
        let x = x.narrow(0, rank * 2, 2).unwrap();
        let y = y.narrow(0, rank * 2, 2).unwrap();
        let loss = (net.loss(&x, &y).unwrap()
            + local.as_tensor().sqr().unwrap().sum_all().unwrap())
        .unwrap();
        let grads = ddp.backward_with_local(&loss, std::slice::from_ref(&local)).unwrap();
        let g_local: Vec<f32> = grads.get(local.as_tensor()).unwrap().to_vec1().unwrap();
        let fc2_bias = varmap.data().lock().unwrap()["fc2.bias"].clone();
        let g_model: Vec<f32> = grads.get(fc2_bias.as_tensor()).unwrap().to_vec1().unwrap();
        // One optimizer, two parameter groups.
        let sgd = SgdConfig { lr: 0.1, ..Default::default() };
        let mut opt = TorchSgd::with_groups(vec![
            (varmap.all_vars(), sgd.clone()),
            (vec![local.clone()], sgd),
        ])
        .unwrap();
        opt.step(&grads).unwrap();
        let refused = ddp
            .backward_with_local(&net.loss(&x, &y).unwrap(), &[varmap.all_vars()[0].clone()])
            .unwrap_err()
            .to_string();
        (g_local, g_model, local.as_tensor().to_vec1::<f32>().unwrap(), refused)
    });
    // d(sum local^2)/d local = 2 * local: this rank's own, not averaged with the other rank's.
    assert_eq!(out[0].0, [2.0, 4.0]);
    assert_eq!(out[1].0, [4.0, 4.0]);
    assert_eq!(out[0].1, out[1].1, "the model's gradients are averaged");
    assert_eq!(out[0].2, [0.8, 1.6]);
    assert_eq!(out[1].2, [1.6, 1.6]);
    assert!(out[0].3.contains("also a parameter of this Ddp model"), "{}", out[0].3);
}
