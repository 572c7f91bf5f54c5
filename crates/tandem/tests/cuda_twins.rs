//! Every CUDA path against its CPU twin, through the public ops a model uses: convolutions
//! through cuDNN (forward and both backwards, f32 and f16), BatchNorm (+ReLU, +residual add,
//! eval), grouped (depthwise) convolutions through cuDNN, PReLU, L2 normalise, the PartialFC head's margin and split cross-entropy, SGD (dense
//! and row-sparse) and AdamW in place, clipping's norm, the pinned upload, the phase clock, and
//! a training step of each face backbone family — IResNet, MobileFaceNet (depthwise
//! convolutions, PReLU, GDC) and the ViT (LayerNorm, attention, ReLU6, patch masking; with and
//! without activation checkpointing) — in f32 and in f16 under autocast. Elementwise optimizer updates must
//! be equal bit for bit; reductions agree within float rounding.
//!
//! Needs a `cuda` build and a GPU (`cargo test -p tandem --features cuda --test cuda_twins`;
//! scripts/gpu/validate.sh runs it on the device machine). Skipped, with the reason,
//! without either, unless TANDEM_REQUIRE_CUDA makes that a failure.
use std::process::ExitCode;

use tandem_testutil::harness;

fn main() -> ExitCode {
    // Required but unavailable: a failure (the tests' bodies only exist in a `cuda` build, so
    // running them anyway would pass them without checking anything).
    if let (Some(reason), Some(_)) = (unavailable(), std::env::var_os("TANDEM_REQUIRE_CUDA")) {
        eprintln!("TANDEM_REQUIRE_CUDA is set but: {reason}");
        return ExitCode::FAILURE;
    }
    let why = unavailable();
    // f32 convolutions compared at f32 precision: no TF32 in this process (read once per plan).
    std::env::set_var("TANDEM_ALLOW_TF32", "0");
    let tests = tandem_testutil::tests![
        cudnn_loads_and_reports_its_version,
        conv2d_matches_the_cpu_forward_and_both_backwards,
        grouped_conv2d_matches_the_cpu_forward_and_both_backwards,
        batch_norm_matches_the_cpu_in_every_fused_form,
        prelu_matches_the_cpu,
        normalize_matches_the_cpu,
        sgd_steps_equal_the_cpu_bit_for_bit_dense_and_row_sparse,
        adamw_steps_equal_the_cpu_bit_for_bit,
        clip_grad_norm_and_the_inf_check_match_the_cpu,
        partial_fc_head_matches_the_cpu,
        uploads_are_the_host_values,
        the_phase_clock_times_device_work,
        an_iresnet_training_step_matches_the_cpu,
        a_mobilefacenet_training_step_matches_the_cpu,
        a_vit_training_step_matches_the_cpu_with_and_without_checkpointing,
    ];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

fn unavailable() -> Option<String> {
    #[cfg(not(feature = "cuda"))]
    return Some("built without the `cuda` feature (cargo test -p tandem --features cuda)".into());
    #[cfg(feature = "cuda")]
    candle_core::Device::new_cuda(0).err().map(|e| format!("no CUDA device: {e}"))
}

#[cfg(feature = "cuda")]
mod twins {
    use candle_core::backprop::GradStore;
    use candle_core::{DType, Device, Module, Tensor, Var};
    use candle_nn::{ModuleT, VarBuilder, VarMap};

    pub fn gpu() -> Device {
        Device::new_cuda(0).expect("checked before the tests ran")
    }

    /// Deterministic values in [-1, 1) (xorshift), on the CPU.
    pub fn rand(seed: u64, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    pub fn values(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// max |gpu − cpu| / max(|cpu|), with `what` and the figure in the failure message.
    pub fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor, tol: f32) {
        assert_eq!(gpu.dims(), cpu.dims(), "{what}: shapes differ");
        let (g, c) = (values(gpu), values(cpu));
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-20);
        let gap = g.iter().zip(&c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(g.iter().all(|v| v.is_finite()), "{what}: non-finite values on the GPU");
        assert!(gap / scale <= tol, "{what}: relative gap {} > {tol} (scale {scale})", gap / scale);
        println!("  {what}: relative gap {:.2e}", gap / scale);
    }

    pub fn assert_bits(what: &str, gpu: &Tensor, cpu: &Tensor) {
        let (g, c) = (values(gpu), values(cpu));
        let differ = g.iter().zip(&c).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{what}: {differ} of {} values differ in their bits", c.len());
    }

    /// `Σ y·r` for a fixed ramp-like `r`, the loss every backward below differentiates.
    pub fn weighted_sum(y: &Tensor, seed: u64) -> Tensor {
        let r = rand(seed, y.dims()).to_device(y.device()).unwrap().to_dtype(y.dtype()).unwrap();
        (y * r).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap()
    }

    pub fn grad(g: &GradStore, t: &Tensor) -> Tensor {
        g.get(t).cloned().expect("a gradient")
    }

    /// A VarMap on `dev` built by `build`, its variables then set to `values` (by name).
    pub fn layer<L>(
        dev: &Device,
        build: impl FnOnce(VarBuilder) -> L,
        values: &[(&str, Tensor)],
    ) -> (L, VarMap) {
        let vm = VarMap::new();
        let l = build(VarBuilder::from_varmap(&vm, DType::F32, dev));
        {
            let data = vm.data().lock().unwrap();
            for (name, v) in values {
                data.get(*name)
                    .unwrap_or_else(|| panic!("no variable {name}"))
                    .set(&v.to_device(dev).unwrap())
                    .unwrap();
            }
        }
        (l, vm)
    }

    pub fn var(vm: &VarMap, name: &str) -> Var {
        vm.data().lock().unwrap().get(name).unwrap().clone()
    }

    pub fn forward_t<M: ModuleT>(m: &M, x: &Tensor, train: bool) -> Tensor {
        m.forward_t(x, train).unwrap()
    }

    pub fn forward<M: Module>(m: &M, x: &Tensor) -> Tensor {
        m.forward(x).unwrap()
    }

    /// `conv(x, w)` of `x0` by `w0` on the GPU against the CPU: the output and both gradients
    /// of `Σ y·r` (`seed` picks `r`), in f32 (relative 1e-5) and in f16 (2e-2).
    pub fn conv_matches_the_cpu(
        what: &str,
        (x0, w0): (&Tensor, &Tensor),
        seed: u64,
        conv: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    ) {
        let run = |d: &Device, dt: DType| {
            let x = Var::from_tensor(&x0.to_device(d).unwrap()).unwrap();
            let wv = Var::from_tensor(&w0.to_device(d).unwrap()).unwrap();
            let y = conv(&x.to_dtype(dt).unwrap(), &wv.to_dtype(dt).unwrap()).unwrap();
            let g = tandem::nn::backward(&weighted_sum(&y, seed)).unwrap();
            (y, grad(&g, x.as_tensor()), grad(&g, wv.as_tensor()))
        };
        let (y, gx, gw) = run(&Device::Cpu, DType::F32);
        for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 2e-2)] {
            let (yg, gxg, gwg) = run(&gpu(), dt);
            assert_eq!(yg.dtype(), dt, "{what}: output type");
            assert_close(&format!("{what} forward {dt:?}"), &yg, &y, tol);
            assert_close(&format!("{what} input gradient {dt:?}"), &gxg, &gx, tol);
            assert_close(&format!("{what} weight gradient {dt:?}"), &gwg, &gw, tol);
        }
    }
}

