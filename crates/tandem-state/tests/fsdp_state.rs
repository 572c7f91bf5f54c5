//! An `Fsdp` model's training state through `save_state`/`load_state`: saved by rows on 2
//! ranks, resumed on 3 (a parameter with a rank of no rows among them) it continues exactly as
//! the run that was never stopped; the checkpoint consolidates to the full state dict and the
//! optimizer's entries in torch's layout; a checkpoint of another model is refused naming the
//! file and the parameter.
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder, VarMap};
use tandem_checkpoint::Saved;
use tandem_ckpt::Value;
use tandem_fsdp::{Fsdp, FsdpOptions, FullyShard, Units};
use tandem_optim::{SgdConfig, TorchSgd};
use tandem_state::{FsdpShards, TrainingState};
use tandem_testutil::run_tcp_world;

struct Model {
    fsdp: Fsdp,
    l1: FullyShard<Linear>,
    l2: FullyShard<Linear>,
    opt: TorchSgd,
}

/// Two units, no root parameters; `hidden` sets the model's shapes.
fn model(pg: &tandem_comm::ProcessGroup, hidden: usize) -> Model {
    model_on(pg, None, hidden)
}

/// [`model`], sharded HSDP-style on `mesh` when given.
fn model_on(
    pg: &tandem_comm::ProcessGroup,
    mesh: Option<&tandem_comm::DeviceMesh>,
    hidden: usize,
) -> Model {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let l1 = candle_nn::linear(5, hidden, vb.pp("l1")).unwrap();
    let l2 = candle_nn::linear(hidden, 2, vb.pp("l2")).unwrap();
    // The same initial weights in every run (candle's CPU initialisers are not seeded).
    for (n, var) in varmap.data().lock().unwrap().iter() {
        let len = var.elem_count();
        let v: Vec<f32> =
            (0..len).map(|i| ((i * 31 + n.len() * 7) % 17) as f32 / 17.0 - 0.5).collect();
        var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
    }
    let opts = FsdpOptions { units: Units::prefixes(["l1", "l2"]), ..FsdpOptions::default() };
    let fsdp = match mesh {
        Some(mesh) => {
            use tandem_nn::ParamModule;
            let named = tandem_nn::NamedVars::from_varmap(&varmap).named_parameters();
            Fsdp::on_mesh(named, mesh, opts).unwrap()
        }
        None => Fsdp::from_varmap(&varmap, pg, opts).unwrap(),
    };
    let (l1, l2) = (fsdp.fully_shard("l1", l1).unwrap(), fsdp.fully_shard("l2", l2).unwrap());
    let cfg =
        SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    let opt = TorchSgd::new(fsdp.params(), cfg).unwrap();
    Model { fsdp, l1, l2, opt }
}

/// Step `k`'s batch, the same on every rank: the averaged gradient is the batch's on any world.
fn batch(k: usize) -> Tensor {
    let v: Vec<f32> = (0..20).map(|i| ((i * 7 + k * 13) % 11) as f32 / 5.0 - 1.0).collect();
    Tensor::from_vec(v, (4, 5), &Device::Cpu).unwrap()
}

fn train(m: &mut Model, steps: std::ops::Range<usize>) {
    for k in steps {
        let x = batch(k);
        let loss =
            m.fsdp.forward(|| m.l2.forward(&m.l1.forward(&x)?.tanh()?)?.sqr()?.mean_all()).unwrap();
        let grads = m.fsdp.backward(&loss).unwrap();
        m.opt.step(&grads).unwrap();
    }
}

