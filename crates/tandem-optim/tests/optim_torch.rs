//! Optimizers against real torch output (fixtures made by
//! tests/fixtures/optim/make_fixtures.py with torch 2.15): parameter trajectories, state_dict
//! contents, resuming from a torch-made state_dict, and errors on state that does not fit.
mod torch_json;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use serde_json::Value as Json;
use tandem_ckpt::Value;
use tandem_optim::{
    AdamConfig, AdamWConfig, OptimError, Part, SgdConfig, TorchAdam, TorchAdamW, TorchOptimizer,
    TorchSgd,
};

const TOL: f64 = 1e-6;

fn fixture() -> Json {
    torch_json::fixture("optimizers.json")
}

use torch_json::decode;

fn tensor_of(j: &Json) -> Tensor {
    let shape: Vec<usize> =
        j["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    let data: Vec<f32> =
        j["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn vars_from(params: &Json) -> Vec<Var> {
    params.as_array().unwrap().iter().map(|p| Var::from_tensor(&tensor_of(p)).unwrap()).collect()
}

fn grads_for(vars: &[Var], step: &Json) -> GradStore {
    let mut store = GradStore::default();
    for (v, g) in vars.iter().zip(step.as_array().unwrap()) {
        if !g.is_null() {
            store.insert(v.as_tensor(), tensor_of(g));
        }
    }
    store
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= TOL * b.abs().max(1.0)
}

fn assert_params(vars: &[Var], expected: &Json, ctx: &str) {
    for (i, (v, e)) in vars.iter().zip(expected.as_array().unwrap()).enumerate() {
        let ours: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let theirs: Vec<f32> = tensor_of(e).flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{ctx}: param {i} size");
        for (k, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(close(*a as f64, *b as f64), "{ctx}: param {i}[{k}] = {a}, torch has {b}");
        }
    }
}

/// Same structure and keys as torch, numbers equal (ints and floats compare by value:
/// torch writes `0` or `0.0` depending on how the user spelled it), tensors within TOL.
fn assert_value_close(ours: &Value, torch: &Value, path: &str) {
    match (ours, torch) {
        (Value::Dict(a), Value::Dict(b)) => {
            // Key order is a Python-dict artifact (torch puts a group's user-given keys
            // first), so keys compare as sets; values by key.
            let sorted = |d: &[(Value, Value)]| {
                let mut k: Vec<String> = d.iter().map(|(k, _)| format!("{k:?}")).collect();
                k.sort();
                k
            };
            assert_eq!(sorted(a), sorted(b), "{path}: keys differ");
            for (k, va) in a {
                let vb = &b.iter().find(|(kb, _)| kb == k).unwrap().1;
                let name = match k {
                    Value::Str(s) => s.clone(),
                    Value::Int(i) => i.to_string(),
                    other => format!("{other:?}"),
                };
                assert_value_close(va, vb, &format!("{path}.{name}"));
            }
        }
        (Value::List(a), Value::List(b)) | (Value::Tuple(a), Value::Tuple(b)) => {
            assert_eq!(a.len(), b.len(), "{path}: lengths differ");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_value_close(x, y, &format!("{path}[{i}]"));
            }
        }
        (Value::Int(_) | Value::Float(_), Value::Int(_) | Value::Float(_)) => {
            let (x, y) = (ours.as_float().unwrap(), torch.as_float().unwrap());
            assert!(close(x, y), "{path}: {x} vs torch {y}");
        }
        (Value::Tensor(a), Value::Tensor(b)) => {
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{path}: dtype/shape");
            for (k, (x, y)) in a.to_f64_vec().iter().zip(b.to_f64_vec()).enumerate() {
                assert!(close(*x, y), "{path}[{k}]: {x} vs torch {y}");
            }
        }
        _ => assert_eq!(ours, torch, "{path}"),
    }
}

fn num(j: &Json, key: &str) -> Option<f64> {
    j.get(key).and_then(Json::as_f64)
}

fn boolean(j: &Json, key: &str) -> Option<bool> {
    j.get(key).and_then(Json::as_bool)
}

fn betas(j: &Json) -> Option<(f64, f64)> {
    j.get("betas").map(|b| (b[0].as_f64().unwrap(), b[1].as_f64().unwrap()))
}

/// The optimizer a fixture case describes, over `vars` (its groups hold param indices).
fn build(case: &Json, vars: &[Var]) -> Box<dyn TorchOptimizer> {
    let defaults = &case["defaults"];
    let pick = |g: &Json, k: &str| num(&g["options"], k).or(num(defaults, k));
    let pickb = |g: &Json, k: &str| boolean(&g["options"], k).or(boolean(defaults, k));
    let groups: Vec<(Vec<Var>, &Json)> = case["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["params"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| vars[i.as_u64().unwrap() as usize].clone())
                    .collect(),
                g,
            )
        })
        .collect();
    match case["optimizer"].as_str().unwrap() {
        "SGD" => {
            let d = SgdConfig::default();
            let groups = groups
                .into_iter()
                .map(|(p, g)| {
                    (
                        p,
                        SgdConfig {
                            lr: pick(g, "lr").unwrap_or(d.lr),
                            momentum: pick(g, "momentum").unwrap_or(d.momentum),
                            dampening: pick(g, "dampening").unwrap_or(d.dampening),
                            weight_decay: pick(g, "weight_decay").unwrap_or(d.weight_decay),
                            nesterov: pickb(g, "nesterov").unwrap_or(d.nesterov),
                        },
                    )
                })
                .collect();
            Box::new(TorchSgd::with_groups(groups).unwrap())
        }
        "Adam" => {
            let d = AdamConfig::default();
            let groups = groups
                .into_iter()
                .map(|(p, g)| {
                    (
                        p,
                        AdamConfig {
                            lr: pick(g, "lr").unwrap_or(d.lr),
                            betas: betas(&g["options"]).or(betas(defaults)).unwrap_or(d.betas),
                            eps: pick(g, "eps").unwrap_or(d.eps),
                            weight_decay: pick(g, "weight_decay").unwrap_or(d.weight_decay),
                            amsgrad: pickb(g, "amsgrad").unwrap_or(d.amsgrad),
                        },
                    )
                })
                .collect();
            Box::new(TorchAdam::with_groups(groups).unwrap())
        }
        "AdamW" => {
            let d = AdamWConfig::default();
            let groups = groups
                .into_iter()
                .map(|(p, g)| {
                    (
                        p,
                        AdamWConfig {
                            lr: pick(g, "lr").unwrap_or(d.lr),
                            betas: betas(&g["options"]).or(betas(defaults)).unwrap_or(d.betas),
                            eps: pick(g, "eps").unwrap_or(d.eps),
                            weight_decay: pick(g, "weight_decay").unwrap_or(d.weight_decay),
                            amsgrad: pickb(g, "amsgrad").unwrap_or(d.amsgrad),
                        },
                    )
                })
                .collect();
            Box::new(TorchAdamW::with_groups(groups).unwrap())
        }
        other => panic!("unknown optimizer {other}"),
    }
}

