//! PartialFc, the margins, the distributed cross-entropy and the differentiable all_gather
//! against PyTorch (tests/fixtures/make_fixtures.py, pip torch over 2 and 3 gloo ranks, C = 10
//! classes split 5/5 and 4/3/3): the loss, every rank's embedding gradients and centre
//! gradients at 1e-5, for ArcFace and CosFace, all centres and sampled ones (the fixture records
//! each rank's sampled index; the test replays it), the positive classes alone (arcface_torch's
//! `sample_rate = 0`), and inter-class filtering. Ranks are
//! threads over an in-process group.
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use serde_json::Value;
use tandem_comm::Collectives;
use tandem_comm::LocalGroup;
use tandem_dist_nn::{all_gather, GatherGrad};
use tandem_partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig, SampleRequest};

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/partial_fc.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn mat(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect()
}

fn tensor(v: &Value) -> Tensor {
    let m = mat(v);
    let (n, k) = (m.len(), m.first().map_or(0, Vec::len));
    Tensor::from_vec(m.into_iter().flatten().collect::<Vec<_>>(), (n, k), &Device::Cpu).unwrap()
}

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: row {i}");
        for (j, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{what}[{i}][{j}]: tandem {a}, torch {b}"
            );
        }
    }
}

/// Runs `f(rank's fixture, comm)` on one thread per rank over one in-process group.
fn on_ranks<R: Send + 'static>(
    ranks: &[Value],
    f: impl Fn(Value, Arc<dyn Collectives>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let ranks = ranks.to_vec();
    LocalGroup::run(ranks.len(), move |comm| f(ranks[comm.rank()].clone(), comm))
}

#[test]
fn all_gather_gradient_matches_torch_at_2_and_3_ranks() {
    let fx = fixture();
    for (world, ranks) in fx["worlds"].as_object().unwrap() {
        let ranks = ranks.as_array().unwrap();
        for mode in [GatherGrad::Sum, GatherGrad::SumTimesWorld] {
            let out = on_ranks(ranks, move |fx, comm| {
                let c = &fx["all_gather"];
                let x = Var::from_tensor(&tensor(&c["x"])).unwrap();
                let y = all_gather(x.as_tensor(), &comm, mode, "test").unwrap();
                let loss = y.mul(&tensor(&c["c"])).unwrap().sum_all().unwrap();
                let g = loss.backward().unwrap();
                (g.get(&x).unwrap().to_vec2::<f32>().unwrap(), mat(&c["grad_x"]))
            });
            let scale = if mode == GatherGrad::SumTimesWorld { ranks.len() as f32 } else { 1.0 };
            for (r, (got, want)) in out.iter().enumerate() {
                let want: Vec<Vec<f32>> =
                    want.iter().map(|row| row.iter().map(|v| v * scale).collect()).collect();
                assert_close(&format!("world {world} rank {r} {mode:?} grad x"), got, &want);
            }
        }
    }
}

struct Outcome {
    loss: f32,
    grad_embeddings: Vec<Vec<f32>>,
    grad_weight: Vec<Vec<f32>>,
    index: Vec<usize>,
}

fn run_case(fx: &Value, comm: Arc<dyn Collectives>, classes: usize, e: usize) -> Outcome {
    let m: Vec<f64> =
        fx["margin"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let margin = CombinedMarginLoss::new(m[0], m[1], m[2], m[3], m[4]).unwrap();
    let mut cfg = PartialFcConfig::new(classes, e, margin);
    cfg.sample_rate = fx["sample_rate"].as_f64().unwrap();
    let recorded: Vec<usize> =
        fx["index"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let replay = recorded.clone();
    let mut head = PartialFc::from_full_weight(cfg, comm, &tensor(&fx["weight_full"]))
        .unwrap()
        .with_sampler(move |_: &SampleRequest<'_>| replay.clone());
    let emb = Var::from_tensor(&tensor(&fx["embeddings"])).unwrap();
    let labels: Vec<i64> =
        fx["labels"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    let loss = head.forward(emb.as_tensor(), &labels).unwrap();
    let grads = loss.backward().unwrap();
    Outcome {
        loss: loss.to_vec0::<f32>().unwrap(),
        grad_embeddings: grads.get(&emb).unwrap().to_vec2().unwrap(),
        grad_weight: grads.get(head.weight()).unwrap().to_vec2().unwrap(),
        index: head.last_index().unwrap().to_vec(),
    }
}

#[test]
fn partial_fc_loss_and_gradients_match_torch() {
    let fx = fixture();
    let classes = fx["classes"].as_u64().unwrap() as usize;
    let e = fx["embedding"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for (world, ranks) in fx["worlds"].as_object().unwrap() {
        let ranks = ranks.as_array().unwrap();
        let cases = ranks[0]["partial_fc"].as_array().unwrap().len();
        for k in 0..cases {
            let per_rank: Vec<Value> = ranks.iter().map(|r| r["partial_fc"][k].clone()).collect();
            let name = per_rank[0]["name"].as_str().unwrap().to_string();
            let out = on_ranks(&per_rank, move |fx, comm| run_case(&fx, comm, classes, e));
            for (r, (o, fx)) in out.iter().zip(&per_rank).enumerate() {
                let what = format!("world {world} {name} rank {r}");
                let want = fx["loss"].as_f64().unwrap() as f32;
                assert!(
                    (o.loss - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{what} loss: {} vs {want}",
                    o.loss
                );
                let index: Vec<usize> = fx["index"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as usize)
                    .collect();
                assert_eq!(o.index, index, "{what}: sampled index");
                assert_close(
                    &format!("{what} embedding grad"),
                    &o.grad_embeddings,
                    &mat(&fx["grad_embeddings"]),
                );
                assert_close(
                    &format!("{what} centre grad"),
                    &o.grad_weight,
                    &mat(&fx["grad_weight"]),
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 6 * 2 + 6 * 3, "every case on every rank");
}
