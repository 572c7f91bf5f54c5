//! `save_state` / `load_state`: one call each way for model, optimizer (momentum buffers),
//! scheduler, loader position, step and epoch. A run stopped mid-epoch and restored into fresh
//! objects ends bitwise equal to an uninterrupted one; a checkpoint of another model is refused
//! naming the file and the field; an empty directory is a fresh start.
use std::sync::Arc;

use candle_core::Device;
use tandem::data::LoaderOptions;
use tandem::data::{datasets, DataLoader, Dataset, DistributedSampler, InMemoryDataset};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::models::Mlp;
use tandem::nn::ParamModule;
use tandem::optim::lr_scheduler::{LrScheduler, StepLR};
use tandem::optim::{SgdConfig, TorchOptimizer, TorchSgd};
use tandem::{load_state, save_state, TrainingState};

struct Run {
    ddp: Ddp<Mlp>,
    opt: TorchSgd,
    sched: StepLR,
    loader: DataLoader<InMemoryDataset>,
}

fn run(group: &tandem::comm::ProcessGroup, hidden: usize) -> Run {
    let (train, _) = datasets::digits().unwrap();
    let model =
        Mlp::new(&[train.input_dim(), hidden, train.num_classes()], 7, &Device::Cpu).unwrap();
    let ddp = Ddp::new(model, group, DdpOptions::default()).unwrap();
    let cfg = SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() };
    let opt = TorchSgd::new(ddp.params(), cfg).unwrap();
    let sched = StepLR::new(&[0.05], 3, 0.5).unwrap();
    let sampler = DistributedSampler::builder(train.len()).group(group).seed(3).build().unwrap();
    let loader =
        DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(64), Device::Cpu).unwrap();
    Run { ddp, opt, sched, loader }
}

/// Trains `steps` batches from the loader's current position (epoch by epoch), stepping the
/// scheduler at each epoch end. Returns the (step, epoch) reached.
fn train(r: &mut Run, mut step: u64, mut epoch: u64, steps: u64) -> (u64, u64) {
    let stop = step + steps;
    while step < stop {
        r.loader.set_epoch(epoch);
        let mut iter = r.loader.iter().unwrap();
        for batch in iter.by_ref() {
            let b = batch.unwrap();
            let g = r.ddp.backward(&r.ddp.hooked().loss(&b.x, &b.y).unwrap()).unwrap();
            r.opt.step(&g).unwrap();
            step += 1;
            if step == stop {
                break;
            }
        }
        drop(iter);
        if r.loader.state().epoch_complete() {
            r.sched.step_optimizer(&mut r.opt).unwrap();
            epoch += 1;
        }
    }
    (step, epoch)
}