fn cases(fx: &Json) -> &Vec<Json> {
    fx["cases"].as_array().unwrap()
}

/// The committed fixtures are exactly what the installed torch makes (skips without torch,
/// unless TANDEM_REQUIRE_TORCH=1).
#[test]
fn fixtures_are_reproduced_by_torch() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    let dir = std::env::temp_dir().join(format!("tandem-optim-fixtures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/optim/make_fixtures.py");
    let out = tandem_testutil::output_with_deadline(
        std::process::Command::new(python).arg(script).arg(&dir),
        std::time::Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "make_fixtures.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in ["optimizers.json", "schedulers.json"] {
        let fresh: Json =
            serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap();
        let committed_path = format!("{}/tests/fixtures/optim/{name}", env!("CARGO_MANIFEST_DIR"));
        let committed: Json =
            serde_json::from_str(&std::fs::read_to_string(committed_path).unwrap()).unwrap();
        // Exact equality is only promised by the torch release that made the fixtures; another
        // release may add state_dict keys or round differently, which the other tests then show.
        if fresh["torch_version"] != committed["torch_version"] {
            eprintln!(
                "skipping exact fixture comparison: fixtures from torch {}, installed torch {}",
                committed["torch_version"], fresh["torch_version"]
            );
            continue;
        }
        assert!(
            fresh == committed,
            "{name} differs from what torch makes now; rerun make_fixtures.py"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fixture_covers_every_optimizer_variant() {
    let fx = fixture();
    let names: Vec<&str> = cases(&fx).iter().map(|c| c["name"].as_str().unwrap()).collect();
    for want in [
        "sgd_plain",
        "sgd_momentum",
        "sgd_nesterov",
        "sgd_dampening",
        "sgd_weight_decay",
        "adam",
        "adam_amsgrad",
        "adamw",
    ] {
        assert!(names.contains(&want), "fixture lacks {want}");
    }
    // The gradient sequence must include a step where a parameter has no gradient.
    assert!(fx["grads"].as_array().unwrap().iter().any(|s| s
        .as_array()
        .unwrap()
        .iter()
        .any(Json::is_null)));
}

#[test]
fn trajectories_match_torch() {
    let fx = fixture();
    for case in cases(&fx) {
        let name = case["name"].as_str().unwrap();
        let vars = vars_from(&fx["params_init"]);
        let mut opt = build(case, &vars);
        for (s, step) in fx["grads"].as_array().unwrap().iter().enumerate() {
            opt.step(&grads_for(&vars, step)).unwrap();
            assert_params(&vars, &case["params_after_step"][s], &format!("{name} step {}", s + 1));
        }
    }
}

#[test]
fn state_dicts_match_torch() {
    let fx = fixture();
    let resume_at = fx["resume_at"].as_u64().unwrap() as usize;
    for case in cases(&fx) {
        let name = case["name"].as_str().unwrap();
        let vars = vars_from(&fx["params_init"]);
        let mut opt = build(case, &vars);
        for (s, step) in fx["grads"].as_array().unwrap().iter().enumerate() {
            opt.step(&grads_for(&vars, step)).unwrap();
            if let Some(theirs) = case["state_dict_after"].get((s + 1).to_string()) {
                assert_value_close(
                    &opt.state_dict().unwrap(),
                    &decode(theirs),
                    &format!("{name}@{}", s + 1),
                );
            }
        }
        assert!(case["state_dict_after"].get(resume_at.to_string()).is_some());
    }
}

/// Loads torch's state_dict after step RESUME_AT into a freshly built optimizer (with a wrong
/// lr, so the test fails unless hyperparameters come from the loaded groups) and continues.
#[test]
fn resuming_from_torch_state_dict_continues_torch_trajectory() {
    let fx = fixture();
    let resume_at = fx["resume_at"].as_u64().unwrap() as usize;
    let steps = fx["grads"].as_array().unwrap();
    for case in cases(&fx) {
        let name = case["name"].as_str().unwrap();
        let vars = vars_from(&case["params_after_step"][resume_at - 1]);
        let mut opt = build(case, &vars);
        opt.set_lr(123.0);
        opt.load_state_dict(&decode(&case["state_dict_after"][resume_at.to_string()])).unwrap();
        for (s, step) in steps.iter().enumerate().skip(resume_at) {
            opt.step(&grads_for(&vars, step)).unwrap();
            assert_params(
                &vars,
                &case["params_after_step"][s],
                &format!("{name} resumed, step {}", s + 1),
            );
        }
        let last = steps.len().to_string();
        assert_value_close(
            &opt.state_dict().unwrap(),
            &decode(&case["state_dict_after"][last]),
            name,
        );
    }
}

#[test]
fn own_state_dict_round_trips_exactly() {
    let fx = fixture();
    for case in cases(&fx) {
        let vars = vars_from(&fx["params_init"]);
        let mut opt = build(case, &vars);
        for step in fx["grads"].as_array().unwrap().iter().take(2) {
            opt.step(&grads_for(&vars, step)).unwrap();
        }
        let sd = opt.state_dict().unwrap();
        let mut fresh = build(case, &vars);
        fresh.load_state_dict(&sd).unwrap();
        assert_eq!(fresh.state_dict().unwrap(), sd, "{}", case["name"]);
    }
}

#[test]
fn torch_defaults_give_torch_identical_param_groups() {
    // torch writes int 0 for defaults left alone (`momentum=0`); a default-built optimizer's
    // groups must equal torch's exactly, types included.
    let fx = fixture();
    let case = cases(&fx).iter().find(|c| c["name"] == "sgd_plain").unwrap();
    let vars = vars_from(&fx["params_init"]);
    let opt = TorchSgd::new(vars, SgdConfig { lr: 0.1, ..Default::default() }).unwrap();
    let theirs = decode(&case["state_dict_after"]["5"]);
    assert_eq!(opt.state_dict().unwrap().get("param_groups"), theirs.get("param_groups"));
}

fn sgd_momentum_state(vars: &[Var]) -> (TorchSgd, Value) {
    let mut opt =
        TorchSgd::new(vars.to_vec(), SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })
            .unwrap();
    let mut g = GradStore::default();
    for v in vars {
        g.insert(v.as_tensor(), v.as_tensor().ones_like().unwrap());
    }
    opt.step(&g).unwrap();
    let sd = opt.state_dict().unwrap();
    (opt, sd)
}

fn state_err(r: Result<(), OptimError>) -> (String, String) {
    match r {
        Err(OptimError::StateDict { of: Part::Optimizer, key, why }) => (key, why),
        other => panic!("expected a state_dict error, got {other:?}"),
    }
}

#[test]
fn mismatched_state_dicts_are_refused_with_the_key_at_fault() {
    let fx = fixture();
    let vars = vars_from(&fx["params_init"]);
    let (mut opt, sd) = sgd_momentum_state(&vars);
    let before = opt.state_dict().unwrap();

    // Another optimizer's state.
    let adam = cases(&fx).iter().find(|c| c["name"] == "adam").unwrap();
    let (key, why) = state_err(opt.load_state_dict(&decode(&adam["state_dict_after"]["5"])));
    assert_eq!(key, "state.0");
    assert!(why.contains("exp_avg") || why.contains("step"), "{why}");

    // One parameter fewer.
    let (mut small, _) = sgd_momentum_state(&vars[..1]);
    let (key, why) = state_err(small.load_state_dict(&sd));
    assert_eq!(key, "param_groups.0.params");
    assert!(why.contains('2') && why.contains('1'), "{why}");

    // Same count, different shapes.
    let other = vec![
        Var::from_tensor(&Tensor::zeros((3, 2), candle_core::DType::F32, &Device::Cpu).unwrap())
            .unwrap(),
        vars[1].clone(),
    ];
    let (mut shaped, _) = sgd_momentum_state(&other);
    let (key, why) = state_err(shaped.load_state_dict(&sd));
    assert_eq!(key, "state.0.momentum_buffer");
    assert!(why.contains("[2, 3]") && why.contains("[3, 2]"), "{why}");

    // Two groups saved, one group here.
    let two = cases(&fx).iter().find(|c| c["name"] == "sgd_two_groups").unwrap();
    let (key, _) = state_err(opt.load_state_dict(&decode(&two["state_dict_after"]["5"])));
    assert_eq!(key, "param_groups");

    // A bad hyperparameter type and an unsupported torch feature.
    let mut bad = sd.clone();
    if let Value::List(groups) = bad.get_mut("param_groups").unwrap() {
        groups[0].insert("lr", "fast");
    }
    assert_eq!(state_err(opt.load_state_dict(&bad)).0, "param_groups.0.lr");
    let mut maximize = sd.clone();
    if let Value::List(groups) = maximize.get_mut("param_groups").unwrap() {
        groups[0].insert("maximize", true);
    }
    assert_eq!(state_err(opt.load_state_dict(&maximize)).0, "param_groups.0.maximize");

    // State for an index no group lists.
    let mut stray = sd.clone();
    if let Some(Value::Dict(state)) = stray.get_mut("state") {
        let entry = state[0].1.clone();
        state.push((Value::Int(7), entry));
    }
    assert_eq!(state_err(opt.load_state_dict(&stray)).0, "state.7");

    // Failed loads changed nothing.
    assert_eq!(opt.state_dict().unwrap(), before);
}

#[test]
fn invalid_hyperparameters_are_refused() {
    let vars = vars_from(&fixture()["params_init"]);
    let nesterov_damp =
        SgdConfig { lr: 0.1, momentum: 0.9, dampening: 0.1, nesterov: true, ..Default::default() };
    assert!(matches!(
        TorchSgd::new(vars.clone(), nesterov_damp),
        Err(OptimError::InvalidConfig { name: "nesterov", .. })
    ));
    assert!(matches!(
        TorchSgd::new(vars.clone(), SgdConfig { lr: -1.0, ..Default::default() }),
        Err(OptimError::InvalidConfig { name: "lr", .. })
    ));
    assert!(matches!(
        TorchAdam::new(vars.clone(), AdamConfig { betas: (1.0, 0.999), ..Default::default() }),
        Err(OptimError::InvalidConfig { name: "betas[0]", .. })
    ));
    assert!(matches!(
        TorchAdamW::new(vars.clone(), AdamWConfig { eps: f64::NAN, ..Default::default() }),
        Err(OptimError::InvalidConfig { name: "eps", .. })
    ));
    assert!(matches!(
        TorchSgd::new(vec![], SgdConfig::default()),
        Err(OptimError::InvalidConfig { name: "params", .. })
    ));
    let int_param = Var::from_tensor(&Tensor::new(&[1i64, 2], &Device::Cpu).unwrap()).unwrap();
    assert!(matches!(
        TorchSgd::new(vec![int_param], SgdConfig::default()),
        Err(OptimError::InvalidParam { index: 0, .. })
    ));
    assert!(matches!(
        TorchSgd::new(vec![vars[0].clone(), vars[0].clone()], SgdConfig::default()),
        Err(OptimError::InvalidParam { index: 1, .. })
    ));
}

#[test]
fn learning_rates_per_group_and_gradient_shape_errors() {
    let fx = fixture();
    let vars = vars_from(&fx["params_init"]);
    let mut opt = TorchAdamW::with_groups(vec![
        (vec![vars[0].clone()], AdamWConfig { lr: 0.1, ..Default::default() }),
        (vec![vars[1].clone()], AdamWConfig { lr: 0.2, ..Default::default() }),
    ])
    .unwrap();
    assert_eq!(opt.group_lrs(), vec![0.1, 0.2]);
    assert!(opt.set_group_lrs(&[1.0]).is_err());
    opt.set_group_lrs(&[0.3, 0.4]).unwrap();
    assert_eq!((opt.lr(), opt.group_lrs()), (0.3, vec![0.3, 0.4]));
    opt.set_lr(0.5);
    assert_eq!(opt.group_lrs(), vec![0.5, 0.5]);

    let mut g = GradStore::default();
    g.insert(vars[1].as_tensor(), Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap());
    assert!(matches!(opt.step(&g), Err(OptimError::InvalidParam { index: 1, .. })));
}

/// Adam's update does not depend on the gradient's scale (the step is ~lr·sign(g) at first):
/// a check independent of the fixtures that f64 parameters work and keep their dtype.
#[test]
fn adam_first_step_is_lr_times_sign_in_f64() {
    let p = Var::from_tensor(&Tensor::new(&[1.0f64, -2.0, 3.0], &Device::Cpu).unwrap()).unwrap();
    let mut opt =
        TorchAdam::new(vec![p.clone()], AdamConfig { lr: 0.01, eps: 0.0, ..Default::default() })
            .unwrap();
    let mut g = GradStore::default();
    g.insert(p.as_tensor(), Tensor::new(&[1e-3f64, -50.0, 7.0], &Device::Cpu).unwrap());
    opt.step(&g).unwrap();
    let v: Vec<f64> = p.as_tensor().to_vec1().unwrap();
    let want = [0.99, -1.99, 2.99];
    for (a, b) in v.iter().zip(want) {
        assert!((a - b).abs() < 1e-12, "{v:?}");
    }
    let sd = opt.state_dict().unwrap();
    let exp_avg =
        sd.get("state").unwrap().get_int(0).unwrap().get("exp_avg").unwrap().as_tensor().unwrap();
    assert_eq!(exp_avg.dtype, tandem_ckpt::ElemType::F64);
}

/// torch casts loaded state to each parameter's dtype; so do we: float32 state from torch
/// resumes f64 parameters (the trajectory then agrees to f32 precision).
#[test]
fn torch_state_is_cast_to_the_parameter_dtype_on_load() {
    let fx = fixture();
    let resume_at = fx["resume_at"].as_u64().unwrap() as usize;
    for name in ["adamw_amsgrad", "sgd_nesterov"] {
        let case = cases(&fx).iter().find(|c| c["name"] == name).unwrap();
        let vars: Vec<Var> = case["params_after_step"][resume_at - 1]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                Var::from_tensor(&tensor_of(p).to_dtype(candle_core::DType::F64).unwrap()).unwrap()
            })
            .collect();
        let mut opt = build(case, &vars);
        opt.load_state_dict(&decode(&case["state_dict_after"][resume_at.to_string()])).unwrap();
        for (s, step) in fx["grads"].as_array().unwrap().iter().enumerate().skip(resume_at) {
            let mut g = GradStore::default();
            for (v, gj) in vars.iter().zip(step.as_array().unwrap()) {
                if !gj.is_null() {
                    g.insert(
                        v.as_tensor(),
                        tensor_of(gj).to_dtype(candle_core::DType::F64).unwrap(),
                    );
                }
            }
            opt.step(&g).unwrap();
            let as_f32: Vec<Var> = vars
                .iter()
                .map(|v| Var::from_tensor(&v.to_dtype(candle_core::DType::F32).unwrap()).unwrap())
                .collect();
            assert_params(
                &as_f32,
                &case["params_after_step"][s],
                &format!("{name} f64, step {}", s + 1),
            );
        }
        let sd = opt.state_dict().unwrap();
        let state0 = sd.get("state").unwrap().get_int(0).unwrap();
        let key = if name.starts_with("adam") { "exp_avg" } else { "momentum_buffer" };
        assert_eq!(state0.get(key).unwrap().as_tensor().unwrap().dtype, tandem_ckpt::ElemType::F64);
    }
}