fn save(m: &mut Model, pg: &tandem_comm::ProcessGroup, dir: &Path, step: u64) -> Option<PathBuf> {
    let mut shards = FsdpShards::new(&m.fsdp);
    let state = TrainingState::fsdp(&mut shards, &mut m.opt).step(step);
    tandem_state::save_state(pg, dir, &state).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn saved_on_two_ranks_resumed_on_three_continues_as_the_unstopped_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let straight = run_tcp_world(2, |pg| {
        let mut m = model(&pg, 7);
        train(&mut m, 0..5);
        m.fsdp.full_state_dict().unwrap()
    });
    let saved = run_tcp_world(2, move |pg| {
        let mut m = model(&pg, 7);
        train(&mut m, 0..3);
        let path = save(&mut m, &pg, &d, 3);
        (path, m.fsdp.full_state_dict().unwrap())
    });
    let d = dir.path().to_path_buf();
    let resumed = run_tcp_world(3, move |pg| {
        let mut m = model(&pg, 7);
        let mut shards = FsdpShards::new(&m.fsdp);
        let mut state = TrainingState::fsdp(&mut shards, &mut m.opt);
        let r = tandem_state::load_state(&d, &mut state).unwrap().expect("a checkpoint");
        let at_load = m.fsdp.full_state_dict().unwrap();
        train(&mut m, 3..5);
        (r, at_load, m.fsdp.full_state_dict().unwrap())
    });
    for (rank, (r, at_load, end)) in resumed.iter().enumerate() {
        assert_eq!((r.step, r.world_size), (3, 2));
        assert!(r.note.as_deref().unwrap_or("").contains("re-split from 2 ranks to 3"), "{r:?}");
        for (((name, a), (_, b)), ((_, c), (_, e))) in
            at_load.iter().zip(&saved[0].1).zip(end.iter().zip(&straight[0]))
        {
            assert_eq!(flat(a), flat(b), "rank {rank}: `{name}` as loaded");
            let d = flat(c).iter().zip(flat(e)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(d <= 1e-6, "rank {rank}: `{name}` is {d} from the unstopped run's");
        }
    }

    // The whole state as one dict: the full parameters, the momentum in torch's layout.
    let path = saved[0].0.clone().expect("rank 0 returns the checkpoint");
    let whole = Saved::open(&path).unwrap().consolidated().unwrap();
    for (name, t) in &saved[0].1 {
        let got = whole.get("model").and_then(|m| m.get(name)).and_then(Value::as_tensor);
        let got = got.unwrap_or_else(|| panic!("no model.{name}"));
        assert_eq!(got.shape, t.dims(), "`{name}`");
        assert_eq!(got.to_f32_vec(), flat(t), "`{name}`");
    }
    let state = whole.get("optimizer").and_then(|o| o.get("state")).unwrap();
    for (i, (name, t)) in saved[0].1.iter().enumerate() {
        let buf = state
            .get_int(i as i64)
            .and_then(|e| e.get("momentum_buffer"))
            .and_then(Value::as_tensor);
        assert_eq!(buf.map(|b| b.shape.clone()), Some(t.dims().to_vec()), "entry {i} (`{name}`)");
    }
}

#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    run_tcp_world(2, move |pg| {
        let mut m = model(&pg, 7);
        train(&mut m, 0..1);
        save(&mut m, &pg, &d, 1);
    });
    let d = dir.path().to_path_buf();
    let errors = run_tcp_world(2, move |pg| {
        let mut m = model(&pg, 6);
        let mut shards = FsdpShards::new(&m.fsdp);
        let mut state = TrainingState::fsdp(&mut shards, &mut m.opt);
        tandem_state::load_state(&d, &mut state).unwrap_err().to_string()
    });
    for e in errors {
        assert!(
            e.contains("epoch-0000-step-00000001")
                && e.contains("parameter `l1.bias`: 7 rows saved"),
            "{e}"
        );
    }
}

