//! GradScaler against torch.amp.GradScaler (fixture made by
//! tests/fixtures/amp/make_fixtures.py with torch 2.15): skipped steps, scale and growth tracker
//! after every update, parameters after every step, clipping of unscaled gradients, state_dict;
//! resuming from a checkpoint mid-run; misuse errors; and autocast forward in bf16/f16 over
//! float32 master weights.
mod torch_json;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use serde_json::Value as Json;
use tandem_optim::amp::{autocast_var_builder, GradScaler, GradScalerConfig};
use tandem_optim::{clip_grad_norm, OptimError};
use tandem_optim::{AdamWConfig, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};

fn fixture() -> Json {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/amp/grad_scaler.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn number(x: &Json) -> f32 {
    match x {
        Json::String(s) => s.parse::<f32>().unwrap_or_else(|_| panic!("not a number: {s}")),
        x => x.as_f64().unwrap() as f32,
    }
}

fn tensor(j: &Json) -> Tensor {
    let shape: Vec<usize> =
        j["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    let data: Vec<f32> = j["data"].as_array().unwrap().iter().map(number).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn optimizer(case: &str, vars: &[Var]) -> Box<dyn TorchOptimizer> {
    match case {
        "sgd_momentum" => Box::new(
            TorchSgd::new(
                vars.to_vec(),
                SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() },
            )
            .unwrap(),
        ),
        "adamw" => Box::new(
            TorchAdamW::new(
                vars.to_vec(),
                AdamWConfig { lr: 0.01, weight_decay: 0.01, ..Default::default() },
            )
            .unwrap(),
        ),
        "growth_overflow" => Box::new(
            TorchSgd::new(vars.to_vec(), SgdConfig { lr: 0.1, ..Default::default() }).unwrap(),
        ),
        other => panic!("unknown case {other}"),
    }
}

fn scaler_config(j: &Json) -> GradScalerConfig {
    GradScalerConfig {
        init_scale: j["init_scale"].as_f64().unwrap(),
        growth_factor: j["growth_factor"].as_f64().unwrap(),
        backoff_factor: j["backoff_factor"].as_f64().unwrap(),
        growth_interval: j["growth_interval"].as_i64().unwrap(),
        enabled: true,
    }
}

fn grads_for(vars: &[Var], it: &Json) -> GradStore {
    let mut store = GradStore::default();
    for (v, g) in vars.iter().zip(it["grads"].as_array().unwrap()) {
        if !g.is_null() {
            store.insert(v.as_tensor(), tensor(g));
        }
    }
    store
}

/// One iteration of torch's recipe, as the fixture ran it; returns whether the optimizer stepped.
fn iterate(
    scaler: &mut GradScaler,
    opt: &mut dyn TorchOptimizer,
    vars: &[Var],
    it: &Json,
    what: &str,
) -> bool {
    let scale_before = it["scale_before"].as_f64().unwrap();
    assert_eq!(scaler.get_scale(), scale_before, "{what}: scale before the iteration");
    let loss = Tensor::new(1.0f32, &Device::Cpu).unwrap();
    let scaled = scaler.scale(&loss).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(scaled as f64, scale_before, "{what}: scale(1.0)");
    let mut grads = grads_for(vars, it);
    if let Some(max_norm) = it["plan"].get("clip").and_then(Json::as_f64) {
        scaler.unscale_(&*opt, &mut grads).unwrap();
        match (clip_grad_norm(vars, &mut grads, max_norm), &it["clip_total_norm"]) {
            (Ok(norm), Json::Number(want)) => {
                let want = want.as_f64().unwrap();
                assert!((norm - want).abs() <= 1e-6 * want, "{what}: total norm {norm} vs {want}")
            }
            // torch returns a NaN norm (and scales by it); tandem refuses to clip by it. The
            // step is skipped either way.
            (Err(OptimError::NonFiniteNorm { .. }), Json::String(s)) if s == "nan" => {}
            (got, want) => panic!("{what}: clip_grad_norm gave {got:?}, torch {want}"),
        }
    }
    let stepped = scaler.step(opt, &mut grads).unwrap();
    scaler.update().unwrap();
    stepped
}

fn check_after(scaler: &GradScaler, vars: &[Var], it: &Json, what: &str) {
    for (p, (v, want)) in vars.iter().zip(it["params_after"].as_array().unwrap()).enumerate() {
        let (got, want) = (values(v.as_tensor()), values(&tensor(want)));
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{what}: param {p}[{k}] = {a}, torch {b}"
            );
        }
    }
    assert_eq!(scaler.get_scale(), it["scale_after"].as_f64().unwrap(), "{what}: scale");
    assert_eq!(
        scaler.growth_tracker(),
        it["growth_tracker_after"].as_i64().unwrap(),
        "{what}: growth tracker"
    );
}

