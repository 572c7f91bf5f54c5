//! Uneven inputs (`Ddp::join`, PyTorch's `Join`): ranks with different numbers of batches
//! finish without a timeout, and training equals one process on the union of the batches the
//! active ranks had at each step.
mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use common::{data, max_abs_diff, run_local, run_pg, sgd_cfg, weights, DIMS};
use tandem_comm::Collectives;
use tandem_comm::TransportKind;
use tandem_ddp::{Ddp, DdpOptions, JoinOptions};
use tandem_models::Mlp;
use tandem_nn::{OrderedVarMap, ParamModule};
use tandem_optim::TorchSgd;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const BATCH: usize = 4;

/// Rank `rank`'s batch at step `step`.
fn batch(rank: usize, step: usize) -> (Tensor, Tensor) {
    data(BATCH, 1000 + 10 * rank as u64 + step as u64)
}

/// One process: at step t, the batches of the ranks that still have one, concatenated; the mean
/// loss over them scaled by (active / world) when dividing by the initial world size.
fn reference(counts: &[usize], divide_by_initial: bool) -> Vec<(String, Vec<f32>)> {
    let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
    let mut opt = TorchSgd::new(model.params(), sgd_cfg()).unwrap();
    let steps = counts.iter().copied().max().unwrap_or(0);
    for t in 0..steps {
        let active: Vec<usize> = (0..counts.len()).filter(|&r| counts[r] > t).collect();
        let (xs, ys): (Vec<Tensor>, Vec<Tensor>) = active.iter().map(|&r| batch(r, t)).unzip();
        let x = Tensor::cat(&xs, 0).unwrap();
        let y = Tensor::cat(&ys, 0).unwrap();
        let mut loss = model.loss(&x, &y).unwrap();
        if divide_by_initial {
            loss = (loss * (active.len() as f64 / counts.len() as f64)).unwrap();
        }
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    weights(&model)
}

fn train_uneven(
    comm: Arc<dyn Collectives>,
    counts: &[usize],
    opts: JoinOptions,
) -> Vec<(String, Vec<f32>)> {
    let rank = comm.rank();
    let model = Mlp::new(&DIMS, 7, &Device::Cpu).unwrap();
    let ddp = Ddp::with_comm(model, comm, DdpOptions::default()).unwrap();
    let mut opt = TorchSgd::new(ddp.module().params(), sgd_cfg()).unwrap();
    ddp.join(opts, |ddp| -> Result<(), BoxError> {
        for t in 0..counts[rank] {
            let (x, y) = batch(rank, t);
            let grads = ddp.backward(&ddp.hooked().loss(&x, &y)?)?;
            opt.step(&grads)?;
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let trained = weights(&*ddp.module());
    trained
}

fn check(results: &[Vec<(String, Vec<f32>)>], reference: &[(String, Vec<f32>)], what: &str) {
    for (rank, w) in results.iter().enumerate() {
        assert_eq!(
            max_abs_diff(w, &results[0]),
            0.0,
            "{what}: rank {rank} ends with other weights"
        );
        let diff = max_abs_diff(w, reference);
        assert!(diff < 2e-5, "{what}: rank {rank} differs from the union reference by {diff}");
    }
    let init = weights(&Mlp::new(&DIMS, 7, &Device::Cpu).unwrap());
    assert!(max_abs_diff(reference, &init) > 1e-3, "{what}: the reference must have trained");
}

#[test]
fn two_ranks_with_three_and_one_batches_train_like_the_union() {
    for divide in [false, true] {
        let counts = [3, 1];
        let opts = JoinOptions { divide_by_initial_world_size: divide };
        let results = run_local(2, move |comm| train_uneven(comm, &counts, opts));
        check(
            &results,
            &reference(&counts, divide),
            &format!("2 ranks, divide_by_initial {divide}"),
        );
    }
}

#[test]
fn three_process_group_ranks_with_two_four_and_one_batches_train_like_the_union() {
    let counts = [2, 4, 1];
    let opts = JoinOptions { divide_by_initial_world_size: false };
    let results = run_pg(3, TransportKind::Tcp, move |comm| train_uneven(comm, &counts, opts));
    check(&results, &reference(&counts, false), "3 ranks over TCP");
}

/// A stock candle-nn model on an OrderedVarMap (gradients reduced after backward), with rank 0
/// finishing first, so later steps take their bucket order and buffers from another rank.
#[test]
fn a_varmap_model_joins_too_and_rank_zero_may_finish_first() {
    let counts = [1, 3, 2];
    let values = |vars: &OrderedVarMap| -> Vec<(String, Vec<f32>)> {
        vars.named()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    };
    let build = || {
        let vars = OrderedVarMap::new();
        let vb = VarBuilder::from_backend(Box::new(vars.clone()), DType::F32, Device::Cpu);
        let fc: Linear = candle_nn::linear(DIMS[0], DIMS[3], vb.pp("fc")).unwrap();
        (vars, fc)
    };
    let results = run_local(3, move |comm| {
        let rank = comm.rank();
        let (vars, fc) = build();
        let ddp = Ddp::with_comm(vars.named_vars(), comm, DdpOptions::default()).unwrap();
        let initial = values(&vars);
        let mut opt = TorchSgd::new(vars.varmap().all_vars(), sgd_cfg()).unwrap();
        let opts = JoinOptions { divide_by_initial_world_size: false };
        ddp.join(opts, |ddp| -> Result<(), BoxError> {
            for t in 0..counts[rank] {
                let (x, y) = batch(rank, t);
                let loss = candle_nn::loss::cross_entropy(&fc.forward(&x)?, &y)?;
                opt.step(&ddp.backward(&loss)?)?;
            }
            Ok(())
        })
        .unwrap();
        (initial, values(&vars))
    });
    // One process from rank 0's initial values, on the union of the active ranks' batches.
    let (vars, fc) = build();
    for ((_, var), (_, v)) in vars.named().iter().zip(&results[0].0) {
        var.set(&Tensor::from_slice(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
    }
    let mut opt = TorchSgd::new(vars.varmap().all_vars(), sgd_cfg()).unwrap();
    for t in 0..3 {
        let active: Vec<usize> = (0..3).filter(|&r| counts[r] > t).collect();
        let (xs, ys): (Vec<Tensor>, Vec<Tensor>) = active.iter().map(|&r| batch(r, t)).unzip();
        let x = Tensor::cat(&xs, 0).unwrap();
        let loss =
            candle_nn::loss::cross_entropy(&fc.forward(&x).unwrap(), &Tensor::cat(&ys, 0).unwrap())
                .unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    let reference = values(&vars);
    assert!(max_abs_diff(&reference, &results[0].0) > 1e-3, "the reference must have trained");
    for (rank, (_, w)) in results.iter().enumerate() {
        let diff = max_abs_diff(w, &reference);
        assert!(diff < 2e-5, "rank {rank} differs from the union reference by {diff}");
    }
}
