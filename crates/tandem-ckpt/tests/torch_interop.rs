//! Interop with real PyTorch (skipped without torch unless TANDEM_REQUIRE_TORCH=1):
//! torch.load(weights_only=True) reads what tandem writes, and the four save/load combinations
//! (single -> single, single -> DDP, DDP -> single, DDP -> DDP) work in both directions.
mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::fixture;
use tandem_ckpt::keys::{load_state_dict, Renaming};
use tandem_ckpt::{load, save, CheckpointManager, DType, Tensor, TrainingCheckpoint, Value};
use tandem_testutil::{output_with_deadline, torch_python};

fn py(python: &Path, args: &[&str]) {
    let script = fixture("interop.py");
    let out = output_with_deadline(Command::new(python).arg(&script).args(args), Duration::from_secs(120));
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "interop.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn target_names(dir: &Path, prefix: &str) -> Vec<(String, Vec<usize>, DType)> {
    let names: Vec<(String, Vec<usize>, String)> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("names.json")).unwrap()).unwrap();
    names
        .into_iter()
        .map(|(n, s, d)| {
            let dt = DType::ALL.into_iter().find(|x| x.torch_name() == d).unwrap();
            (format!("{prefix}{n}"), s, dt)
        })
        .collect()
}

#[test]
fn torch_loads_what_tandem_writes_for_every_fixture() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    for name in ["all_dtypes", "views", "nested", "all_dtypes_legacy", "views_legacy", "nested_legacy"] {
        let orig = fixture(&format!("{name}.pt"));
        let v = load(&orig).unwrap();
        let ours = dir.path().join(format!("{name}.pt"));
        save(&ours, &v).unwrap();
        py(&python, &["compare", orig.to_str().unwrap(), ours.to_str().unwrap()]);
        // And tandem reads its own output back identically.
        assert_eq!(load(&ours).unwrap(), v, "{name}");
    }
}

#[test]
fn torch_saved_state_dicts_load_into_single_and_ddp_targets() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    py(&python, &["make", dir.path().to_str().unwrap()]);
    let reference = load(dir.path().join("single.pt")).unwrap();
    let cases = [
        ("single.pt", "(bare)"),
        ("ddp.pt", "(bare)"),
        ("ddp_in_dict.pt", "model"),
        ("dp_submodule.pt", "state_dict"),
        ("compiled.pt", "model_state_dict"),
        ("lightning.pt", "state_dict"),
    ];
    for (file, container) in cases {
        let src = load(dir.path().join(file)).unwrap();
        for target_prefix in ["", "module."] {
            let target = target_names(dir.path(), target_prefix);
            let (tensors, report) = load_state_dict(&src, &target, true)
                .unwrap_or_else(|e| panic!("{file} into target `{target_prefix}`: {e}"));
            assert_eq!(report.container, container, "{file}");
            assert_eq!(report.matched.len(), target.len(), "{file}: {report}");
            assert!(report.is_complete(), "{file}: {report}");
            for (name, t) in &tensors {
                let canonical = name.strip_prefix(target_prefix).unwrap();
                let want = reference.get(canonical).unwrap().as_tensor().unwrap();
                assert_eq!(t, want, "{file}: {name}");
            }
        }
    }
    // The renaming is reported: DDP keys into a plain model strip `module.`.
    let (_, report) = load_state_dict(&load(dir.path().join("ddp.pt")).unwrap(), &target_names(dir.path(), ""), true).unwrap();
    assert_eq!(report.source_renaming, Renaming::StripWrappers);
    assert!(report.wrappings.iter().any(|w| w.contains("module.")), "{report}");
}

#[test]
fn tandem_saved_checkpoints_load_into_torch_single_and_ddp() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    py(&python, &["make", &d]);
    let reference = load(dir.path().join("single.pt")).unwrap();
    // "single": tandem's model holds canonical names; "ddp": its model's names carry `module.`.
    let ddp_named: Vec<(Value, Value)> = reference
        .as_dict()
        .unwrap()
        .iter()
        .map(|(k, v)| (Value::Str(format!("module.{}", k.as_str().unwrap())), v.clone()))
        .collect();
    let plain = dir.path().join("tandem_single.pt");
    save(&plain, &reference).unwrap();
    let mgr = CheckpointManager::new(dir.path().join("ckpts"), 2);
    let ckpt = TrainingCheckpoint {
        epoch: 1,
        global_step: 10,
        model: Value::Dict(ddp_named),
        optimizer: Value::dict_from([("state", Value::new_dict()), ("param_groups", Value::List(vec![]))]),
        scheduler: Value::None,
        sampler: Value::dict_from([("epoch", Value::Int(1))]),
        rng: Value::dict_from([("seed", Value::Int(0))]),
        world_size: 2,
        config: Value::dict_from([("lr", Value::Float(0.1))]),
    };
    let from_ddp = mgr.save("step-10", &ckpt.to_value().unwrap()).unwrap();
    for file in [&plain, &from_ddp] {
        for how in ["single", "ddp"] {
            py(&python, &["load-into", &d, file.to_str().unwrap(), how]);
        }
    }
}

#[test]
fn tied_tensors_written_by_tandem_stay_tied_in_torch() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::from_f32(&[2, 2], &[1., 2., 3., 4.]);
    let row = Tensor { shape: vec![2], stride: vec![1], storage_offset: 2, ..w.clone() };
    let v = Value::dict_from([("a", Value::Tensor(w.clone())), ("b", Value::Tensor(w)), ("row", Value::Tensor(row))]);
    let ours = dir.path().join("tied.pt");
    save(&ours, &v).unwrap();
    let check = "import sys,torch; d=torch.load(sys.argv[1],weights_only=True); \
                 p=lambda t: t.untyped_storage().data_ptr(); \
                 assert p(d['a'])==p(d['b'])==p(d['row']); d['a'][1,0]=9; \
                 assert d['b'][1,0]==9 and d['row'][0]==9 and d['row'].storage_offset()==2; print('OK')";
    let out = output_with_deadline(Command::new(&python).args(["-c", check, ours.to_str().unwrap()]), Duration::from_secs(60));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