/// Runs fixtures/fsdp2_interop.py (`mode` load or save) on `world` ranks; its output, which
/// must start with `OK`.
fn torch(python: &Path, mode: &str, dcp: &Path, world: usize, k: usize, expected: &Path) -> String {
    let script = tandem_testutil::workspace_root()
        .join("crates/tandem-state/tests/fixtures/fsdp2_interop.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script).arg(mode).arg(dcp).args([world.to_string(), k.to_string()]).arg(expected);
    let out = tandem_testutil::output_with_deadline(&mut cmd, std::time::Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && text.starts_with("OK"),
        "PyTorch FSDP2 ({mode}, {world} ranks):\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The round trip with PyTorch FSDP2 across three world sizes: FSDP2 trains 5 steps on 2 ranks
/// and `dcp.save`s; tandem's Fsdp resumes from that directory on 3 ranks (each reading only its
/// rows' chunks), trains 5 steps and saves; `fsdp2_state_dict` (what `tandem ckpt convert
/// --to dcp` writes) loads into FSDP2 on 4 ranks (`dcp.load`, `set_model_state_dict`,
/// `set_optimizer_state_dict`), and FSDP2's next step equals tandem's next step. Skipped without
/// torch (unless TANDEM_REQUIRE_TORCH=1).
#[test]
fn torch_fsdp2_to_tandem_to_torch_fsdp2_across_world_sizes() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (from_torch, torch_next) =
        (dir.path().join("from_torch"), dir.path().join("torch_next.safetensors"));
    torch(&python, "save", &from_torch, 2, 5, &torch_next);
    let run = dir.path().join("run");
    let tandem_run = run_tcp_world(3, move |pg| {
        let mut m = model(&pg, 7);
        tandem_state::load_fsdp2_dcp(&from_torch, &m.fsdp, &mut m.opt).unwrap();
        train(&mut m, 5..6);
        let first = m.fsdp.full_state_dict().unwrap();
        train(&mut m, 6..10);
        let saved = save(&mut m, &pg, &run, 10);
        train(&mut m, 10..11);
        (saved, m.fsdp.full_state_dict().unwrap(), first)
    });
    // Resumed from PyTorch's checkpoint, tandem's first step is PyTorch's own next one.
    let want = candle_core::safetensors::load(&torch_next, &Device::Cpu).unwrap();
    for (rank, (_, _, first)) in tandem_run.iter().enumerate() {
        for (name, got) in first {
            let d = flat(got)
                .iter()
                .zip(flat(&want[name]))
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(d <= 1e-6, "rank {rank}: `{name}` is {d} from PyTorch FSDP2's next step");
        }
    }
    let expected = dir.path().join("tandem_next.safetensors");
    let next: std::collections::HashMap<String, Tensor> = tandem_run[0].1.iter().cloned().collect();
    candle_core::safetensors::save(&next, &expected).unwrap();

    let saved = Saved::open(tandem_run[0].0.as_ref().unwrap()).unwrap();
    let fsdp2 = tandem_state::fsdp2_state_dict(&saved).unwrap().expect("an Fsdp checkpoint");
    let to_torch = dir.path().join("to_torch");
    tandem_ckpt::dcp::save(&to_torch, &fsdp2.into_plain()).unwrap();
    let text = torch(&python, "load", &to_torch, 4, 10, &expected);
    eprintln!("PyTorch FSDP2's next step on 4 ranks vs tandem's on 3: max |diff| {}", text.trim());
}

/// HSDP's replicas hold the same shards: the checkpoint takes each row once (from the first
/// row of the mesh), and it resumes under plain FSDP on 3 ranks with the weights it saved.
#[test]
fn an_hsdp_checkpoint_holds_each_row_once_and_resumes_on_three_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let saved = run_tcp_world(4, move |pg| {
        let mesh = tandem_comm::DeviceMesh::new(&pg, &[2, 2], None).unwrap();
        let mut m = model_on(&pg, Some(&mesh), 7);
        train(&mut m, 0..2);
        save(&mut m, &pg, &d, 2);
        m.fsdp.full_state_dict().unwrap()
    });
    let d = dir.path().to_path_buf();
    let resumed = run_tcp_world(3, move |pg| {
        let mut m = model(&pg, 7);
        let mut shards = FsdpShards::new(&m.fsdp);
        tandem_state::load_state(&d, &mut TrainingState::fsdp(&mut shards, &mut m.opt)).unwrap();
        m.fsdp.full_state_dict().unwrap()
    });
    for (rank, weights) in resumed.iter().enumerate() {
        for ((name, got), (_, want)) in weights.iter().zip(&saved[0]) {
            assert_eq!(flat(got), flat(want), "rank {rank}: `{name}`");
        }
    }
}
