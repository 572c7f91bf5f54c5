//! clip_grad_norm against torch.nn.utils.clip_grad_norm_ (fixture from
//! tests/fixtures/optim/make_fixtures.py).

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use serde_json::Value as Json;
use tandem_optim::{clip_grad_norm, OptimError};

fn fixture() -> Json {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/optim/optimizers.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read optimizers.json"))
        .expect("parse optimizers.json")
}

fn tensor_of(j: &Json) -> Tensor {
    let shape: Vec<usize> =
        j["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    let data: Vec<f32> =
        j["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn clip_grad_norm_matches_torch() {
    let fx = fixture();
    let first_grads = fx["grads"][0].as_array().unwrap();
    let clip = fx["clip"].as_array().unwrap();
    assert!(clip
        .iter()
        .any(|c| c["max_norm"].as_f64().unwrap() < c["total_norm"].as_f64().unwrap()));
    assert!(clip
        .iter()
        .any(|c| c["max_norm"].as_f64().unwrap() > c["total_norm"].as_f64().unwrap()));
    for case in clip {
        let max_norm = case["max_norm"].as_f64().unwrap();
        let grads: Vec<Tensor> = first_grads.iter().map(tensor_of).collect();
        let params: Vec<Var> =
            grads.iter().map(|g| Var::zeros(g.dims(), g.dtype(), &Device::Cpu).unwrap()).collect();
        let mut store = GradStore::default();
        for (p, g) in params.iter().zip(&grads) {
            store.insert(p.as_tensor(), g.clone());
        }
        let total = clip_grad_norm(&params, &mut store, max_norm).unwrap();
        let want = case["total_norm"].as_f64().unwrap();
        // torch returns a float32 norm.
        assert!(
            (total - want).abs() <= 1e-6 * want,
            "max_norm {max_norm}: norm {total} vs torch {want}"
        );
        for (i, (p, w)) in params.iter().zip(case["grads_after"].as_array().unwrap()).enumerate() {
            let (ours, theirs) = (flat(store.get(p.as_tensor()).unwrap()), flat(&tensor_of(w)));
            for (a, b) in ours.iter().zip(&theirs) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "max_norm {max_norm}, grad {i}: {a} vs torch {b}"
                );
            }
        }
    }
}

#[test]
fn clip_ignores_params_without_grads_and_refuses_non_finite_norms() {
    let a = Var::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap();
    let b = Var::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut store = GradStore::default();
    store.insert(a.as_tensor(), Tensor::new(&[3.0f32, 4.0], &Device::Cpu).unwrap());
    let total = clip_grad_norm(&[a.clone(), b.clone()], &mut store, 1.0).unwrap();
    assert!((total - 5.0).abs() < 1e-12);
    let clipped = flat(store.get(a.as_tensor()).unwrap());
    assert!((clipped[0] - 0.6).abs() < 1e-6 && (clipped[1] - 0.8).abs() < 1e-6, "{clipped:?}");
    assert!(store.get(b.as_tensor()).is_none());

    store.insert(b.as_tensor(), Tensor::new(&[f32::INFINITY, 1.0], &Device::Cpu).unwrap());
    let before = flat(store.get(a.as_tensor()).unwrap());
    assert!(matches!(
        clip_grad_norm(&[a.clone(), b.clone()], &mut store, 1.0),
        Err(OptimError::NonFiniteNorm { .. })
    ));
    assert_eq!(flat(store.get(a.as_tensor()).unwrap()), before, "gradients changed on error");
    assert!(matches!(
        clip_grad_norm(&[a], &mut store, f64::NAN),
        Err(OptimError::InvalidMaxNorm(_))
    ));
}