fn start(case: &Json) -> (Vec<Var>, Box<dyn TorchOptimizer>, GradScaler) {
    let vars: Vec<Var> = case["params0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Var::from_tensor(&tensor(p)).unwrap())
        .collect();
    let opt = optimizer(case["name"].as_str().unwrap(), &vars);
    let scaler = GradScaler::new(scaler_config(&case["scaler"])).unwrap();
    (vars, opt, scaler)
}

#[test]
fn grad_scaler_follows_torch() {
    let fx = fixture();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (vars, mut opt, mut scaler) = start(case);
        for (i, it) in case["iterations"].as_array().unwrap().iter().enumerate() {
            let what = format!("{name} iteration {i}");
            let stepped = iterate(&mut scaler, opt.as_mut(), &vars, it, &what);
            assert_eq!(stepped, it["stepped"].as_bool().unwrap(), "{what}: stepped");
            check_after(&scaler, &vars, it, &what);
        }
        assert_eq!(
            scaler.state_dict(),
            torch_json::decode(&to_encoded(&case["state_dict"])),
            "{name}: state_dict"
        );
    }
}

/// The fixture writes state dicts as plain JSON objects; torch_json decodes its own encoding.
fn to_encoded(obj: &Json) -> Json {
    let items: Vec<Json> =
        ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]
            .iter()
            .map(|k| Json::Array(vec![Json::String(k.to_string()), obj[*k].clone()]))
            .collect();
    serde_json::json!({ "__dict__": items })
}

#[test]
fn the_fixture_exercises_skips_growth_backoff_and_overflow() {
    let fx = fixture();
    let cases = fx["cases"].as_array().unwrap();
    let its = |c: &Json| c["iterations"].as_array().unwrap().clone();
    let sgd = its(&cases[0]);
    assert!(sgd.iter().any(|i| !i["stepped"].as_bool().unwrap()), "a skipped step");
    assert!(sgd.iter().any(|i| i["scale_after"].as_f64() > i["scale_before"].as_f64()), "growth");
    assert!(sgd.iter().any(|i| i["scale_after"].as_f64() < i["scale_before"].as_f64()), "backoff");
    assert!(sgd.iter().any(|i| i["grads"][1].is_null()), "a parameter without gradient");
    let overflow = its(&cases[2]);
    assert!(overflow.iter().all(|i| i["stepped"].as_bool().unwrap()
        && i["scale_after"] == i["scale_before"]
        && i["growth_tracker_after"] == 0));
}

