//! tandem's optimizers through candle-nn's `Optimizer` trait, so they drop into candle code:
//! the same steps as through their own API (bit for bit), the learning rate shared by both
//! traits, and errors that keep the optimizer's message.
use candle_core::{Device, Tensor, Var};
use candle_nn::Optimizer;
use tandem_optim::{
    AdamConfig, AdamWConfig, SgdConfig, TorchAdam, TorchAdamW, TorchOptimizer, TorchSgd,
};

fn vars() -> Vec<Var> {
    let dev = Device::Cpu;
    let w = Tensor::new(&[[0.5f32, -1.0, 2.0], [1.5, 0.25, -0.75]], &dev).unwrap();
    let b = Tensor::new(&[0.1f32, -0.2], &dev).unwrap();
    vec![Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap()]
}

fn loss(v: &[Var]) -> Tensor {
    let x = Tensor::new(&[[1.0f32, 2.0, -1.0], [0.5, -0.5, 3.0]], &Device::Cpu).unwrap();
    let y = x.matmul(&v[0].as_tensor().t().unwrap()).unwrap();
    let y = y.broadcast_add(v[1].as_tensor()).unwrap();
    y.sqr().unwrap().mean_all().unwrap()
}

fn values(v: &[Var]) -> Vec<u32> {
    v.iter()
        .flat_map(|v| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .map(f32::to_bits)
        .collect()
}

/// Five steps written against candle-nn's trait only (as candle code is).
fn through_candle<O: Optimizer>(config: O::Config) -> Vec<u32> {
    let v = vars();
    let mut opt = O::new(v.clone(), config).unwrap();
    for _ in 0..5 {
        opt.backward_step(&loss(&v)).unwrap();
    }
    values(&v)
}

/// The same five steps through tandem's own API.
fn through_tandem(mut step: impl FnMut(&[Var])) -> Vec<u32> {
    let v = vars();
    for _ in 0..5 {
        step(&v);
    }
    values(&v)
}

#[test]
fn candle_nn_optimizer_steps_equal_tandem_s_own_bit_for_bit() {
    let sgd = SgdConfig { lr: 0.1, momentum: 0.9, nesterov: true, ..Default::default() };
    let mut own: Option<TorchSgd> = None;
    let expect = through_tandem(|v| {
        let opt = own.get_or_insert_with(|| TorchSgd::new(v.to_vec(), sgd.clone()).unwrap());
        opt.step(&loss(v).backward().unwrap()).unwrap();
    });
    assert_eq!(through_candle::<TorchSgd>(sgd.clone()), expect, "TorchSgd");

    let adam = AdamConfig { lr: 0.01, weight_decay: 0.1, ..Default::default() };
    let mut own: Option<TorchAdam> = None;
    let expect = through_tandem(|v| {
        let opt = own.get_or_insert_with(|| TorchAdam::new(v.to_vec(), adam.clone()).unwrap());
        opt.step(&loss(v).backward().unwrap()).unwrap();
    });
    assert_eq!(through_candle::<TorchAdam>(adam.clone()), expect, "TorchAdam");

    let adamw = AdamWConfig { lr: 0.01, ..Default::default() };
    let mut own: Option<TorchAdamW> = None;
    let expect = through_tandem(|v| {
        let opt = own.get_or_insert_with(|| TorchAdamW::new(v.to_vec(), adamw.clone()).unwrap());
        opt.step(&loss(v).backward().unwrap()).unwrap();
    });
    let before = values(&vars());
    assert_ne!(expect, before, "the steps moved the parameters");
    assert_eq!(through_candle::<TorchAdamW>(adamw), expect, "TorchAdamW");
}

#[test]
fn plain_sgd_matches_candle_nn_s_own_sgd() {
    // Generic candle code, run with candle-nn's SGD and with tandem's (no momentum): the same
    // update rule, p -= lr * g.
    let theirs = through_candle::<candle_nn::SGD>(0.05);
    let ours = through_candle::<TorchSgd>(SgdConfig { lr: 0.05, ..Default::default() });
    for (a, b) in theirs.iter().zip(&ours) {
        let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
        assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
    }
}

#[test]
fn the_learning_rate_is_one_setting_under_both_traits() {
    let mut opt = TorchAdamW::new(vars(), AdamWConfig::default()).unwrap();
    Optimizer::set_learning_rate(&mut opt, 0.25);
    assert_eq!(TorchOptimizer::lr(&opt), 0.25);
    TorchOptimizer::set_lr(&mut opt, 0.5);
    assert_eq!(Optimizer::learning_rate(&opt), 0.5);
    let mut sgd = <TorchSgd as Optimizer>::new(vars(), SgdConfig::default()).unwrap();
    Optimizer::set_learning_rate(&mut sgd, 0.125);
    assert_eq!(sgd.group_lrs(), vec![0.125]);
}

#[test]
fn a_bad_config_through_candle_nn_keeps_the_optimizer_s_message() {
    let bad = SgdConfig { lr: -1.0, ..Default::default() };
    let Err(e) = <TorchSgd as Optimizer>::new(vars(), bad) else { panic!("accepted lr -1") };
    let e = e.to_string();
    assert!(e.contains("lr") && e.contains("-1"), "{e}");
}

/// `param_state` is one entry of `state_dict`'s `state` (tandem's optimizers copy only that
/// entry); `None` before a parameter's first step.
#[test]
fn param_state_is_one_entry_of_the_state_dict() {
    use candle_core::{Device, Tensor, Var};
    use tandem_optim::{SgdConfig, TorchOptimizer, TorchSgd};
    let a = Var::from_tensor(&Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::new(&[3f32], &Device::Cpu).unwrap()).unwrap();
    let mut opt = TorchSgd::new(
        vec![a.clone(), b.clone()],
        SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() },
    )
    .unwrap();
    assert_eq!(opt.param_state(1).unwrap(), tandem_ckpt::Value::None);
    // Only `b` gets a gradient: `a` keeps no state.
    let grads = (b.as_tensor() * 2.0).unwrap().sum_all().unwrap().backward().unwrap();
    opt.step(&grads).unwrap();
    let sd = opt.state_dict().unwrap();
    let entry = sd.get("state").and_then(|s| s.as_dict()).unwrap();
    let from_dict = entry.iter().find(|(k, _)| k.as_int() == Some(1)).unwrap().1.clone();
    assert_eq!(opt.param_state(1).unwrap(), from_dict);
    assert_eq!(opt.param_state(0).unwrap(), tandem_ckpt::Value::None);
}
