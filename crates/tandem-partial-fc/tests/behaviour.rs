//! PartialFc's behaviour beyond the torch fixtures: a world of one equals normalised linear +
//! margin + plain cross-entropy; bad input on one rank is an error on every rank naming the
//! rank and value (never a hang); the head under bf16/f16 autocast with one GradScaler over
//! backbone and head; sparse updates at sample_rate < 1; centres initialised the same for any
//! world size; the same over real process groups (tandem-comm, TCP) as over threads.
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var, D};
use tandem_comm::Collectives;
use tandem_comm::{LocalGroup, SingleProcess};
use tandem_optim::amp::{GradScaler, GradScalerConfig};
use tandem_optim::{SgdConfig, TorchOptimizer, TorchSgd};
use tandem_partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig, PartialFcError};

fn randn(seed: u64, shape: (usize, usize)) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn on_ranks<R: Send + 'static>(
    n: usize,
    f: impl Fn(Arc<dyn Collectives>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    LocalGroup::run(n, f)
}

fn normalize(x: &Tensor) -> Tensor {
    let n = x.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap().maximum(1e-12).unwrap();
    x.broadcast_div(&n).unwrap()
}

fn max_gap(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_vec0().unwrap()
}

#[test]
fn one_rank_equals_normalised_linear_margin_and_plain_cross_entropy() {
    // s = 16: at 64 a target probability can underflow f32, where arcface_torch's loss (like
    // this one) clamps it at 1e-30 and plain cross-entropy does not.
    for margin in [CombinedMarginLoss::arcface(16.0, 0.5), CombinedMarginLoss::cosface(16.0, 0.4)] {
        let (c, e) = (7, 5);
        let full = randn(1, (c, e));
        let comm: Arc<dyn Collectives> = Arc::new(SingleProcess);
        let mut head =
            PartialFc::from_full_weight(PartialFcConfig::new(c, e, margin), comm, &full).unwrap();
        let emb = Var::from_tensor(&randn(2, (6, e))).unwrap();
        let labels = [0i64, 3, 6, 3, 1, 2];
        let loss = head.forward(emb.as_tensor(), &labels).unwrap();
        let g = loss.backward().unwrap();

        let w = Var::from_tensor(&full).unwrap();
        let emb2 = Var::from_tensor(emb.as_tensor()).unwrap();
        let logits =
            normalize(emb2.as_tensor()).matmul(&normalize(w.as_tensor()).t().unwrap()).unwrap();
        let logits = margin.forward(&logits.clamp(-1f32, 1f32).unwrap(), &labels).unwrap();
        let target = Tensor::new(&[0u32, 3, 6, 3, 1, 2], &Device::Cpu).unwrap();
        let plain = candle_nn_cross_entropy(&logits, &target);
        let g2 = plain.backward().unwrap();
        let (a, b): (f32, f32) = (loss.to_vec0().unwrap(), plain.to_vec0().unwrap());
        assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "{margin:?}: {a} vs {b}");
        assert!(max_gap(g.get(&emb).unwrap(), g2.get(&emb2).unwrap()) < 1e-5);
        assert!(max_gap(g.get(head.weight()).unwrap(), g2.get(&w).unwrap()) < 1e-5);
    }
}

/// Plain softmax cross-entropy, mean over rows (candle-nn's).
fn candle_nn_cross_entropy(logits: &Tensor, target: &Tensor) -> Tensor {
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1).unwrap();
    candle_nn::loss::nll(&lsm, target).unwrap()
}

/// Runs `bad(rank)`'s batch on 3 ranks and returns every rank's error, checking that all of
/// them fail within a few seconds.
fn every_rank_fails(bad: fn(usize) -> (Tensor, Vec<i64>)) -> Vec<String> {
    let start = Instant::now();
    let errors = on_ranks(3, move |comm| {
        let cfg = PartialFcConfig::new(10, 6, CombinedMarginLoss::arcface(64.0, 0.5));
        let mut head = PartialFc::new(cfg, comm.clone(), &Device::Cpu).unwrap();
        let (emb, labels) = bad(comm.rank());
        head.forward(&emb, &labels).map(|_| ()).unwrap_err()
    });
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    errors.iter().map(|e: &PartialFcError| e.to_string()).collect()
}