/// Scaler and optimizer state saved mid-run in one checkpoint file and loaded into fresh ones:
/// the rest of the run equals torch's uninterrupted one.
#[test]
fn resumes_from_a_checkpoint_mid_run() {
    let fx = fixture();
    let dir = tempfile::tempdir().unwrap();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let its = case["iterations"].as_array().unwrap();
        let cut = its.len() / 2;
        let (vars, mut opt, mut scaler) = start(case);
        for (i, it) in its[..cut].iter().enumerate() {
            iterate(&mut scaler, opt.as_mut(), &vars, it, &format!("{name} {i}"));
        }
        let path = dir.path().join(format!("{name}.pt"));
        let weights: Vec<(String, tandem_ckpt::Value)> = vars
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let t = tandem_ckpt::TensorData::from_f32(v.dims(), &values(v.as_tensor()));
                (i.to_string(), tandem_ckpt::Value::Tensor(t))
            })
            .collect();
        let ckpt = tandem_ckpt::Value::dict_from([
            ("model", tandem_ckpt::Value::dict_from(weights)),
            ("optimizer", opt.state_dict().unwrap()),
            ("scaler", scaler.state_dict()),
        ]);
        tandem_ckpt::save(&path, &ckpt).unwrap();
        drop((vars, opt, scaler));

        // A fresh process would build everything from its config, then load.
        let (vars, mut opt, _) = start(case);
        let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
        let loaded = tandem_ckpt::load(&path).unwrap();
        for (i, v) in vars.iter().enumerate() {
            let Some(tandem_ckpt::Value::Tensor(t)) =
                loaded.get("model").unwrap().get(&i.to_string())
            else {
                panic!("weights {i} missing")
            };
            v.set(&Tensor::from_vec(t.to_f32_vec(), v.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        opt.load_state_dict(loaded.get("optimizer").unwrap()).unwrap();
        scaler.load_state_dict(loaded.get("scaler").unwrap()).unwrap();
        for (i, it) in its.iter().enumerate().skip(cut) {
            let what = format!("{name} iteration {i} after resume");
            let stepped = iterate(&mut scaler, opt.as_mut(), &vars, it, &what);
            assert_eq!(stepped, it["stepped"].as_bool().unwrap(), "{what}: stepped");
            check_after(&scaler, &vars, it, &what);
        }
    }
}

/// What torch.amp.GradScaler.load_state_dict makes of tandem's state (skips without torch,
/// unless TANDEM_REQUIRE_TORCH=1).
#[test]
fn torch_loads_the_state_dict() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 512.0,
        growth_factor: 4.0,
        backoff_factor: 0.125,
        growth_interval: 3,
        enabled: true,
    })
    .unwrap();
    let var = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
    let mut opt = TorchSgd::new(vec![var.clone()], SgdConfig::default()).unwrap();
    for _ in 0..2 {
        let mut g = GradStore::default();
        g.insert(var.as_tensor(), Tensor::new(&[1.0f32, 1.0], &Device::Cpu).unwrap());
        scaler.step(&mut opt, &mut g).unwrap();
        scaler.update().unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaler.pt");
    tandem_ckpt::save(&path, &scaler.state_dict()).unwrap();
    let script = "import sys, torch\n\
        s = torch.amp.GradScaler('cpu')\n\
        s.load_state_dict(torch.load(sys.argv[1], weights_only=True))\n\
        s.scale(torch.tensor(1.0))\n\
        print(s.get_scale(), s._growth_tracker.item(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())";
    let out = tandem_testutil::output_with_deadline(
        std::process::Command::new(python).args(["-c", script]).arg(&path),
        std::time::Duration::from_secs(120),
    );
    assert!(out.status.success(), "torch: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "512.0 2 4.0 0.125 3");
}

#[test]
fn scaling_a_half_precision_loss_gives_float32() {
    let fx = fixture();
    let scaler =
        GradScaler::new(GradScalerConfig { init_scale: 3.0, ..Default::default() }).unwrap();
    for (dtype, name) in [(DType::F16, "float16"), (DType::F32, "float32")] {
        let loss = Tensor::new(1.5f32, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let y = scaler.scale(&loss).unwrap();
        let want = &fx["scaled_loss"][name];
        assert_eq!(want["dtype"], "float32");
        assert_eq!(y.dtype(), DType::F32, "{name}");
        assert_eq!(y.to_scalar::<f32>().unwrap() as f64, want["value"].as_f64().unwrap());
    }
    let defaults = GradScaler::new(GradScalerConfig::default()).unwrap().state_dict();
    assert_eq!(defaults, torch_json::decode(&to_encoded(&fx["default_state_dict"])));
}

fn one_param() -> (Var, TorchSgd, GradStore) {
    let var = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
    let opt =
        TorchSgd::new(vec![var.clone()], SgdConfig { lr: 0.5, ..Default::default() }).unwrap();
    let mut g = GradStore::default();
    g.insert(var.as_tensor(), Tensor::new(&[8.0f32, 16.0], &Device::Cpu).unwrap());
    (var, opt, g)
}

#[test]
fn misuse_is_refused_by_name() {
    let cfg = GradScalerConfig { init_scale: 8.0, ..Default::default() };
    let (_, mut opt, mut g) = one_param();
    let mut scaler = GradScaler::new(cfg.clone()).unwrap();
    assert!(matches!(scaler.update(), Err(OptimError::NoInfChecks)));
    scaler.unscale_(&opt, &mut g).unwrap();
    assert!(matches!(scaler.unscale_(&opt, &mut g), Err(OptimError::AlreadyUnscaled)));
    assert!(scaler.step(&mut opt, &mut g).unwrap());
    assert!(matches!(scaler.step(&mut opt, &mut g), Err(OptimError::AlreadyStepped)));
    assert!(matches!(scaler.unscale_(&opt, &mut g), Err(OptimError::AlreadyStepped)));
    scaler.update().unwrap();

    // float16 gradients (float16 parameters) are refused, naming the parameter.
    let half = Var::from_tensor(
        &Tensor::new(&[1.0f32], &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap(),
    )
    .unwrap();
    let opt16 = TorchSgd::new(vec![half.clone()], SgdConfig::default()).unwrap();
    let mut g16 = GradStore::default();
    g16.insert(
        half.as_tensor(),
        Tensor::new(&[1.0f32], &Device::Cpu).unwrap().to_dtype(DType::F16).unwrap(),
    );
    let err = scaler.unscale_(&opt16, &mut g16).unwrap_err();
    assert!(matches!(err, OptimError::Fp16Gradient { index: 0 }), "{err}");

    for (bad, name) in [
        (GradScalerConfig { growth_factor: 1.0, ..cfg.clone() }, "growth_factor"),
        (GradScalerConfig { backoff_factor: 1.0, ..cfg.clone() }, "backoff_factor"),
        (GradScalerConfig { growth_interval: 0, ..cfg.clone() }, "growth_interval"),
        (GradScalerConfig { init_scale: f64::NAN, ..cfg.clone() }, "init_scale"),
        (GradScalerConfig { init_scale: 1e39, ..cfg.clone() }, "init_scale"),
    ] {
        let err = GradScaler::new(bad).unwrap_err().to_string();
        assert!(err.contains(name), "{err}");
    }

    // State dicts: empty (from a disabled scaler), a missing key, a wrong type, a bad value.
    let before = scaler.state_dict();
    let err = scaler.load_state_dict(&tandem_ckpt::Value::Dict(vec![])).unwrap_err();
    assert!(matches!(err, OptimError::EmptyStateDict), "{err}");
    let mut missing = before.clone();
    if let tandem_ckpt::Value::Dict(items) = &mut missing {
        items.retain(|(k, _)| k != &tandem_ckpt::Value::Str("_growth_tracker".into()));
    }
    let err = scaler.load_state_dict(&missing).unwrap_err().to_string();
    assert!(err.contains("_growth_tracker") && err.contains("missing"), "{err}");
    let with = |key: &str, v: tandem_ckpt::Value| {
        let mut d = before.clone();
        if let tandem_ckpt::Value::Dict(items) = &mut d {
            for (k, x) in items.iter_mut() {
                if k == &tandem_ckpt::Value::Str(key.into()) {
                    *x = v.clone();
                }
            }
        }
        d
    };
    let err = scaler
        .load_state_dict(&with("growth_interval", tandem_ckpt::Value::Float(2.5)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("growth_interval") && err.contains("int"), "{err}");
    let err = scaler
        .load_state_dict(&with("scale", tandem_ckpt::Value::Float(-1.0)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("scale"), "{err}");
    assert_eq!(scaler.state_dict(), before, "a refused load changes nothing");
}

#[test]
fn a_disabled_scaler_passes_through() {
    let (var, mut opt, mut g) = one_param();
    let mut scaler =
        GradScaler::new(GradScalerConfig { enabled: false, ..Default::default() }).unwrap();
    let loss = Tensor::new(2.0f32, &Device::Cpu).unwrap();
    assert_eq!(scaler.scale(&loss).unwrap().to_scalar::<f32>().unwrap(), 2.0);
    assert_eq!(scaler.get_scale(), 1.0);
    assert!(scaler.step(&mut opt, &mut g).unwrap());
    scaler.update().unwrap();
    assert_eq!(values(var.as_tensor()), vec![1.0 - 0.5 * 8.0, -2.0 - 0.5 * 16.0]);
    assert_eq!(scaler.state_dict(), tandem_ckpt::Value::Dict(vec![]));
    scaler.load_state_dict(&tandem_ckpt::Value::Dict(vec![])).unwrap();
}

fn mlp(vb: candle_nn::VarBuilder) -> impl Module {
    let l1 = candle_nn::linear(8, 16, vb.pp("l1")).unwrap();
    let l2 = candle_nn::linear(16, 1, vb.pp("l2")).unwrap();
    candle_nn::seq().add(l1).add(candle_nn::Activation::Relu).add(l2)
}

fn data() -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..64 * 8).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let x = Tensor::from_vec(x, (64, 8), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(
        (0..8).map(|i| i as f32 / 8.0 - 0.4).collect::<Vec<_>>(),
        (8, 1),
        &Device::Cpu,
    )
    .unwrap();
    let y = x.matmul(&w).unwrap();
    (x, y)
}

/// bf16 forward/backward over f32 master weights: the output is bf16, the gradients arrive at
/// the float32 variables and agree with full-precision gradients to bf16 accuracy.
#[test]
fn autocast_computes_in_bf16_and_grads_reach_f32_masters() {
    let vm = candle_nn::VarMap::new();
    let _ = mlp(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu));
    // Fixed weights (candle draws its initial ones unseeded): the bf16 error is then the same
    // on every run, and the bound below is checked, not sampled.
    let mut named: Vec<(String, Var)> =
        vm.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, (_, var)) in named.iter().enumerate() {
        let n = var.elem_count();
        let w: Vec<f32> =
            (0..n).map(|i| (((i * 7919 + k * 104_729) % 97) as f32 / 97.0 - 0.5) * 0.6).collect();
        var.set(&Tensor::from_vec(w, var.dims(), &Device::Cpu).unwrap()).unwrap();
    }
    let (x, y) = data();
    let loss_of = |model: &dyn Module, dtype| {
        let out = model.forward(&x.to_dtype(dtype).unwrap()).unwrap();
        assert_eq!(out.dtype(), dtype);
        candle_nn::loss::mse(&out.to_dtype(DType::F32).unwrap(), &y).unwrap()
    };
    let full = mlp(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu));
    let g32 = loss_of(&full, DType::F32).backward().unwrap();
    let half = mlp(autocast_var_builder(&vm, DType::BF16, &Device::Cpu));
    let g16 = loss_of(&half, DType::BF16).backward().unwrap();
    for var in vm.all_vars() {
        let (a, b) = (g32.get(var.as_tensor()).unwrap(), g16.get(var.as_tensor()).unwrap());
        assert_eq!(var.dtype(), DType::F32);
        assert_eq!(b.dtype(), DType::F32, "the master's gradient is float32");
        let scale = values(a).iter().fold(0f32, |m, v| m.max(v.abs()));
        for (p, q) in values(a).iter().zip(values(b)) {
            assert!((p - q).abs() <= 0.05 * scale + 1e-3, "bf16 grad {q} vs f32 {p}");
        }
    }
    // A weight the VarMap does not hold is an error naming it, not a silent new variable.
    let err =
        candle_nn::linear(8, 2, autocast_var_builder(&vm, DType::BF16, &Device::Cpu).pp("head"))
            .err()
            .unwrap();
    assert!(err.to_string().contains("head.weight"), "{err}");
}

/// float16 autocast with a GradScaler trains: the loss falls, master weights stay float32, and a
/// deliberately huge initial scale is backed off until the steps go through.
#[test]
fn f16_training_with_grad_scaler_converges() {
    let vm = candle_nn::VarMap::new();
    let _ = mlp(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu));
    let mut opt =
        TorchSgd::new(vm.all_vars(), SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() })
            .unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 2f64.powi(40),
        growth_interval: 10,
        ..Default::default()
    })
    .unwrap();
    let (x, y) = data();
    let (mut first, mut last, mut skipped) = (None, 0.0, 0);
    for _ in 0..120 {
        // Rebuilt every step so the f16 casts see the updated master weights.
        let model = mlp(autocast_var_builder(&vm, DType::F16, &Device::Cpu));
        let out = model.forward(&x.to_dtype(DType::F16).unwrap()).unwrap();
        let loss = candle_nn::loss::mse(&out.to_dtype(DType::F32).unwrap(), &y).unwrap();
        let l = loss.to_scalar::<f32>().unwrap();
        first.get_or_insert(l);
        last = l;
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        if !scaler.step(&mut opt, &mut grads).unwrap() {
            skipped += 1;
        }
        scaler.update().unwrap();
    }
    let first = first.unwrap();
    assert!(skipped > 0, "a 2^40 scale overflows float16 gradients at first");
    assert!(scaler.get_scale() < 2f64.powi(40));
    assert!(last < 0.2 * first, "loss {first} -> {last}");
    assert!(vm.all_vars().iter().all(|v| v.dtype() == DType::F32));
}