#[cfg(feature = "cuda")]
use twins::*;

fn cudnn_loads_and_reports_its_version() {
    #[cfg(feature = "cuda")]
    {
        let (version, path) = tandem::cuda::cudnn::library().unwrap();
        println!("cuDNN {version} from {path}");
        assert!(version >= 8000, "cuDNN {version} is older than 8");
    }
}

fn conv2d_matches_the_cpu_forward_and_both_backwards() {
    #[cfg(feature = "cuda")]
    {
        use tandem::nn::kernels::conv2d::{conv2d, ConvParams};
        // (n, c, h, w, o, k, stride, padding, dilation)
        for (i, &(n, c, h, w, o, k, stride, padding, dilation)) in [
            (2, 8, 14, 14, 16, 3, 1, 1, 1),
            (2, 16, 14, 14, 32, 3, 2, 1, 1),
            (2, 16, 8, 8, 32, 1, 2, 0, 1),
            (1, 4, 9, 9, 6, 3, 1, 2, 2),
            (2, 3, 112, 112, 8, 3, 1, 1, 1),
        ]
        .iter()
        .enumerate()
        {
            let p = ConvParams { stride, padding, dilation };
            let (x0, w0) = (rand(10 + i as u64, &[n, c, h, w]), rand(20 + i as u64, &[o, c, k, k]));
            let what = format!("conv {n}x{c}x{h}x{w} -> {o} k{k} s{stride} p{padding} d{dilation}");
            conv_matches_the_cpu(&what, (&x0, &w0), 7, |x, w| conv2d(x, w, p));
        }
    }
}

