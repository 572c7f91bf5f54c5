//! tandem's CPU conv2d kernels against PyTorch (fixtures/conv/make_fixture.py): outputs and the
//! gradients of sum(y * r) for strides 1/2, padding 0/1/2, dilation 2, 1x1, batch 1, odd and
//! non-square sizes, 3x3 "same" convolutions on maps down to 1x1 — at 1 thread and at 3 (images
//! spread over threads vs. inside the gemm), through the im2col paths and Winograd's.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var};
use tandem_nn::kernels::conv2d::{conv2d, ConvParams};

fn fixture() -> HashMap<String, Tensor> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conv/conv2d.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Largest |a - b| relative to max(1, |b|).
fn gap(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let (a, b): (Vec<f32>, Vec<f32>) =
        (a.flatten_all().unwrap().to_vec1().unwrap(), b.flatten_all().unwrap().to_vec1().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

fn check_all_cases(threads: usize) {
    let f = fixture();
    let cases = (0..).take_while(|i| f.contains_key(&format!("case{i}.x"))).count();
    assert!(cases >= 16, "fixture has {cases} cases");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        for i in 0..cases {
            let t = |name: &str| f[&format!("case{i}.{name}")].clone();
            let cfg: Vec<i64> = t("cfg").to_vec1().unwrap();
            let p = ConvParams {
                stride: cfg[0] as usize,
                padding: cfg[1] as usize,
                dilation: cfg[2] as usize,
            };
            let x = Var::from_tensor(&t("x")).unwrap();
            let w = Var::from_tensor(&t("w")).unwrap();
            let y = conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
            let what =
                format!("case {i} {:?} * {:?} {p:?}, {threads} thread(s)", x.dims(), w.dims());
            let dy = gap(&y, &t("y"));
            assert!(dy < 1e-4, "{what}: output differs by {dy}");
            let grads = (y * t("r")).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = gap(grads.get(x.as_tensor()).unwrap(), &t("gx"));
            let dw = gap(grads.get(w.as_tensor()).unwrap(), &t("gw"));
            assert!(
                dx < 1e-4 && dw < 1e-4,
                "{what}: input gradient off by {dx}, weight gradient by {dw}"
            );
        }
    });
}

/// Every case through every strategy (per-image gemms, one batched gemm, and Winograd with 2x2
/// and with 4x4 tiles for each 3x3 "same" convolution) and thread counts; one test, as the
/// strategy switches are process-wide.
#[test]
fn outputs_and_gradients_match_pytorch_per_image_batched_and_winograd_on_one_and_three_threads() {
    use std::sync::atomic::Ordering;
    use tandem_nn::kernels::conv2d::BATCHED_BELOW_PIXELS;
    use tandem_nn::kernels::winograd::{MIN_CHANNELS, TILE_SIDE, WEIGHTS_DECIDE};
    let (batched, winograd) =
        (BATCHED_BELOW_PIXELS.load(Ordering::Relaxed), MIN_CHANNELS.load(Ordering::Relaxed));
    for (below, min_channels, tile) in
        [(0, usize::MAX, 0), (usize::MAX, usize::MAX, 0), (0, 1, 2), (0, 1, 4)]
    {
        BATCHED_BELOW_PIXELS.store(below, Ordering::Relaxed);
        MIN_CHANNELS.store(min_channels, Ordering::Relaxed);
        TILE_SIDE.store(tile, Ordering::Relaxed);
        // Winograd on every eligible shape, the ones whose weights outweigh their tiles too.
        WEIGHTS_DECIDE.store(min_channels == usize::MAX, Ordering::Relaxed);
        check_all_cases(1);
        check_all_cases(3);
    }
    BATCHED_BELOW_PIXELS.store(batched, Ordering::Relaxed);
    MIN_CHANNELS.store(winograd, Ordering::Relaxed);
    TILE_SIDE.store(0, Ordering::Relaxed);
    WEIGHTS_DECIDE.store(true, Ordering::Relaxed);
}

#[test]
fn data_inputs_get_no_gradient_and_bad_shapes_name_the_problem() {
    let dev = Device::Cpu;
    let x = Tensor::ones((1, 2, 5, 5), candle_core::DType::F32, &dev).unwrap();
    let w = Var::ones((3, 2, 3, 3), candle_core::DType::F32, &dev).unwrap();
    let p = ConvParams { stride: 1, padding: 0, dilation: 1 };
    let g = conv2d(&x, w.as_tensor(), p).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(g.get(&x).is_none(), "the data needs no gradient");
    assert_eq!(g.get(w.as_tensor()).unwrap().dims(), [3, 2, 3, 3]);
    let bad = Tensor::ones((1, 4, 5, 5), candle_core::DType::F32, &dev).unwrap();
    let err = conv2d(&bad, w.as_tensor(), p).unwrap_err().to_string();
    assert!(err.contains("4 channels"), "{err}");
    let small = Tensor::ones((1, 2, 2, 2), candle_core::DType::F32, &dev).unwrap();
    let err = conv2d(&small, w.as_tensor(), p).unwrap_err().to_string();
    assert!(err.contains("larger than the padded input"), "{err}");
}