#[test]
fn bad_input_on_one_rank_is_an_error_on_every_rank_naming_it() {
    let wide = every_rank_fails(|r| (randn(r as u64, (4, if r == 1 { 7 } else { 6 })), vec![1; 4]));
    for e in &wide {
        assert!(e.contains("rank 1") && e.contains("size 7, expected 6"), "{e}");
    }
    let label =
        every_rank_fails(|r| (randn(r as u64, (4, 6)), vec![1, 2, if r == 2 { 10 } else { 3 }, 0]));
    for e in &label {
        assert!(
            e.contains("rank 2") && e.contains("label 10 at batch index 2 is outside 0..10"),
            "{e}"
        );
    }
    let negative =
        every_rank_fails(|r| (randn(r as u64, (2, 6)), vec![if r == 0 { -3 } else { 1 }, 0]));
    assert!(
        negative.iter().all(|e| e.contains("rank 0") && e.contains("label -3")),
        "{negative:?}"
    );
    let empty = every_rank_fails(|r| {
        let b = if r == 0 { 0 } else { 4 };
        (Tensor::zeros((b, 6), DType::F32, &Device::Cpu).unwrap(), vec![1; b])
    });
    for e in &empty {
        assert!(e.contains("rank 0") && e.contains("empty batch"), "{e}");
    }
    let uneven = every_rank_fails(|r| {
        let b = if r == 2 { 3 } else { 4 };
        (randn(r as u64, (b, 6)), vec![1; b])
    });
    for e in &uneven {
        assert!(e.contains("rank 2") && e.contains("batch of 3 but rank 0 has 4"), "{e}");
    }
    let mismatched =
        every_rank_fails(|r| (randn(r as u64, (4, 6)), vec![1; if r == 1 { 3 } else { 4 }]));
    for e in &mismatched {
        assert!(e.contains("rank 1") && e.contains("3 labels for a batch of 4"), "{e}");
    }
}

#[test]
fn autocast_head_trains_with_one_grad_scaler_over_backbone_and_head() {
    for dt in [DType::BF16, DType::F16] {
        let out = on_ranks(2, move |comm| {
            let backbone = Var::from_tensor(&randn(10 + comm.rank() as u64, (8, 6))).unwrap();
            let x = randn(20 + comm.rank() as u64, (4, 8));
            let labels: Vec<i64> =
                (0..4).map(|i| ((i * 3 + comm.rank() * 5) % 10) as i64).collect();
            let margin = CombinedMarginLoss::cosface(64.0, 0.4);
            let mut f32_cfg = PartialFcConfig::new(10, 6, margin);
            f32_cfg.seed = 3;
            let mut half_cfg = f32_cfg.clone();
            half_cfg.autocast = Some(dt);
            let mut reference = PartialFc::new(f32_cfg, comm.clone(), &Device::Cpu).unwrap();
            let mut head = PartialFc::new(half_cfg, comm.clone(), &Device::Cpu).unwrap();
            let emb = x.matmul(backbone.as_tensor()).unwrap();
            let want: f32 = reference.forward(&emb, &labels).unwrap().to_vec0().unwrap();
            let loss = head.forward(&emb, &labels).unwrap();
            assert_eq!(loss.dtype(), DType::F32, "logits go back to f32 before the margin");
            let got: f32 = loss.to_vec0().unwrap();
            let sgd =
                SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 5e-4, ..Default::default() };
            let mut opt = TorchSgd::with_groups(vec![
                (vec![backbone.clone()], sgd.clone()),
                (vec![head.weight().clone()], sgd),
            ])
            .unwrap();
            assert_eq!(opt.params().len(), 2);
            let mut scaler =
                GradScaler::new(GradScalerConfig { growth_interval: 100, ..Default::default() })
                    .unwrap();
            let before =
                (backbone.as_tensor().copy().unwrap(), head.weight().as_tensor().copy().unwrap());
            // Scaled f16 gradients can overflow at the initial scale 65536: those steps are skipped
            // and the scale backs off until one fits, as torch's GradScaler does.
            let mut skipped = 0;
            loop {
                let emb = x.matmul(backbone.as_tensor()).unwrap();
                let loss = head.forward(&emb, &labels).unwrap();
                let scale = scaler.get_scale();
                let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
                let stepped = scaler.step(&mut opt, &mut grads).unwrap();
                scaler.update().unwrap();
                if stepped {
                    break;
                }
                assert_eq!(scaler.get_scale(), scale * 0.5, "a skipped step backs the scale off");
                skipped += 1;
                assert!(skipped < 20, "never stepped");
            }
            let moved = (
                max_gap(&before.0, backbone.as_tensor()),
                max_gap(&before.1, head.weight().as_tensor()),
            );
            (want, got, skipped, moved)
        });
        for (r, (want, got, skipped, (b, h))) in out.into_iter().enumerate() {
            assert!((want - got).abs() < 0.02 * want.abs(), "{dt:?} rank {r}: {got} vs f32 {want}");
            if dt == DType::BF16 {
                assert_eq!(skipped, 0, "bf16 has f32's range: rank {r} skipped {skipped} step(s)");
            }
            assert!(b > 0.0 && h > 0.0, "{dt:?} rank {r}: backbone moved {b}, head moved {h}");
        }
    }
}