fn weights(r: &Run) -> Vec<Vec<u32>> {
    r.ddp
        .named_tensors()
        .into_iter()
        .map(|(_, t)| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

#[test]
fn a_restored_run_ends_bitwise_equal_to_an_uninterrupted_one() {
    let group = tandem::comm::init_from(&tandem::comm::InitMethod::Single).unwrap();
    let dir = tempfile::tempdir().unwrap();

    let mut whole = run(&group, 16);
    train(&mut whole, 0, 0, 40);

    // 17 steps (mid-epoch: 24 batches per epoch), save, then restore into fresh objects.
    let mut first = run(&group, 16);
    let (step, epoch) = train(&mut first, 0, 0, 17);
    let st = TrainingState::new(&first.ddp, &mut first.opt)
        .scheduler(&mut first.sched)
        .loader(&mut first.loader)
        .step(step)
        .epoch(epoch);
    let path = save_state(&group, dir.path(), &st).unwrap().expect("rank 0 wrote");
    assert!(path.file_name().unwrap().to_str().unwrap().contains("step-00000017"));

    let mut second = run(&group, 16);
    let mut st = TrainingState::new(&second.ddp, &mut second.opt)
        .scheduler(&mut second.sched)
        .loader(&mut second.loader);
    let resumed = load_state(dir.path(), &mut st).unwrap().expect("a checkpoint");
    assert_eq!((resumed.step, resumed.epoch, resumed.world_size), (17, 0, 1));
    assert_eq!(resumed.path, path);
    assert_eq!(second.loader.state(), first.loader.state(), "loader position");
    assert_eq!(second.sched.last_epoch(), first.sched.last_epoch());
    train(&mut second, resumed.step, resumed.epoch, 40 - 17);
    assert_eq!(second.sched.last_epoch(), whole.sched.last_epoch());
    assert!(weights(&second) == weights(&whole), "restored run differs from the uninterrupted one");
}

#[test]
fn another_model_is_refused_naming_file_and_field_and_an_empty_dir_is_a_fresh_start() {
    let group = tandem::comm::init_from(&tandem::comm::InitMethod::Single).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut r = run(&group, 16);
    let mut st = TrainingState::new(&r.ddp, &mut r.opt);
    assert_eq!(load_state(dir.path(), &mut st).unwrap(), None);
    let path = save_state(&group, dir.path(), &st.epoch(1)).unwrap().unwrap();

    let mut other = run(&group, 24);
    let mut st = TrainingState::new(&other.ddp, &mut other.opt);
    let err = load_state(dir.path(), &mut st).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()) && err.contains("field `model`"), "{err}");
    assert!(err.contains("fc1.weight"), "{err}");
    // A scheduler asked for but not saved is named too.
    let mut st = TrainingState::new(&r.ddp, &mut r.opt).scheduler(&mut r.sched);
    let err = load_state(dir.path(), &mut st).unwrap_err().to_string();
    assert!(err.contains("field `scheduler`: missing"), "{err}");
}

/// A GradScaler handed to TrainingState is saved and restored with the rest; asked for but not
/// in the file, it is named.
#[test]
fn a_grad_scaler_is_saved_and_restored() {
    use tandem::optim::amp::{GradScaler, GradScalerConfig};
    let group = tandem::comm::init_from(&tandem::comm::InitMethod::Single).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut r = run(&group, 16);
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 256.0,
        growth_interval: 5,
        ..Default::default()
    })
    .unwrap();
    // Three clean steps and a skipped one: scale 128, tracker 0 after the skip; then two clean.
    let var = r.opt.params()[0].clone();
    for bad in [false, false, false, true, false, false] {
        let mut g = candle_core::backprop::GradStore::default();
        let v = if bad { f32::INFINITY } else { 0.0 };
        g.insert(
            var.as_tensor(),
            var.as_tensor().ones_like().unwrap().affine(0.0, v as f64).unwrap(),
        );
        scaler.step(&mut r.opt, &mut g).unwrap();
        scaler.update().unwrap();
    }
    assert_eq!((scaler.get_scale(), scaler.growth_tracker()), (128.0, 2));
    let st = TrainingState::new(&r.ddp, &mut r.opt).scaler(&mut scaler).step(6);
    save_state(&group, dir.path(), &st).unwrap();

    let mut fresh = GradScaler::new(GradScalerConfig::default()).unwrap();
    let mut r2 = run(&group, 16);
    let mut st = TrainingState::new(&r2.ddp, &mut r2.opt).scaler(&mut fresh);
    load_state(dir.path(), &mut st).unwrap().expect("a checkpoint");
    assert_eq!((fresh.get_scale(), fresh.growth_tracker()), (128.0, 2));
    assert_eq!(fresh.state_dict(), scaler.state_dict());

    let other = tempfile::tempdir().unwrap();
    save_state(&group, other.path(), &TrainingState::new(&r.ddp, &mut r.opt)).unwrap();
    // Written without a scaler (float32), resumed with one (f16): the scaler starts afresh
    // and the resume says so.
    let mut unsaved = GradScaler::new(GradScalerConfig::default()).unwrap();
    let before = unsaved.state_dict();
    let mut st = TrainingState::new(&r2.ddp, &mut r2.opt).scaler(&mut unsaved);
    let resumed = load_state(other.path(), &mut st).unwrap().expect("a checkpoint");
    let note = resumed.note.expect("a note about the missing scaler state");
    assert!(note.contains("no GradScaler state") && note.contains("65536"), "{note}");
    assert_eq!(unsaved.state_dict(), before);
}