/// The committed fixture is exactly what the installed torch makes (skips without torch, unless
/// TANDEM_REQUIRE_TORCH=1).
#[test]
fn fixture_is_reproduced_by_torch() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/amp/make_fixtures.py");
    let out = tandem_testutil::output_with_deadline(
        std::process::Command::new(python).arg(script).arg(dir.path()),
        std::time::Duration::from_secs(120),
    );
    assert!(out.status.success(), "make_fixtures.py: {}", String::from_utf8_lossy(&out.stderr));
    let fresh: Json = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("grad_scaler.json")).unwrap(),
    )
    .unwrap();
    let committed = fixture();
    if fresh["torch_version"] != committed["torch_version"] {
        eprintln!(
            "skipping exact fixture comparison: fixture from torch {}, installed torch {}",
            committed["torch_version"], fresh["torch_version"]
        );
        return;
    }
    assert!(
        fresh == committed,
        "grad_scaler.json differs from what torch makes now; rerun make_fixtures.py"
    );
}

/// torch's `scaler.update(new_scale)` and `is_enabled()`: the scale set by hand (and kept in the
/// state dict), a scale float32 cannot hold refused by name; a disabled scaler ignores both.
#[test]
fn update_to_sets_the_scale_by_hand_and_refuses_a_bad_one() {
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    assert!(scaler.is_enabled());
    scaler.update_to(512.0).unwrap();
    assert_eq!(scaler.get_scale(), 512.0);
    assert_eq!(scaler.state_dict().get("scale"), Some(&tandem_ckpt::Value::Float(512.0)));
    for bad in [0.0, -1.0, f64::INFINITY, 1e39] {
        let err = scaler.update_to(bad).unwrap_err().to_string();
        assert!(err.contains("new_scale"), "{bad}: {err}");
    }
    assert_eq!(scaler.get_scale(), 512.0, "a refused scale changes nothing");
    let mut off =
        GradScaler::new(GradScalerConfig { enabled: false, ..Default::default() }).unwrap();
    assert!(!off.is_enabled());
    off.update_to(-1.0).unwrap();
    assert_eq!(off.get_scale(), 1.0);
}