fn grouped_conv2d_matches_the_cpu_forward_and_both_backwards() {
    #[cfg(feature = "cuda")]
    {
        use tandem::nn::kernels::grouped_conv::{grouped_conv2d, GroupedConvParams};
        // MobileFaceNet's: depthwise 3x3 strides 1 and 2, the GDC's 7x7 without padding; and
        // two channels per group with dilation. (n, c, h, o, k, stride, padding, dilation, groups)
        for (i, &(n, c, h, o, k, stride, padding, dilation, groups)) in [
            (2, 16, 28, 16, 3, 1, 1, 1, 16),
            (2, 16, 28, 16, 3, 2, 1, 1, 16),
            (2, 32, 7, 32, 7, 1, 0, 1, 32),
            (2, 8, 9, 8, 3, 1, 2, 2, 4),
        ]
        .iter()
        .enumerate()
        {
            let p = GroupedConvParams { stride, padding, dilation, groups };
            let x0 = rand(30 + i as u64, &[n, c, h, h]);
            let w0 = rand(40 + i as u64, &[o, c / groups, k, k]);
            let what =
                format!("grouped conv {n}x{c}x{h}x{h} -> {o} k{k} s{stride} p{padding} d{dilation} g{groups}");
            conv_matches_the_cpu(&what, (&x0, &w0), 8, |x, w| grouped_conv2d(x, w, p));
        }
    }
}

fn batch_norm_matches_the_cpu_in_every_fused_form() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::{DType, Device, Tensor, Var};
        use tandem::nn::fast_batch_norm2d;
        let dev = gpu();
        let (n, c, h, w) = (4, 8, 7, 7);
        let params = [("weight", rand(1, &[c])), ("bias", rand(2, &[c]))];
        for form in ["plain", "relu", "add_relu", "eval"] {
            for dt in [DType::F32, DType::F16] {
                let run = |d: &Device| {
                    let (bn, vm) = layer(d, |vb| fast_batch_norm2d(c, vb).unwrap(), &params);
                    let x = Var::from_tensor(
                        &(rand(3, &[n, c, h, w]) * 3.0).unwrap().to_device(d).unwrap(),
                    )
                    .unwrap();
                    let r =
                        Var::from_tensor(&rand(4, &[n, c, h, w]).to_device(d).unwrap()).unwrap();
                    let cast =
                        |t: &Tensor| if d.is_cpu() { t.clone() } else { t.to_dtype(dt).unwrap() };
                    let (xi, ri) = (cast(x.as_tensor()), cast(r.as_tensor()));
                    let y = match form {
                        "plain" => forward_t(&bn, &xi, true),
                        "relu" => bn.forward_t_relu(&xi, true).unwrap(),
                        "add_relu" => bn.forward_t_add_relu(&xi, &ri, true).unwrap(),
                        _ => forward_t(&bn, &xi, false),
                    };
                    let g = tandem::nn::backward(&weighted_sum(&y, 5)).unwrap();
                    let (gw, gb) = (
                        grad(&g, var(&vm, "weight").as_tensor()),
                        grad(&g, var(&vm, "bias").as_tensor()),
                    );
                    let gr = (form == "add_relu").then(|| grad(&g, r.as_tensor()));
                    let stats = (bn.running_mean().clone(), bn.running_var().clone());
                    (y, grad(&g, x.as_tensor()), gw, gb, gr, stats)
                };
                let cpu = run(&Device::Cpu);
                let gpu_out = run(&dev);
                let tol = if dt == DType::F32 { 1e-5 } else { 2e-2 };
                let what = format!("batch norm {form} {dt:?}");
                assert_close(&format!("{what} output"), &gpu_out.0, &cpu.0, tol);
                assert_close(&format!("{what} input gradient"), &gpu_out.1, &cpu.1, tol * 10.0);
                assert_close(&format!("{what} weight gradient"), &gpu_out.2, &cpu.2, tol);
                assert_close(&format!("{what} bias gradient"), &gpu_out.3, &cpu.3, tol);
                if let (Some(a), Some(b)) = (&gpu_out.4, &cpu.4) {
                    assert_close(&format!("{what} residual gradient"), a, b, tol);
                }
                assert_close(&format!("{what} running mean"), &gpu_out.5 .0, &cpu.5 .0, tol);
                assert_close(&format!("{what} running var"), &gpu_out.5 .1, &cpu.5 .1, tol);
            }
        }
    }
}