/// Four parameters of different sizes, all ones.
#[cfg(feature = "zero")]
fn ones_params() -> Vec<candle_core::Var> {
    [&[4usize, 3][..], &[4], &[2, 4], &[2]]
        .iter()
        .map(|s| {
            candle_core::Var::from_tensor(
                &candle_core::Tensor::ones(*s, candle_core::DType::F32, &Device::Cpu).unwrap(),
            )
            .unwrap()
        })
        .collect()
}

#[cfg(feature = "zero")]
fn zero_sgd(
    ps: &[candle_core::Var],
    pg: &tandem::comm::ProcessGroup,
) -> tandem::optim::ZeroRedundancyOptimizer {
    tandem::optim::ZeroRedundancyOptimizer::new(ps.to_vec(), Arc::new(pg.clone()), |shard| {
        let cfg = SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() };
        Ok(Box::new(TorchSgd::new(shard, cfg)?))
    })
    .unwrap()
}

fn head(pg: &tandem::comm::ProcessGroup) -> tandem::partial_fc::PartialFc {
    use tandem::partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};
    let cfg = PartialFcConfig::new(10, 4, CombinedMarginLoss::arcface(64.0, 0.5));
    PartialFc::new(cfg, Arc::new(pg.clone()), &Device::Cpu).unwrap()
}

/// A sharded training state through `save_state` / `load_state_from`: ZeRO-1's optimizer
/// entries and a PartialFc head's rows (as a row shard) saved by 2 ranks, nothing gathered,
/// and loaded by 3, each reading only its rows and entries: the 3-rank state is the 2-rank one.
#[cfg(feature = "zero")]
#[test]
fn zero_shards_and_a_partial_fc_head_save_on_2_ranks_and_load_on_3() {
    use tandem::train::checkpoint::{Checkpointer, ShardDict};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let before = tandem_testutil::run_tcp_world(2, move |pg| {
        let ps = ones_params();
        let model = tandem::nn::NamedVars::new(
            ps.iter().enumerate().map(|(i, p)| (format!("p{i}"), p.clone())).collect(),
        );
        let mut opt = zero_sgd(&ps, &pg);
        for _ in 0..2 {
            let loss = ps
                .iter()
                .map(|p| p.as_tensor().sqr().unwrap().sum_all().unwrap())
                .reduce(|a, b| (a + b).unwrap())
                .unwrap();
            opt.step(&loss.backward().unwrap()).unwrap();
        }
        let head = head(&pg);
        // Distinct centres: row c is c + 0.25 everywhere.
        let split = head.split();
        let rows: Vec<f32> =
            (split.start..split.start + split.len).flat_map(|c| [c as f32 + 0.25; 4]).collect();
        let t = candle_core::Tensor::from_vec(rows, (split.len, 4), &Device::Cpu).unwrap();
        head.weight().set(&t).unwrap();
        let shard = ShardDict::rows("head", split.start, split.len, 10, head.state_dict().unwrap());
        let state = TrainingState::new(&model, &mut opt).step(2).epoch(1).shard(shard);
        save_state(&pg, &d, &state).unwrap();
        opt.consolidate_state_dict(0).unwrap();
        let weights: Vec<Vec<f32>> =
            ps.iter().map(|p| p.flatten_all().unwrap().to_vec1().unwrap()).collect();
        (opt.state_dict().ok(), weights)
    });
    let (want_opt, want_weights) = (before[0].0.clone().unwrap(), before[0].1.clone());
    // Rank 1's optimizer entries live in rank 1's file only; the head file of 2 ranks.
    let saved = Checkpointer::new(dir.path(), 3).latest().unwrap().unwrap();
    assert_eq!(saved.shard_names(), ["optimizer/state", "head"]);
    let d = dir.path().to_path_buf();
    let after = tandem_testutil::run_tcp_world(3, move |pg| {
        let ps = ones_params();
        let model = tandem::nn::NamedVars::new(
            ps.iter().enumerate().map(|(i, p)| (format!("p{i}"), p.clone())).collect(),
        );
        let mut opt = zero_sgd(&ps, &pg);
        let mut head = head(&pg);
        let saved = Checkpointer::new(&d, 3).latest().unwrap().unwrap();
        let mut state = TrainingState::new(&model, &mut opt);
        let resumed = tandem::load_state_from(&saved, &mut state).unwrap();
        assert_eq!((resumed.step, resumed.epoch, resumed.world_size), (2, 1, 2));
        let split = head.split();
        let parts = saved.read_row_parts("head", split.start..split.start + split.len).unwrap();
        head.load_state_dict(&parts.iter().collect::<Vec<_>>()).unwrap();
        let rows: Vec<f32> = head.weight().flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> =
            (split.start..split.start + split.len).flat_map(|c| [c as f32 + 0.25; 4]).collect();
        assert_eq!(rows, want, "rank {}'s head rows", pg.rank());
        opt.consolidate_state_dict(0).unwrap();
        let weights: Vec<Vec<f32>> =
            ps.iter().map(|p| p.flatten_all().unwrap().to_vec1().unwrap()).collect();
        (opt.state_dict().ok(), weights)
    });
    assert_eq!(after[0].0.as_ref(), Some(&want_opt), "the optimizer state re-split over 3 ranks");
    for (r, (_, w)) in after.iter().enumerate() {
        assert_eq!(w, &want_weights, "rank {r}'s weights");
    }
}

