//! Schedulers against torch 2.15's real lr sequences and state_dicts (fixtures made by
//! tests/fixtures/optim/make_fixtures.py; "poly" is insightface's PolyScheduler and
//! "poly_warmup" its PolynomialLRWarmup, restated as torch LRSchedulers there), plus resuming from a torch state_dict and bad-state errors.
mod torch_json;

use candle_core::{Device, Tensor, Var};
use serde_json::Value as Json;
use tandem_ckpt::Value;
use tandem_optim::lr_scheduler::{
    CosineAnnealingLR, LinearLR, LrScheduler, PolyScheduler, PolynomialLRWarmup, StepLR,
};
use tandem_optim::{OptimError, Part, SgdConfig, TorchOptimizer, TorchSgd};

const REL: f64 = 1e-12;

fn fixture() -> Json {
    torch_json::fixture("schedulers.json")
}

use torch_json::decode;

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= REL * b.abs()
}

fn build(name: &str, base: &[f64]) -> Box<dyn LrScheduler> {
    match name {
        "step_lr" => Box::new(StepLR::new(base, 3, 0.5).unwrap()),
        "cosine" => Box::new(CosineAnnealingLR::new(base, 10, 0.001).unwrap()),
        "cosine_eta0" => Box::new(CosineAnnealingLR::new(base, 7, 0.0).unwrap()),
        "linear" => Box::new(LinearLR::new(base, 0.25, 1.0, 4).unwrap()),
        "linear_decay" => Box::new(LinearLR::new(base, 1.0, 0.1, 6).unwrap()),
        "linear_default" => Box::new(LinearLR::with_defaults(base).unwrap()),
        "poly" => Box::new(PolyScheduler::new(base, 0.1, 20, 4).unwrap()),
        "poly_warmup" => Box::new(PolynomialLRWarmup::new(base, 4, 20, 1.0).unwrap()),
        "poly_warmup_pow2" => Box::new(PolynomialLRWarmup::new(base, 3, 11, 2.0).unwrap()),
        other => panic!("no builder for fixture case {other}"),
    }
}

fn lrs_of(j: &Json) -> Vec<f64> {
    j.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn assert_lrs(ours: &[f64], theirs: &[f64], ctx: &str) {
    assert_eq!(ours.len(), theirs.len(), "{ctx}: group count");
    for (a, b) in ours.iter().zip(theirs) {
        assert!(close(*a, *b), "{ctx}: lr {a} vs torch {b}");
    }
}

/// Same keys as torch (order aside), ints and bools exact, floats within REL.
fn assert_state(ours: &Value, theirs: &Value, ctx: &str) {
    let (a, b) = (ours.as_dict().unwrap(), theirs.as_dict().unwrap());
    let mut ka: Vec<String> = a.iter().map(|(k, _)| k.as_str().unwrap().to_string()).collect();
    let mut kb: Vec<String> = b.iter().map(|(k, _)| k.as_str().unwrap().to_string()).collect();
    ka.sort();
    kb.sort();
    assert_eq!(ka, kb, "{ctx}: keys");
    for key in ka {
        let (x, y) = (ours.get(&key).unwrap(), theirs.get(&key).unwrap());
        match (x, y) {
            (Value::List(xs), Value::List(ys)) => {
                let f = |v: &[Value]| v.iter().map(|e| e.as_float().unwrap()).collect::<Vec<_>>();
                assert_lrs(&f(xs), &f(ys), &format!("{ctx}.{key}"));
            }
            (Value::Float(p), Value::Float(q)) => assert!(close(*p, *q), "{ctx}.{key}: {p} vs {q}"),
            _ => assert_eq!(x, y, "{ctx}.{key}"),
        }
    }
}

#[test]
fn lr_sequences_and_state_dicts_match_torch() {
    let fx = fixture();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let base = lrs_of(&case["base_lrs"]);
        let mut s = build(name, &base);
        let expected = case["lrs"].as_array().unwrap();
        assert_lrs(s.last_lrs(), &lrs_of(&expected[0]), &format!("{name} after construction"));
        assert_state(&s.state_dict(), &decode(&case["state_dicts"]["0"]), &format!("{name}@0"));
        for (i, want) in expected.iter().enumerate().skip(1) {
            s.step();
            assert_lrs(s.last_lrs(), &lrs_of(want), &format!("{name} step {i}"));
            assert_eq!(s.get_last_lr(), s.last_lrs()[0]);
            assert_state(
                &s.state_dict(),
                &decode(&case["state_dicts"][i.to_string()]),
                &format!("{name}@{i}"),
            );
        }
    }
}

#[test]
fn loading_a_torch_state_dict_continues_the_sequence() {
    let fx = fixture();
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let expected = case["lrs"].as_array().unwrap();
        let mid = expected.len() / 2;
        // A scheduler built with other base lrs: everything must come from the state_dict.
        let mut s = build(name, &[0.7, 0.9]);
        s.load_state_dict(&decode(&case["state_dicts"][mid.to_string()])).unwrap();
        assert_lrs(s.last_lrs(), &lrs_of(&expected[mid]), &format!("{name} loaded at {mid}"));
        for (i, want) in expected.iter().enumerate().skip(mid + 1) {
            s.step();
            assert_lrs(s.last_lrs(), &lrs_of(want), &format!("{name} resumed, step {i}"));
        }
    }
}