fn prelu_matches_the_cpu() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::{DType, Device, Var};
        use tandem::nn::fast_prelu;
        let dev = gpu();
        for (c, dims) in [(8, vec![4, 8, 5, 5]), (1, vec![3, 10])] {
            for dt in [DType::F32, DType::BF16] {
                let run = |d: &Device| {
                    let (p, vm) =
                        layer(d, |vb| fast_prelu(c, vb).unwrap(), &[("weight", rand(6, &[c]))]);
                    let x = Var::from_tensor(&rand(7, &dims).to_device(d).unwrap()).unwrap();
                    let xi =
                        if d.is_cpu() { x.as_tensor().clone() } else { x.to_dtype(dt).unwrap() };
                    let y = forward(&p, &xi);
                    let g = tandem::nn::backward(&weighted_sum(&y, 8)).unwrap();
                    (y, grad(&g, x.as_tensor()), grad(&g, var(&vm, "weight").as_tensor()))
                };
                let (cpu, gpu_out) = (run(&Device::Cpu), run(&dev));
                let tol = if dt == DType::F32 { 1e-6 } else { 2e-2 };
                assert_close(&format!("prelu {c} {dt:?} output"), &gpu_out.0, &cpu.0, tol);
                assert_close(&format!("prelu {c} {dt:?} input gradient"), &gpu_out.1, &cpu.1, tol);
                assert_close(
                    &format!("prelu {c} {dt:?} slope gradient"),
                    &gpu_out.2,
                    &cpu.2,
                    tol.max(1e-5),
                );
            }
        }
    }
}

fn normalize_matches_the_cpu() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::{Device, Tensor, Var};
        let dev = gpu();
        let x0 = Tensor::cat(
            &[
                rand(9, &[64, 512]),
                Tensor::zeros((1, 512), candle_core::DType::F32, &Device::Cpu).unwrap(),
            ],
            0,
        )
        .unwrap();
        let run = |d: &Device| {
            let x = Var::from_tensor(&x0.to_device(d).unwrap()).unwrap();
            let y = tandem::nn::functional::normalize(x.as_tensor()).unwrap();
            let g = tandem::nn::backward(&weighted_sum(&y, 10)).unwrap();
            (y, grad(&g, x.as_tensor()))
        };
        let (cpu, gpu_out) = (run(&Device::Cpu), run(&dev));
        assert_close("normalize output", &gpu_out.0, &cpu.0, 1e-6);
        assert_close("normalize gradient", &gpu_out.1, &cpu.1, 1e-5);
    }
}

#[cfg(feature = "cuda")]
fn optimizer_run(
    dev: &candle_core::Device,
    make: &dyn Fn(Vec<candle_core::Var>) -> Box<dyn tandem::optim::TorchOptimizer>,
    rows: Option<&[u32]>,
) -> Vec<candle_core::Tensor> {
    use candle_core::backprop::GradStore;
    use candle_core::Var;
    let (r, c) = (40, 24);
    let p = Var::from_tensor(&rand(30, &[r, c]).to_device(dev).unwrap()).unwrap();
    let mut opt = make(vec![p.clone()]);
    let mut out = Vec::new();
    for step in 0..3u64 {
        let mut grads = GradStore::default();
        let g = match rows {
            Some(rows) => {
                opt.set_grad_rows(0, rows.to_vec()).unwrap();
                rand(40 + step, &[rows.len(), c])
            }
            None => rand(40 + step, &[r, c]),
        };
        grads.insert(p.as_tensor(), g.to_device(dev).unwrap());
        opt.step(&grads).unwrap();
        out.push(p.as_tensor().copy().unwrap());
    }
    out
}

