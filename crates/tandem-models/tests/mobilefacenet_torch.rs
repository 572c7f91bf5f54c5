//! MobileFaceNet against arcface_torch's layout in PyTorch (fixtures/mobilefacenet/make_fixture.py):
//! two variants (the 64-group stem block of `mbf`, and a Residual first stage as `mbf_large`'s)
//! with weights, input and probe from an integer hash both sides compute: the same state-dict
//! keys in the same order, and the eval- and train-mode embeddings, every parameter's gradient
//! and the BatchNorm statistics after the forward are as close to torch's float64 run as torch's
//! own float32 run is (within 3x).
mod common;

use candle_core::{DType, Device, Tensor};
use common::{filled, fixture, formula, judge, judge_gradients};
use tandem_models::MobileFaceNet;
use tandem_nn::OrderedVarMap;

/// PReLU slopes near 0.25 (the third module of a ConvBlock's `layers`); the rest as
/// [`filled`]'s defaults.
fn prelu_near_default(name: &str, shape: &[usize], i: f64) -> Option<Tensor> {
    (name.ends_with("layers.2.weight") && !name.starts_with("features."))
        .then(|| formula(shape, i, 1.0).abs().unwrap().affine(0.2, 0.25).unwrap())
}

fn check_variant(variant: &str, blocks: [usize; 4], scale: usize) {
    let f = fixture("mobilefacenet", "mobilefacenet.safetensors");
    let vars = OrderedVarMap::new();
    let model =
        MobileFaceNet::new(blocks, scale, 16, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
    // torch's float tensors (num_batches_tracked is an integer counter there).
    let named: Vec<_> =
        vars.named().into_iter().filter(|(n, _)| !n.ends_with("num_batches_tracked")).collect();
    let ours: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(
        ours,
        common::keys("mobilefacenet", "mobilefacenet_keys.json", variant),
        "{variant}: creation order = torch's state_dict order"
    );
    for (i, (name, var)) in named.iter().enumerate() {
        var.set(&filled(name, var.dims(), i, prelu_near_default)).unwrap();
    }
    let x = formula(&[4, 3, 112, 112], 0.5, 1.0);
    let probe = formula(&[4, 16], 1.5, 1.0);
    // Eval first, as the fixture: with the running statistics before the training forward.
    let eval = model.forward_t(&x, false).unwrap();
    let mut worst = judge(&eval, &f, &format!("{variant}.eval"), "eval-mode embedding");
    let emb = model.forward_t(&x, true).unwrap();
    worst = worst.max(judge(&emb, &f, &format!("{variant}.train"), "train-mode embedding"));
    let grads = (&emb * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let (share, checked) = judge_gradients(&named, &grads, &f, variant);
    worst = worst.max(share);
    assert!(checked > 40, "{variant}: {checked} gradients checked");
    eprintln!("{variant}: largest share of the allowed error used: {worst:.2}");
}

#[test]
fn mbf_stem_block_in_64_groups_matches_torch() {
    check_variant("a", [1, 1, 1, 1], 2);
}

#[test]
fn residual_first_stage_as_mbf_large_matches_torch() {
    check_variant("b", [2, 1, 1, 1], 1);
}

#[test]
fn arcface_torch_s_sizes_and_bad_shapes() {
    for ((blocks, scale), params) in
        [(MobileFaceNet::MBF, 2_059_520usize), (MobileFaceNet::MBF_LARGE, 6_314_880)]
    {
        let vars = OrderedVarMap::new();
        let vb = vars.var_builder(DType::F32, &Device::Cpu);
        MobileFaceNet::new(blocks, scale, 512, vb).unwrap();
        let trainable: usize = vars
            .named()
            .iter()
            .filter(|(n, _)| !n.contains("running_") && !n.ends_with("num_batches_tracked"))
            .map(|(_, v)| v.elem_count())
            .sum();
        // torch: sum(p.numel() for p in get_model("mbf" / "mbf_large").parameters())
        assert_eq!(trainable, params, "{blocks:?} x{scale}");
    }
    let vars = OrderedVarMap::new();
    let vb = vars.var_builder(DType::F32, &Device::Cpu);
    let e = MobileFaceNet::new([1, 0, 1, 1], 2, 512, vb.clone()).err().unwrap().to_string();
    assert!(e.contains("blocks"), "{e}");
    let model = MobileFaceNet::new([1, 1, 1, 1], 1, 8, vb).unwrap();
    let e =
        model.forward_t(&Tensor::zeros((1, 3, 64, 64), DType::F32, &Device::Cpu).unwrap(), false);
    assert!(e.unwrap_err().to_string().contains("112"));
}