#[test]
fn poly_scheduler_follows_the_insightface_formula() {
    // base 0.1, warmup 4, max 20: t < 4 -> 0.1 * t / 4; else 0.1 * (1 - (t - 4) / 16)^2.
    let mut s = PolyScheduler::new(&[0.1], 0.1, 20, 4).unwrap();
    assert_eq!((s.last_epoch(), s.get_last_lr()), (-1, 0.0));
    let mut seen = Vec::new();
    for _ in 0..21 {
        s.step();
        seen.push((s.last_epoch(), s.get_last_lr()));
    }
    let want = [(0, 0.0), (2, 0.05), (3, 0.075), (4, 0.1), (12, 0.025), (20, 0.0)];
    for (t, lr) in want {
        let got = seen.iter().find(|(e, _)| *e == t).unwrap().1;
        assert!((got - lr).abs() < 1e-15, "t={t}: {got} vs {lr}");
    }
    assert_eq!(s.lr_at(16), 0.1 * (1.0f64 - 12.0 / 16.0).powi(2));
    // Without warmup the first lr is the full base lr.
    let s = PolyScheduler::new(&[0.1], 0.1, 10, 0).unwrap();
    assert_eq!(s.get_last_lr(), 0.1);
}

#[test]
fn step_optimizer_drives_every_param_group() {
    let p = |v: f32| Var::from_tensor(&Tensor::new(&[v], &Device::Cpu).unwrap()).unwrap();
    let mut opt = TorchSgd::with_groups(vec![
        (vec![p(1.0)], SgdConfig { lr: 0.1, ..Default::default() }),
        (vec![p(2.0)], SgdConfig { lr: 0.01, ..Default::default() }),
    ])
    .unwrap();
    let mut s = StepLR::new(&opt.group_lrs(), 2, 0.1).unwrap();
    s.apply(&mut opt).unwrap();
    for _ in 0..2 {
        s.step_optimizer(&mut opt).unwrap();
    }
    let lrs = opt.group_lrs();
    assert!(close(lrs[0], 0.01) && close(lrs[1], 0.001), "{lrs:?}");
    // A scheduler for one group cannot drive two.
    let one = LinearLR::with_defaults(&[0.1]).unwrap();
    assert!(matches!(
        one.apply(&mut opt),
        Err(OptimError::InvalidConfig { of: Part::Optimizer, name: "lrs", .. })
    ));
}

fn state_key(r: Result<(), OptimError>) -> String {
    match r {
        Err(OptimError::StateDict { of: Part::Scheduler, key, .. }) => key,
        other => panic!("expected a state_dict error, got {other:?}"),
    }
}

#[test]
fn bad_state_dicts_and_settings_are_refused() {
    let mut s = StepLR::new(&[0.1], 3, 0.5).unwrap();
    let before = s.clone();
    let mut two_groups = StepLR::new(&[0.1, 0.2], 3, 0.5).unwrap().state_dict();
    assert_eq!(state_key(s.load_state_dict(&two_groups)), "base_lrs");
    two_groups.insert("last_epoch", "three");
    assert_eq!(state_key(s.load_state_dict(&two_groups)), "base_lrs");
    let mut bad = s.state_dict();
    bad.insert("last_epoch", 2.5);
    assert_eq!(state_key(s.load_state_dict(&bad)), "last_epoch");
    let mut bad = s.state_dict();
    bad.insert("step_size", 0i64);
    assert_eq!(state_key(s.load_state_dict(&bad)), "step_size");
    let cosine = CosineAnnealingLR::new(&[0.1], 5, 0.0).unwrap().state_dict();
    assert_eq!(state_key(s.load_state_dict(&cosine)), "step_size");
    assert_eq!(s, before, "failed loads changed the scheduler");

    assert!(matches!(
        StepLR::new(&[0.1], 0, 0.5),
        Err(OptimError::InvalidConfig { of: Part::Scheduler, name: "step_size", .. })
    ));
    assert!(matches!(
        StepLR::new(&[], 1, 0.5),
        Err(OptimError::InvalidConfig { of: Part::Scheduler, name: "base_lrs", .. })
    ));
    assert!(matches!(
        LinearLR::new(&[0.1], 0.0, 1.0, 5),
        Err(OptimError::InvalidConfig { of: Part::Scheduler, name: "start_factor", .. })
    ));
    assert!(matches!(
        CosineAnnealingLR::new(&[0.1], 0, 0.0),
        Err(OptimError::InvalidConfig { of: Part::Scheduler, name: "T_max", .. })
    ));
    assert!(matches!(
        PolyScheduler::new(&[0.1], 0.1, 4, 4),
        Err(OptimError::InvalidConfig { of: Part::Scheduler, name: "max_steps", .. })
    ));
}