fn sgd_steps_equal_the_cpu_bit_for_bit_dense_and_row_sparse() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::Device;
        use tandem::optim::{SgdConfig, TorchOptimizer, TorchSgd};
        let dev = gpu();
        let configs = [
            SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                dampening: 0.0,
                weight_decay: 5e-4,
                nesterov: false,
            },
            SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.0,
                weight_decay: 0.0,
                nesterov: true,
            },
            SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                dampening: 0.0,
                weight_decay: 1e-3,
                nesterov: true,
            },
            SgdConfig {
                lr: 0.2,
                momentum: 0.0,
                dampening: 0.0,
                weight_decay: 1e-4,
                nesterov: false,
            },
            SgdConfig {
                lr: 0.1,
                momentum: 0.8,
                dampening: 0.1,
                weight_decay: 5e-4,
                nesterov: false,
            },
        ];
        let rows: &[u32] = &[0, 3, 4, 17, 39];
        for cfg in configs {
            let make = |p: Vec<candle_core::Var>| -> Box<dyn TorchOptimizer> {
                Box::new(TorchSgd::new(p, cfg.clone()).unwrap())
            };
            for sparse in [None, Some(rows)] {
                let cpu = optimizer_run(&Device::Cpu, &make, sparse);
                let gpu_out = optimizer_run(&dev, &make, sparse);
                for (step, (a, b)) in gpu_out.iter().zip(&cpu).enumerate() {
                    let kind = if sparse.is_some() { "row-sparse" } else { "dense" };
                    assert_bits(&format!("SGD {cfg:?} {kind} step {step}"), a, b);
                }
            }
        }
    }
}

fn adamw_steps_equal_the_cpu_bit_for_bit() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::Device;
        use tandem::optim::{AdamWConfig, TorchAdamW, TorchOptimizer};
        let dev = gpu();
        for amsgrad in [false, true] {
            let cfg = AdamWConfig {
                lr: 1e-3,
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 0.05,
                amsgrad,
            };
            let make = |p: Vec<candle_core::Var>| -> Box<dyn TorchOptimizer> {
                Box::new(TorchAdamW::new(p, cfg.clone()).unwrap())
            };
            let cpu = optimizer_run(&Device::Cpu, &make, None);
            let gpu_out = optimizer_run(&dev, &make, None);
            for (step, (a, b)) in gpu_out.iter().zip(&cpu).enumerate() {
                assert_bits(&format!("AdamW amsgrad={amsgrad} step {step}"), a, b);
            }
        }
    }
}

fn clip_grad_norm_and_the_inf_check_match_the_cpu() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::backprop::GradStore;
        use candle_core::{Device, Var};
        use tandem::optim::clip_grad_norm;
        let dev = gpu();
        let shapes: [&[usize]; 3] = [&[64, 3, 3, 3], &[512], &[1000, 37]];
        let run = |d: &Device| {
            let params: Vec<Var> = shapes
                .iter()
                .map(|s| Var::zeros(*s, candle_core::DType::F32, d).unwrap())
                .collect();
            let mut grads = GradStore::default();
            for (i, (p, s)) in params.iter().zip(shapes).enumerate() {
                grads.insert(
                    p.as_tensor(),
                    (rand(50 + i as u64, s) * 3.0).unwrap().to_device(d).unwrap(),
                );
            }
            let norm = clip_grad_norm(&params, &mut grads, 1.0).unwrap();
            let clipped: Vec<_> = params.iter().map(|p| grad(&grads, p.as_tensor())).collect();
            (norm, clipped)
        };
        let (cpu_norm, cpu) = run(&Device::Cpu);
        let (gpu_norm, gpu_out) = run(&dev);
        println!("  clip: norm {gpu_norm} on the GPU, {cpu_norm} on the CPU");
        assert!(((gpu_norm - cpu_norm) / cpu_norm).abs() < 1e-12, "{gpu_norm} vs {cpu_norm}");
        for (i, (a, b)) in gpu_out.iter().zip(&cpu).enumerate() {
            assert_close(&format!("clipped gradient {i}"), a, b, 1e-6);
        }
        let finite = rand(60, &[100]).to_device(&dev).unwrap();
        let mut v = vec![0f32; 100];
        v[37] = f32::INFINITY;
        let inf = candle_core::Tensor::from_vec(v, 100, &dev).unwrap();
        let flag = |ts: &[&candle_core::Tensor]| {
            tandem::cuda::reduce::any_nonfinite(ts).unwrap().to_vec1::<i32>().unwrap()[0]
        };
        assert_eq!(flag(&[&finite]), 0);
        assert_eq!(flag(&[&finite, &inf]), 1);
    }
}

