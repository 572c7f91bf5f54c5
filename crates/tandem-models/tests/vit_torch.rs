//! The ViT against arcface_torch's `VisionTransformer` in PyTorch (fixtures/vit/make_fixture.py):
//! width 32, 2 blocks, 8 heads, patch 9 on 112x112, with weights, input and probe from an
//! integer hash both sides compute; variant "a" without masking, "b" with arcface_torch's patch
//! masking driven by the fixture's noise. The same state-dict keys in the same order, and the
//! eval- and train-mode embeddings, every parameter's gradient (the mask token's included) and
//! the feature head's BatchNorm statistics are as close to torch's float64 run as torch's own
//! float32 run is (within 3x).
mod common;

use candle_core::{DType, Device, Tensor};
use common::{filled, fixture, formula, judge, judge_gradients};
use tandem_models::{Vit, VitConfig};
use tandem_nn::OrderedVarMap;

const SMALL: VitConfig = VitConfig::new(32, 2, 0.0, 0.0);

fn check_variant(variant: &str, masked: bool) {
    let f = fixture("vit", "vit.safetensors");
    let vars = OrderedVarMap::new();
    let cfg = VitConfig { mask_ratio: if masked { 0.1 } else { 0.0 }, ..SMALL };
    let model = Vit::new(cfg, 16, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let named: Vec<_> =
        vars.named().into_iter().filter(|(n, _)| !n.ends_with("num_batches_tracked")).collect();
    let ours: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(
        ours,
        common::keys("vit", "vit_keys.json", variant),
        "{variant}: creation order = torch's state_dict order"
    );
    for (i, (name, var)) in named.iter().enumerate() {
        var.set(&filled(name, var.dims(), i, |_, _, _| None)).unwrap();
    }
    let x = formula(&[4, 3, 112, 112], 0.5, 1.0);
    let probe = formula(&[4, 16], 1.5, 1.0);
    let eval = model.forward_t(&x, false).unwrap();
    let mut worst = judge(&eval, &f, &format!("{variant}.eval"), "eval-mode embedding");
    let emb = if masked {
        model.forward_masked(&x, &f["noise"]).unwrap()
    } else {
        model.forward_t(&x, true).unwrap()
    };
    worst = worst.max(judge(&emb, &f, &format!("{variant}.train"), "train-mode embedding"));
    let grads = (&emb * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let (share, checked) = judge_gradients(&named, &grads, &f, variant);
    worst = worst.max(share);
    let expected = if masked { 34 } else { 33 }; // every float parameter; the mask token if masked
    assert_eq!(checked, expected, "{variant}: gradients checked");
    eprintln!("{variant}: largest share of the allowed error used: {worst:.2}");
}

#[test]
fn unmasked_vit_matches_torch() {
    check_variant("a", false);
}

#[test]
fn masked_training_matches_torch_on_the_same_noise() {
    check_variant("b", true);
}

#[test]
fn training_draws_a_new_mask_each_step_from_the_seed() {
    let vars = OrderedVarMap::new();
    let cfg = VitConfig { mask_ratio: 0.1, ..SMALL };
    let model = Vit::new(cfg, 16, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
    let x = formula(&[4, 3, 112, 112], 0.5, 1.0);
    let run = |seed| {
        model.seed(seed);
        let a = model.forward_t(&x, true).unwrap();
        let b = model.forward_t(&x, true).unwrap();
        (a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap())
    };
    let (a1, b1) = run(7);
    let (a2, b2) = run(7);
    assert_eq!((&a1, &b1), (&a2, &b2), "the same seed gives the same masks");
    assert_ne!(a1, b1, "each step draws its own mask");
    assert_ne!(run(8).0, a1, "another seed, another mask");
}

#[test]
fn stochastic_depth_drops_whole_samples_in_training_only() {
    // Drop path 1 on the last block: its residual branches always go (keep probability 0 is
    // never drawn by arcface_torch's configs; 0.5 gives both outcomes).
    let vars = OrderedVarMap::new();
    let cfg = VitConfig { drop_path_rate: 0.5, ..SMALL };
    let model = Vit::new(cfg, 16, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
    for (i, (name, var)) in vars.named().iter().enumerate() {
        if !name.ends_with("num_batches_tracked") {
            var.set(&filled(name, var.dims(), i, |_, _, _| None)).unwrap();
        }
    }
    let x = formula(&[16, 3, 112, 112], 0.5, 1.0);
    let eval1 = model.forward_t(&x, false).unwrap().to_vec2::<f32>().unwrap();
    let eval2 = model.forward_t(&x, false).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(eval1, eval2, "no randomness in eval");
    model.seed(1);
    let t1 = model.forward_t(&x, true).unwrap().to_vec2::<f32>().unwrap();
    model.seed(2);
    let t2 = model.forward_t(&x, true).unwrap().to_vec2::<f32>().unwrap();
    assert_ne!(t1, t2, "stochastic depth draws per seed");
}

#[test]
fn arcface_torch_s_sizes_and_bad_input() {
    // torch: sum(p.numel() for p in get_model(name).parameters()) at num_features 512
    for (cfg, params) in [
        (VitConfig::VIT_T, 19_137_792usize),
        (VitConfig::VIT_S, 76_023_296),
        (VitConfig::VIT_B, 113_833_472),
    ] {
        let vars = OrderedVarMap::new();
        Vit::new(cfg, 512, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
        let trainable: usize = vars
            .named()
            .iter()
            .filter(|(n, _)| !n.contains("running_") && !n.ends_with("num_batches_tracked"))
            .map(|(_, v)| v.elem_count())
            .sum();
        assert_eq!(trainable, params, "{cfg:?}");
    }
    let vars = OrderedVarMap::new();
    let vb = vars.var_builder(DType::F32, &Device::Cpu);
    let e = Vit::new(VitConfig::new(30, 1, 0.0, 0.0), 8, vb.clone()).err().unwrap().to_string();
    assert!(e.contains("multiple of the heads"), "{e}");
    let model = Vit::new(SMALL, 8, vb).unwrap();
    let e =
        model.forward_t(&Tensor::zeros((1, 3, 64, 64), DType::F32, &Device::Cpu).unwrap(), false);
    assert!(e.unwrap_err().to_string().contains("112"));
    let e =
        model.forward_masked(&formula(&[2, 3, 112, 112], 0.5, 1.0), &formula(&[2, 100], 1.0, 1.0));
    assert!(e.unwrap_err().to_string().contains("[2, 144]"));
}

/// Two models with the same weights, the second built as `cfg` asks, trained one step from the
/// same seed (masks and stochastic depth on) under tandem's backward: the same embeddings and
/// every parameter's gradient bit for bit; then the second under candle's own backward fails
/// naming tandem's.
fn same_values_and_gradients_as_the_plain_model(variant: impl Fn(VitConfig) -> VitConfig) {
    let cfg = VitConfig { drop_path_rate: 0.5, mask_ratio: 0.1, ..SMALL };
    let build = |cfg: VitConfig| {
        let vars = OrderedVarMap::new();
        let model = Vit::new(cfg, 16, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
        for (i, (name, var)) in vars.named().iter().enumerate() {
            if !name.ends_with("num_batches_tracked") {
                var.set(&filled(name, var.dims(), i, |_, _, _| None)).unwrap();
            }
        }
        (vars, model)
    };
    let (plain_vars, plain) = build(cfg);
    let (other_vars, other) = build(variant(cfg));
    let x = formula(&[6, 3, 112, 112], 0.5, 1.0);
    let probe = formula(&[6, 16], 1.5, 1.0);
    let run = |model: &Vit| {
        model.seed(3);
        let y = model.forward_t(&x, true).unwrap();
        let loss = (&y * &probe).unwrap().sum_all().unwrap();
        (y, tandem_nn::backward(&loss).unwrap())
    };
    let (ya, ga) = run(&plain);
    let (yb, gb) = run(&other);
    assert_eq!(ya.to_vec2::<f32>().unwrap(), yb.to_vec2::<f32>().unwrap());
    let (na, nb) = (plain_vars.named(), other_vars.named());
    let mut compared = 0;
    for ((name, a), (_, b)) in na.iter().zip(&nb) {
        let (Some(a), Some(b)) = (ga.get(a.as_tensor()), gb.get(b.as_tensor())) else {
            assert!(ga.get(a.as_tensor()).is_none() && gb.get(b.as_tensor()).is_none(), "{name}");
            continue;
        };
        let (a, b) = (
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a, b, "gradient of {name}");
        compared += 1;
    }
    assert_eq!(compared, 34, "every parameter's gradient");
    // Under candle's own backward the block's parameter gradients could not be handed on.
    let y = other.forward_t(&x, true).unwrap();
    let e = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("tandem_nn::backward"), "{e}");
}

#[test]
fn activation_checkpointing_gives_the_same_values_and_gradients() {
    same_values_and_gradients_as_the_plain_model(VitConfig::checkpointed);
}

/// Each block as one autograd node (`encoder_block`) computes what the op-by-op blocks do.
#[test]
fn fused_blocks_give_the_same_values_and_gradients() {
    same_values_and_gradients_as_the_plain_model(VitConfig::fused);
}

/// Fused blocks recomputed in backward (vit_b's and vit_l's training) too.
#[test]
fn fused_checkpointed_blocks_give_the_same_values_and_gradients() {
    same_values_and_gradients_as_the_plain_model(|cfg| cfg.checkpointed().fused());
}