/// What one rank of [`parts_save_on_2_ranks_and_load_on_3`] ends with: its first class, its
/// head rows, their momentum, its BatchNorm-like statistic and the backbone's momentum.
type PartsSeen = (usize, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// A backbone parameter, a PartialFc head and a per-rank statistic, the optimizer stepped once
/// (momentum everywhere), as rank `pg.rank()` of a fresh run.
fn parts_run(
    pg: &tandem::comm::ProcessGroup,
) -> (
    tandem::nn::NamedVars,
    candle_core::Var,
    TorchSgd,
    tandem::partial_fc::PartialFc,
    candle_core::Var,
) {
    use candle_core::{Tensor, Var};
    let p0 =
        Var::from_tensor(&Tensor::ones(4, candle_core::DType::F32, &Device::Cpu).unwrap()).unwrap();
    let model = tandem::nn::NamedVars::new(vec![("p0".into(), p0.clone())]);
    let pfc = head(pg);
    let stat = Var::from_tensor(&Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let sgd = SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() };
    let groups = vec![(vec![p0.clone()], sgd.clone()), (vec![pfc.weight().clone()], sgd)];
    (model, p0, TorchSgd::with_groups(groups).unwrap(), pfc, stat)
}

/// The flattened values of `v`.
fn values(v: &candle_core::Tensor) -> Vec<f32> {
    v.flatten_all().unwrap().to_vec1().unwrap()
}

/// `momentum_buffer` of an optimizer state entry, flattened (empty without one).
fn momentum(entry: &tandem::ckpt::Value) -> Vec<f32> {
    entry
        .get("momentum_buffer")
        .and_then(tandem::ckpt::Value::as_tensor)
        .map_or(Vec::new(), |t| t.to_f32_vec())
}

/// State each rank holds alone, as `RankState` parts of the one `TrainingState`: a PartialFC
/// head's rows with their optimizer entry (`HeadPart`) and a per-rank statistic
/// (`RankBuffers`), saved by 2 ranks through `save_state` and loaded by 3 through
/// `load_state`. The head's entry leaves the replicated optimizer state; on 3 ranks every rank
/// has the rows and momentum the 2 ranks had for its classes, rank r the statistic of rank
/// min(r, 1), and the resume says the head was re-split.
#[test]
fn parts_save_on_2_ranks_and_load_on_3() {
    use tandem::recipes::face::{HeadPart, BUFFERS_SHARD};
    use tandem::train::checkpoint::Checkpointer;
    use tandem::train::RankBuffers;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let before: Vec<PartsSeen> = tandem_testutil::run_tcp_world(2, move |pg| {
        let (model, p0, mut opt, pfc, stat) = parts_run(&pg);
        let split = pfc.split();
        // Distinct centres (row c is c + 0.25), a rank's own statistic, one step of momentum.
        let rows: Vec<f32> =
            (split.start..split.start + split.len).flat_map(|c| [c as f32 + 0.25; 4]).collect();
        let w = candle_core::Tensor::from_vec(rows, (split.len, 4), &Device::Cpu).unwrap();
        pfc.weight().set(&w).unwrap();
        stat.set(&stat.affine(0.0, pg.rank() as f64 + 1.0).unwrap()).unwrap();
        let mut grads = candle_core::backprop::GradStore::default();
        grads.insert(p0.as_tensor(), p0.as_tensor().ones_like().unwrap());
        grads.insert(pfc.weight().as_tensor(), pfc.weight().as_tensor().copy().unwrap());
        opt.step(&grads).unwrap();
        let seen = (
            split.start,
            values(pfc.weight().as_tensor()),
            momentum(&opt.param_state(1).unwrap()),
            values(stat.as_tensor()),
            momentum(&opt.param_state(0).unwrap()),
        );
        let mut head = HeadPart::new(pfc, 1, pg.size(), None);
        let mut stats = RankBuffers::new(BUFFERS_SHARD, vec![("stat".into(), stat)], pg.rank());
        let state = TrainingState::new(&model, &mut opt).step(1).part(&mut head).part(&mut stats);
        save_state(&pg, &d, &state).unwrap();
        seen
    });
    let saved = Checkpointer::new(dir.path(), 3).latest().unwrap().unwrap();
    assert_eq!(saved.shard_names(), ["head", "buffers"]);
    let rep = saved.replicated().unwrap();
    let entries = rep.get("optimizer").and_then(|o| o.get("state")).unwrap();
    let held: Vec<i64> =
        entries.as_dict().unwrap().iter().filter_map(|(k, _)| k.as_int()).collect();
    assert_eq!(held, [0], "the head's entry went with its rows, not into the replicated part");

    let d = dir.path().to_path_buf();
    let after: Vec<(PartsSeen, Option<String>)> = tandem_testutil::run_tcp_world(3, move |pg| {
        let (model, _p0, mut opt, pfc, stat) = parts_run(&pg);
        let mut head = HeadPart::new(pfc, 1, pg.size(), None);
        let mut stats =
            RankBuffers::new(BUFFERS_SHARD, vec![("stat".into(), stat.clone())], pg.rank());
        let mut state = TrainingState::new(&model, &mut opt).part(&mut head).part(&mut stats);
        let resumed = load_state(&d, &mut state).unwrap().expect("a checkpoint");
        assert_eq!((resumed.step, resumed.world_size), (1, 2));
        let split = head.head.split();
        let seen = (
            split.start,
            values(head.head.weight().as_tensor()),
            momentum(&opt.param_state(1).unwrap()),
            values(stat.as_tensor()),
            momentum(&opt.param_state(0).unwrap()),
        );
        (seen, resumed.note)
    });
    // The 2 ranks' rows and momentum, whole.
    let whole = |f: fn(&PartsSeen) -> &Vec<f32>| -> Vec<f32> {
        before.iter().flat_map(|s| f(s).clone()).collect()
    };
    let (rows, moments) = (whole(|s| &s.1), whole(|s| &s.2));
    assert_eq!(rows.len(), 40);
    assert!(moments.iter().any(|&m| m != 0.0), "the head has momentum to carry");
    for (r, ((start, w, m, stat, m0), note)) in after.iter().enumerate() {
        let at = 4 * start..4 * start + w.len();
        assert_eq!(w, &rows[at.clone()], "rank {r}'s head rows");
        assert_eq!(m, &moments[at], "rank {r}'s head momentum");
        assert_eq!(stat, &before[r.min(1)].3, "rank {r}'s statistic");
        assert_eq!(m0, &before[0].4, "rank {r}'s backbone momentum");
        let note = note.as_deref().unwrap_or_default();
        assert!(note.contains("re-split"), "rank {r}: {note}");
    }
}