fn partial_fc_head_matches_the_cpu() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::{Device, Var};
        use std::sync::Arc;
        use tandem::comm::{Collectives, SingleProcess};
        use tandem::partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};
        let dev = gpu();
        let (classes, e, n) = (300, 64, 16);
        let labels: Vec<i64> = (0..n as i64).map(|i| (i * 37) % classes as i64).collect();
        let margins = [
            CombinedMarginLoss::arcface(64.0, 0.5),
            CombinedMarginLoss::cosface(64.0, 0.4),
            CombinedMarginLoss::new(64.0, 1.0, 0.5, 0.0, 0.1).unwrap(),
        ];
        for margin in margins {
            for sample_rate in [1.0, 0.5] {
                let run = |d: &Device| {
                    let comm: Arc<dyn Collectives> = Arc::new(SingleProcess);
                    let mut cfg = PartialFcConfig::new(classes, e, margin);
                    cfg.sample_rate = sample_rate;
                    cfg.seed = 3;
                    let full = (rand(70, &[classes, e]) * 0.1).unwrap().to_device(d).unwrap();
                    let mut head = PartialFc::from_full_weight(cfg, comm, &full).unwrap();
                    let emb = Var::from_tensor(&rand(71, &[n, e]).to_device(d).unwrap()).unwrap();
                    let loss = head.forward(emb.as_tensor(), &labels).unwrap();
                    let g = loss.backward().unwrap();
                    let gw = grad(&g, head.grad_leaf().as_tensor());
                    (loss, grad(&g, emb.as_tensor()), gw, head.last_index().map(<[usize]>::to_vec))
                };
                let (cpu, gpu_out) = (run(&Device::Cpu), run(&dev));
                let what = format!("PartialFC {margin:?} rate {sample_rate}");
                assert_eq!(gpu_out.3, cpu.3, "{what}: the same centres sampled");
                assert_close(&format!("{what} loss"), &gpu_out.0, &cpu.0, 1e-4);
                assert_close(&format!("{what} embedding gradient"), &gpu_out.1, &cpu.1, 1e-3);
                assert_close(&format!("{what} centre gradient"), &gpu_out.2, &cpu.2, 1e-3);
            }
        }
    }
}

fn uploads_are_the_host_values() {
    #[cfg(feature = "cuda")]
    {
        let candle_core::Device::Cuda(d) = gpu() else { unreachable!("a CUDA device") };
        let mut up = tandem::cuda::upload::Uploader::new(&d).unwrap();
        // More uploads than staging buffers, two sizes, each read back.
        let sizes = [1000usize, 1000, 7, 1000, 1000, 7, 1000];
        let sent: Vec<Vec<f32>> =
            sizes.iter().enumerate().map(|(i, &n)| values(&rand(80 + i as u64, &[n]))).collect();
        let got: Vec<_> = sent.iter().map(|v| up.upload_f32(v, v.len()).unwrap()).collect();
        for (i, (t, v)) in got.iter().zip(&sent).enumerate() {
            assert_eq!(&values(t), v, "upload {i}");
        }
    }
}

fn the_phase_clock_times_device_work() {
    #[cfg(feature = "cuda")]
    {
        let dev = gpu();
        let a = rand(90, &[2048, 2048]).to_device(&dev).unwrap();
        dev.synchronize().unwrap();
        let mut clock = tandem::cuda::timing::PhaseClock::start(&dev).unwrap();
        let queued = std::time::Instant::now();
        let mut b = a.clone();
        for _ in 0..20 {
            b = b.matmul(&a).unwrap().affine(1e-3, 0.0).unwrap();
        }
        let queueing = queued.elapsed().as_secs_f64();
        clock.mark().unwrap();
        let _ = b.sum_all().unwrap();
        clock.mark().unwrap();
        let phases = clock.finish().unwrap();
        println!("  phase clock: {phases:?} s (queueing took {queueing:.6} s on the host)");
        assert_eq!(phases.len(), 2);
        assert!(phases.iter().all(|p| p.is_finite() && *p >= 0.0), "{phases:?}");
        assert!(phases[0] > 0.0, "20 matmuls of 2048² take device time: {phases:?}");
    }
}