#[test]
fn sampled_steps_give_gradients_to_the_sampled_centres_only() {
    let out = on_ranks(2, |comm| {
        let mut cfg = PartialFcConfig::new(40, 6, CombinedMarginLoss::arcface(64.0, 0.5));
        cfg.sample_rate = 0.25;
        let mut head = PartialFc::new(cfg, comm.clone(), &Device::Cpu).unwrap();
        let emb = randn(comm.rank() as u64, (3, 6));
        let labels = [comm.rank() as i64, 21, 39];
        let g = head.forward(&emb, &labels).unwrap().backward().unwrap();
        let index = head.last_index().unwrap().to_vec();
        let rows: Vec<f32> =
            g.get(head.weight()).unwrap().abs().unwrap().sum(1).unwrap().to_vec1().unwrap();
        (head.split(), index, rows)
    });
    for (r, (split, index, rows)) in out.into_iter().enumerate() {
        assert_eq!((split.len, index.len()), (20, 5), "rank {r}: int(0.25 * 20) centres");
        // Positives: classes 0 and 1 live on rank 0; 21 and 39 on rank 1.
        let positives: Vec<usize> = if r == 0 { vec![0, 1] } else { vec![1, 19] };
        assert!(positives.iter().all(|p| index.contains(p)), "rank {r}: {index:?}");
        for (c, g) in rows.iter().enumerate() {
            assert_eq!(*g > 0.0, index.contains(&c), "rank {r} centre {c}: gradient {g}");
        }
    }
}

/// arcface_torch's `sample_rate = 0`: each rank's logits are the batch's positive classes it
/// holds, and a rank that holds none takes part with no centre at all (an empty logits block
/// in the distributed softmax): the loss is finite, the same on both ranks, and only positive
/// centres get a gradient.
#[test]
fn sample_rate_zero_keeps_the_positives_alone_even_none() {
    let out = on_ranks(2, |comm| {
        let mut cfg = PartialFcConfig::new(40, 6, CombinedMarginLoss::arcface(64.0, 0.5));
        cfg.sample_rate = 0.0;
        let mut head = PartialFc::new(cfg, comm.clone(), &Device::Cpu).unwrap();
        let emb = randn(comm.rank() as u64, (3, 6));
        // Every label lives on rank 0 (classes 0..20): rank 1 holds no positive.
        let labels = [comm.rank() as i64, 3, 17];
        let loss = head.forward(&emb, &labels).unwrap();
        let g = loss.backward().unwrap();
        let rows: Vec<f32> =
            g.get(head.weight()).unwrap().abs().unwrap().sum(1).unwrap().to_vec1().unwrap();
        (loss.to_vec0::<f32>().unwrap(), head.last_index().unwrap().to_vec(), rows)
    });
    let (l0, l1) = (out[0].0, out[1].0);
    assert!(l0.is_finite() && l0 == l1, "losses {l0} and {l1}");
    assert_eq!(out[0].1, [0, 1, 3, 17], "rank 0: its positives");
    assert!(out[1].1.is_empty(), "rank 1: no centre");
    for (c, g) in out[0].2.iter().enumerate() {
        assert_eq!(*g > 0.0, [0, 1, 3, 17].contains(&c), "rank 0 centre {c}: gradient {g}");
    }
    assert!(out[1].2.iter().all(|&g| g == 0.0), "rank 1's centres took no gradient");
}

