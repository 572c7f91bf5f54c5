//! Interop with real PyTorch (skipped without torch unless TANDEM_REQUIRE_TORCH=1):
//! torch.load(weights_only=True) reads what tandem writes, and the four save/load combinations
//! (single -> single, single -> DDP, DDP -> single, DDP -> DDP) work in both directions.
mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::fixture;
use tandem_ckpt::keys::{load_state_dict, Renaming};
use tandem_ckpt::{load, save, ElemType, TensorData, TrainingCheckpoint, Value};
use tandem_testutil::{output_with_deadline, torch_python};

fn py(python: &Path, args: &[&str]) {
    let script = fixture("interop.py");
    let out = output_with_deadline(
        Command::new(python).arg(&script).args(args),
        Duration::from_secs(120),
    );
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "interop.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn target_names(dir: &Path, prefix: &str) -> Vec<(String, Vec<usize>, ElemType)> {
    let names: Vec<(String, Vec<usize>, String)> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("names.json")).unwrap()).unwrap();
    names
        .into_iter()
        .map(|(n, s, d)| {
            let dt = ElemType::ALL.into_iter().find(|x| x.torch_name() == d).unwrap();
            (format!("{prefix}{n}"), s, dt)
        })
        .collect()
}

#[test]
fn torch_loads_what_tandem_writes_for_every_fixture() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["compare".to_string()];
    for name in
        ["all_dtypes", "views", "nested", "all_dtypes_legacy", "views_legacy", "nested_legacy"]
    {
        let orig = fixture(&format!("{name}.pt"));
        let v = load(&orig).unwrap();
        let ours = dir.path().join(format!("{name}.pt"));
        save(&ours, &v).unwrap();
        // tandem reads its own output back identically...
        assert_eq!(load(&ours).unwrap(), v, "{name}");
        args.push(orig.to_str().unwrap().into());
        args.push(ours.to_str().unwrap().into());
    }
    // ...and so does torch, tree for tree, including strides, offsets and storage sharing.
    py(&python, &args.iter().map(String::as_str).collect::<Vec<_>>());
}

/// All four combinations, both directions, with one set of torch-made files.
#[test]
fn single_and_ddp_checkpoints_cross_between_torch_and_tandem() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    py(&python, &["make", dir.path().to_str().unwrap()]);
    torch_to_tandem(dir.path());
    tandem_to_torch(&python, dir.path());
}

fn torch_to_tandem(dir: &Path) {
    let reference = load(dir.join("single.pt")).unwrap();
    let cases = [
        ("single.pt", "(bare)"),
        ("ddp.pt", "(bare)"),
        ("ddp_in_dict.pt", "model"),
        ("dp_submodule.pt", "state_dict"),
        ("compiled.pt", "model_state_dict"),
        ("lightning.pt", "state_dict"),
    ];
    for (file, container) in cases {
        let src = load(dir.join(file)).unwrap();
        for target_prefix in ["", "module."] {
            let target = target_names(dir, target_prefix);
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
    let (_, report) =
        load_state_dict(&load(dir.join("ddp.pt")).unwrap(), &target_names(dir, ""), true).unwrap();
    assert_eq!(report.source_renaming, Renaming::StripWrappers);
    assert!(report.wrappings.iter().any(|w| w.contains("module.")), "{report}");
}

fn tandem_to_torch(python: &Path, dir: &Path) {
    let d = dir.to_str().unwrap().to_string();
    let reference = load(dir.join("single.pt")).unwrap();
    // "single": tandem's model holds canonical names; "ddp": its model's names carry `module.`.
    let ddp_named: Vec<(Value, Value)> = reference
        .as_dict()
        .unwrap()
        .iter()
        .map(|(k, v)| (Value::Str(format!("module.{}", k.as_str().unwrap())), v.clone()))
        .collect();
    let plain = dir.join("tandem_single.pt");
    save(&plain, &reference).unwrap();
    let ckpt = TrainingCheckpoint {
        epoch: 1,
        global_step: 10,
        model: Value::Dict(ddp_named),
        optimizer: Value::dict_from([
            ("state", Value::new_dict()),
            ("param_groups", Value::List(vec![])),
        ]),
        scheduler: Value::None,
        sampler: Value::dict_from([("epoch", Value::Int(1))]),
        rng: Value::dict_from([("seed", Value::Int(0))]),
        world_size: 2,
        config: Value::dict_from([("lr", Value::Float(0.1))]),
        scaler: Value::None,
    };
    let from_ddp = dir.join("checkpoint-step-10.pt");
    save(&from_ddp, &ckpt.to_value().unwrap()).unwrap();
    // The DDP-named state dict was saved with canonical keys.
    let saved = load(&from_ddp).unwrap();
    assert!(saved.get("model").unwrap().get("features.0.weight").is_some());
    py(python, &["load-into", &d, plain.to_str().unwrap(), from_ddp.to_str().unwrap()]);
}

#[test]
fn tied_tensors_written_by_tandem_stay_tied_in_torch() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let w = TensorData::from_f32(&[2, 2], &[1., 2., 3., 4.]);
    let row = TensorData { shape: vec![2], stride: vec![1], storage_offset: 2, ..w.clone() };
    let v = Value::dict_from([
        ("a", Value::Tensor(w.clone())),
        ("b", Value::Tensor(w)),
        ("row", Value::Tensor(row)),
    ]);
    let ours = dir.path().join("tied.pt");
    save(&ours, &v).unwrap();
    let check = "import sys,torch; d=torch.load(sys.argv[1],weights_only=True); \
                 p=lambda t: t.untyped_storage().data_ptr(); \
                 assert p(d['a'])==p(d['b'])==p(d['row']); d['a'][1,0]=9; \
                 assert d['b'][1,0]==9 and d['row'][0]==9 and d['row'].storage_offset()==2; print('OK')";
    let out = output_with_deadline(
        Command::new(&python).args(["-c", check, ours.to_str().unwrap()]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn safetensors_cross_between_tandem_and_the_python_library() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let orig = fixture("all_dtypes.pt");
    let ours = dir.path().join("ours.safetensors");
    let theirs = dir.path().join("theirs.safetensors");
    tandem_ckpt::safetensors::save(&ours, &load(&orig).unwrap()).unwrap();
    let script = "import sys, torch\n\
                  from safetensors.torch import load_file, save_file\n\
                  ref = torch.load(sys.argv[1], weights_only=True)\n\
                  got = load_file(sys.argv[2])\n\
                  assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))\n\
                  for k in ref:\n\
                  \x20   assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k\n\
                  save_file({k: v.contiguous() for k, v in ref.items()}, sys.argv[3])\n\
                  print('OK')\n";
    let out = output_with_deadline(
        Command::new(&python).args([
            "-c",
            script,
            orig.to_str().unwrap(),
            ours.to_str().unwrap(),
            theirs.to_str().unwrap(),
        ]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = load(&orig).unwrap();
    let got = load(&theirs).unwrap();
    for (k, v) in want.as_dict().unwrap() {
        let k = k.as_str().unwrap();
        assert_eq!(got.get(k), Some(v), "{k}");
    }
}