fn an_iresnet_training_step_matches_the_cpu() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        use tandem::models::IResNet;
        backbone_step_matches(
            "IResNet-18 w8",
            |vars, d| {
                let m = IResNet::new(18, 8, 32, 0.0, vars.var_builder(DType::F32, d)).unwrap();
                IResNet::reset_parameters(&vars.named(), 11).unwrap();
                m
            },
            |m, x| m.forward_t(x, true),
            &["conv1.weight", "layer1.0.bn1.weight", "fc.weight"],
        );
    }
}

/// A face backbone's training step on the CPU and on the GPU (f32, then f16 under autocast):
/// the embeddings and the gradients of the named variables agree. `build` makes the model on a
/// device from an [`tandem::nn::OrderedVarMap`] and initialises it from a seed; `forward` runs a
/// training forward.
#[cfg(feature = "cuda")]
fn backbone_step_matches<M>(
    what: &str,
    build: impl Fn(&tandem::nn::OrderedVarMap, &candle_core::Device) -> M,
    forward: impl Fn(&M, &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
    watched: &[&str],
) {
    use candle_core::{DType, Device};
    let run = |d: &Device, autocast: Option<DType>| {
        let vars = tandem::nn::OrderedVarMap::new();
        let model = build(&vars, d);
        let x = rand(12, &[2, 3, 112, 112]).to_device(d).unwrap();
        let emb = tandem::nn::autocast(autocast, || forward(&model, &x)).unwrap();
        let emb = emb.to_dtype(DType::F32).unwrap();
        let g = tandem::nn::backward(&weighted_sum(&emb, 13)).unwrap();
        let named = vars.named();
        let grads: Vec<_> = watched
            .iter()
            .map(|name| {
                let v =
                    &named.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no {name}")).1;
                grad(&g, v.as_tensor())
            })
            .collect();
        (emb, grads)
    };
    let cpu = run(&Device::Cpu, None);
    for (autocast, tol) in [(None, 1e-3), (Some(DType::F16), 5e-2)] {
        let g = run(&gpu(), autocast);
        let what = format!("{what} step, autocast {autocast:?}");
        assert_close(&format!("{what}: embeddings"), &g.0, &cpu.0, tol);
        for ((name, gg), gc) in watched.iter().zip(&g.1).zip(&cpu.1) {
            assert_close(&format!("{what}: {name} gradient"), gg, gc, tol);
        }
    }
}

fn a_mobilefacenet_training_step_matches_the_cpu() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        use tandem::models::MobileFaceNet;
        backbone_step_matches(
            "MobileFaceNet mbf",
            |vars, d| {
                let (blocks, scale) = MobileFaceNet::MBF;
                let m =
                    MobileFaceNet::new(blocks, scale, 64, vars.var_builder(DType::F32, d)).unwrap();
                MobileFaceNet::reset_parameters(&vars.named(), 21).unwrap();
                m
            },
            |m, x| candle_nn::ModuleT::forward_t(m, x, true),
            &[
                "layers.0.layers.0.weight",
                "layers.2.layers.1.layers.0.weight",
                "features.layers.0.layers.0.weight",
                "features.layers.2.weight",
            ],
        );
    }
}

fn a_vit_training_step_matches_the_cpu_with_and_without_checkpointing() {
    #[cfg(feature = "cuda")]
    {
        use candle_core::DType;
        use tandem::models::{Vit, VitConfig};
        // Two blocks at width 64 (8 heads of 8), masking on, no stochastic depth: the same
        // seeded patch mask on both devices.
        for cfg in [VitConfig::new(64, 2, 0.0, 0.1), VitConfig::new(64, 2, 0.0, 0.1).checkpointed()]
        {
            backbone_step_matches(
                &format!("ViT w64 x2 (checkpointed: {})", cfg.using_checkpoint),
                |vars, d| {
                    let m = Vit::new(cfg, 32, vars.var_builder(DType::F32, d)).unwrap();
                    Vit::reset_parameters(&vars.named(), 31).unwrap();
                    m.seed(32);
                    m
                },
                |m, x| m.forward_t(x, true),
                &["patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight"],
            );
        }
    }
}