#[test]
fn initial_centres_are_the_same_matrix_for_any_world_size() {
    let whole = |w: usize| -> Vec<Vec<f32>> {
        let parts = on_ranks(w, |comm| {
            let cfg = PartialFcConfig::new(10, 4, CombinedMarginLoss::arcface(64.0, 0.5));
            let head = PartialFc::new(cfg, comm, &Device::Cpu).unwrap();
            head.weight().as_tensor().to_vec2::<f32>().unwrap()
        });
        parts.into_iter().flatten().collect()
    };
    let one = whole(1);
    assert_eq!(one.len(), 10);
    assert_eq!(one, whole(3));
    let all: Vec<f32> = one.iter().flatten().copied().collect();
    let std = (all.iter().map(|v| v * v).sum::<f32>() / all.len() as f32).sqrt();
    assert!(std > 0.005 && std < 0.02, "N(0, 0.01): std {std}");
}

#[test]
fn real_process_groups_give_the_same_loss_as_threads() {
    let run = |comm: Arc<dyn Collectives>| {
        let mut cfg = PartialFcConfig::new(9, 5, CombinedMarginLoss::arcface(32.0, 0.5));
        cfg.seed = 11;
        let mut head = PartialFc::new(cfg, comm.clone(), &Device::Cpu).unwrap();
        let emb = Var::from_tensor(&randn(40 + comm.rank() as u64, (3, 5))).unwrap();
        let labels = [0i64, 4, 8];
        let loss = head.forward(emb.as_tensor(), &labels).unwrap();
        let g = loss.backward().unwrap();
        let ge: Vec<Vec<f32>> = g.get(&emb).unwrap().to_vec2().unwrap();
        (loss.to_vec0::<f32>().unwrap(), ge)
    };
    let threads = on_ranks(3, run);
    let procs = tandem_testutil::run_tcp_world(3, move |pg| run(Arc::new(pg)));
    for (r, (a, b)) in threads.iter().zip(&procs).enumerate() {
        assert!((a.0 - b.0).abs() < 1e-5, "rank {r}: {} vs {}", a.0, b.0);
        for (x, y) in a.1.iter().flatten().zip(b.1.iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "rank {r}");
        }
    }
}