/// `nn::FastBatchNorm2d` in training mode (the fused kernel) against torch's `BatchNorm2d`: output,
/// input/weight/bias gradients, and the running statistics after one step.
#[test]
fn batch_norm_training_step_matches_pytorch() {
    use candle_nn::{ModuleT, VarBuilder, VarMap};
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conv/batch_norm.safetensors");
    let f = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let cases = (0..).take_while(|i| f.contains_key(&format!("bn{i}.x"))).count();
    assert!(cases >= 4);
    for i in 0..cases {
        let t = |name: &str| f[&format!("bn{i}.{name}")].clone();
        let x = Var::from_tensor(&t("x")).unwrap();
        let c = x.dim(1).unwrap();
        let vm = VarMap::new();
        let bn = tandem_nn::fast_batch_norm2d(
            c,
            VarBuilder::from_varmap(&vm, candle_core::DType::F32, &Device::Cpu),
        )
        .unwrap();
        let (gamma, beta) = {
            let data = vm.data().lock().unwrap();
            data["weight"].set(&t("gamma")).unwrap();
            data["bias"].set(&t("beta")).unwrap();
            (data["weight"].clone(), data["bias"].clone())
        };
        let y = bn.forward_t(x.as_tensor(), true).unwrap();
        let what = format!("batch-norm case {i} {:?}", x.dims());
        assert!(gap(&y, &t("y")) < 1e-4, "{what}: output differs by {}", gap(&y, &t("y")));
        let g = (y * t("r")).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, var) in [("gx", &x), ("ggamma", &gamma), ("gbeta", &beta)] {
            let d = gap(g.get(var.as_tensor()).unwrap(), &t(name));
            assert!(d < 1e-4, "{what}: {name} differs by {d}");
        }
        for name in ["running_mean", "running_var"] {
            let ours = if name == "running_mean" { bn.running_mean() } else { bn.running_var() };
            let d = gap(ours, &t(name));
            assert!(d < 1e-5, "{what}: {name} differs by {d}");
        }
    }
}

/// The fused PReLU kernel against torch's `F.prelu`: outputs and both gradients, per-channel
/// and single slopes, 2-, 3- and 4-d inputs, batch 1, exact zeros in the input.
#[test]
fn prelu_matches_pytorch() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conv/prelu.safetensors");
    let f = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cases = (0..).take_while(|i| f.contains_key(&format!("prelu{i}.x"))).count();
    assert!(cases >= 6, "fixture has {cases} PReLU cases");
    for i in 0..cases {
        let t = |name: &str| f[&format!("prelu{i}.{name}")].clone();
        let x = Var::from_tensor(&t("x")).unwrap();
        let a = Var::from_tensor(&t("a")).unwrap();
        let what = format!("PReLU case {i} {:?} with {} slope(s)", x.dims(), a.dim(0).unwrap());
        let y = tandem_nn::kernels::prelu::prelu(x.as_tensor(), a.as_tensor()).unwrap();
        assert!(gap(&y, &t("y")) < 1e-6, "{what}: output differs by {}", gap(&y, &t("y")));
        let g = (y * t("r")).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, var) in [("gx", &x), ("ga", &a)] {
            let d = gap(g.get(var.as_tensor()).unwrap(), &t(name));
            assert!(d < 1e-4, "{what}: {name} differs by {d}");
        }
    }
}

/// The max-pool kernel against torch's `max_pool2d`: outputs and gradients (ties included).
#[test]
fn max_pool_matches_pytorch() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conv/max_pool.safetensors");
    let f = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let cases = (0..).take_while(|i| f.contains_key(&format!("pool{i}.x"))).count();
    assert!(cases >= 4);
    for i in 0..cases {
        let t = |name: &str| f[&format!("pool{i}.{name}")].clone();
        let cfg: Vec<i64> = t("cfg").to_vec1().unwrap();
        let x = Var::from_tensor(&t("x")).unwrap();
        let y =
            tandem_nn::kernels::pool::max_pool2d(x.as_tensor(), cfg[0] as usize, cfg[1] as usize)
                .unwrap();
        assert_eq!(gap(&y, &t("y")), 0.0, "max-pool case {i}: outputs are copies");
        let g = (y * t("r")).unwrap().sum_all().unwrap().backward().unwrap();
        let d = gap(g.get(x.as_tensor()).unwrap(), &t("gx"));
        assert!(d < 1e-6, "max-pool case {i}: input gradient differs by {d}");
    }
}

/// The average-pooling kernels against torch's `avg_pool2d` and `adaptive_avg_pool2d`.
#[test]
fn average_pools_match_pytorch() {
    use tandem_nn::kernels::pool::{adaptive_avg_pool2d, avg_pool2d};
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conv/avg_pool.safetensors");
    let f = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let cases = (0..).take_while(|i| f.contains_key(&format!("avg{i}.x"))).count();
    assert!(cases >= 5);
    for i in 0..cases {
        let t = |name: &str| f[&format!("avg{i}.{name}")].clone();
        let cfg: Vec<i64> = t("cfg").to_vec1().unwrap();
        let (a, b) = (cfg[1] as usize, cfg[2] as usize);
        let x = Var::from_tensor(&t("x")).unwrap();
        let y = if cfg[0] == 0 {
            avg_pool2d(x.as_tensor(), a, b)
        } else {
            adaptive_avg_pool2d(x.as_tensor(), (a, b))
        }
        .unwrap();
        let d = gap(&y, &t("y"));
        assert!(d < 1e-5, "average-pool case {i} {cfg:?}: output differs by {d}");
        let g = (y * t("r")).unwrap().sum_all().unwrap().backward().unwrap();
        let d = gap(g.get(x.as_tensor()).unwrap(), &t("gx"));
        assert!(d < 1e-5, "average-pool case {i} {cfg:?}: input gradient differs by {d}");
    }
}