/// A shard's state dict says which rows it holds: saved on 2 ranks, it loads on 3 and on 1
/// with each rank taking exactly the rows it owns now (bit for bit) and the step count; a
/// shard missing, or one of another head, is an error naming what is wrong.
#[test]
fn shards_saved_on_two_ranks_load_on_three_and_on_one() {
    let (c, e) = (7, 3);
    let full = randn(9, (c, e));
    let cfg = PartialFcConfig::new(c, e, CombinedMarginLoss::arcface(16.0, 0.5));
    let (cfg2, full2) = (cfg.clone(), full.clone());
    let shards = on_ranks(2, move |comm| {
        let mut head = PartialFc::from_full_weight(cfg2.clone(), comm, &full2).unwrap();
        head.set_steps_taken(5);
        head.state_dict().unwrap()
    });
    assert_eq!(shards[1].get("class_start").and_then(|v| v.as_int()), Some(4));
    for world in [3, 1] {
        let (cfg, full, shards) = (cfg.clone(), full.clone(), shards.clone());
        let loaded = on_ranks(world, move |comm| {
            let mut head = PartialFc::new(cfg.clone(), comm, &Device::Cpu).unwrap();
            head.load_state_dict(&shards.iter().collect::<Vec<_>>()).unwrap();
            let split = head.split();
            let want = full.narrow(0, split.start, split.len).unwrap();
            (max_gap(head.weight().as_tensor(), &want), head.steps_taken())
        });
        for (rank, (gap, steps)) in loaded.into_iter().enumerate() {
            assert_eq!((gap, steps), (0.0, 5), "world {world} rank {rank}");
        }
    }
    // Only the first shard: a one-rank head misses classes 4..7.
    let first = shards[0].clone();
    let e1 = on_ranks(1, move |comm| {
        let cfg = PartialFcConfig::new(7, 3, CombinedMarginLoss::arcface(16.0, 0.5));
        let mut head = PartialFc::new(cfg, comm, &Device::Cpu).unwrap();
        head.load_state_dict(&[&first]).unwrap_err().to_string()
    });
    assert!(e1[0].contains("classes 4..7 are in none of the 1 shard(s)"), "{}", e1[0]);
    // Another head's shard.
    let other = shards[0].clone();
    let e2 = on_ranks(1, move |comm| {
        let cfg = PartialFcConfig::new(7, 4, CombinedMarginLoss::arcface(16.0, 0.5));
        let mut head = PartialFc::new(cfg, comm, &Device::Cpu).unwrap();
        head.load_state_dict(&[&other]).unwrap_err().to_string()
    });
    assert!(e2[0].contains("shard 0 is of a [7, 3] head; this one is [7, 4]"), "{}", e2[0]);
}

/// `sparse_grad`: backward yields the sampled rows' gradient alone (no gradient of the weight
/// at all), and SGD stepping the weight from it with `set_grad_rows` gives the same weights and
/// momentum, bit for bit, as the dense gradient over three steps of different samples.
#[test]
fn sparse_grad_steps_the_head_as_the_dense_gradient_does() {
    let out = on_ranks(2, move |comm| {
        let mut results = Vec::new();
        for sparse in [false, true] {
            let mut cfg = PartialFcConfig::new(40, 6, CombinedMarginLoss::arcface(64.0, 0.5));
            cfg.sample_rate = 0.3;
            cfg.sparse_grad = sparse;
            let mut head = PartialFc::new(cfg, comm.clone(), &Device::Cpu).unwrap();
            let sgd =
                SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 5e-4, ..Default::default() };
            let mut opt = TorchSgd::new(vec![head.weight().clone()], sgd).unwrap();
            for step in 0..3u64 {
                let emb = randn(100 + 10 * step + comm.rank() as u64, (4, 6));
                let labels: Vec<i64> =
                    (0..4).map(|i| (i * 7 + step as i64 * 3 + comm.rank() as i64) % 40).collect();
                let loss = head.forward(&emb, &labels).unwrap();
                let leaf = head.grad_leaf();
                let mut grads = loss.backward().unwrap();
                match head.grad_rows() {
                    Some(rows) => {
                        assert!(sparse);
                        assert!(
                            grads.get(head.weight().as_tensor()).is_none(),
                            "a dense gradient exists"
                        );
                        let g = grads.remove(leaf.as_tensor()).expect("the sampled rows' gradient");
                        assert_eq!(g.dims(), [rows.len(), 6]);
                        assert!(rows.len() < 20, "sampled {} of 20 rows", rows.len());
                        grads.insert(head.weight().as_tensor(), g);
                        opt.set_grad_rows(0, rows).unwrap();
                    }
                    None => assert!(!sparse, "sparse_grad gave no rows"),
                }
                opt.step(&grads).unwrap();
            }
            let w: Vec<u32> = head
                .weight()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            results.push((w, opt.state_dict().unwrap()));
        }
        results
    });
    for (rank, r) in out.iter().enumerate() {
        assert!(r[0] == r[1], "rank {rank}: the sparse gradient's step differs from the dense one");
    }
}
