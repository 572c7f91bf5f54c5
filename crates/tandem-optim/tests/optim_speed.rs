//! Optimizer step speed against torch on the same parameter sizes, measured in the same run
//! and printed as a ratio (never asserted). Run with:
//! `cargo test -p tandem-optim --test optim_speed -- --ignored --nocapture`
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use tandem_optim::{AdamWConfig, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};

const NUMEL: usize = 1 << 20;
const TENSORS: usize = 8;
const REPS: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time_ours(kind: &str) -> f64 {
    let vars: Vec<Var> =
        (0..TENSORS).map(|_| Var::randn(0f32, 1f32, NUMEL, &Device::Cpu).unwrap()).collect();
    let mut grads = GradStore::default();
    for v in &vars {
        grads.insert(v.as_tensor(), Tensor::randn(0f32, 1f32, NUMEL, &Device::Cpu).unwrap());
    }
    let mut opt: Box<dyn TorchOptimizer> = match kind {
        "adamw" => Box::new(TorchAdamW::new(vars.clone(), AdamWConfig::default()).unwrap()),
        _ => Box::new(
            TorchSgd::new(
                vars.clone(),
                SgdConfig { lr: 0.1, momentum: 0.9, weight_decay: 5e-4, ..Default::default() },
            )
            .unwrap(),
        ),
    };
    let mut times = Vec::new();
    for i in 0..REPS + 2 {
        let t = Instant::now();
        opt.step(&grads).unwrap();
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    assert_eq!(vars[0].dtype(), DType::F32);
    median(times)
}

fn time_torch(python: &std::path::Path, kind: &str) -> f64 {
    let script = format!(
        r#"
import time, torch
ps = [torch.nn.Parameter(torch.randn({NUMEL})) for _ in range({TENSORS})]
for p in ps: p.grad = torch.randn({NUMEL})
opt = torch.optim.AdamW(ps) if "{kind}" == "adamw" else torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=5e-4)
ts = []
for i in range({REPS} + 2):
    t = time.perf_counter(); opt.step(); ts.append(time.perf_counter() - t)
ts = sorted(ts[2:]); print(ts[len(ts) // 2])
"#
    );
    let out = tandem_testutil::output_with_deadline(
        std::process::Command::new(python).arg("-c").arg(script),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
#[ignore = "benchmark: prints timings, run explicitly"]
fn optimizer_step_speed_vs_torch() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    for kind in ["sgd_momentum_wd", "adamw"] {
        let ours = time_ours(kind);
        let torch = time_torch(&python, kind);
        println!(
            "{kind}: {TENSORS} x {NUMEL} f32 params, median of {REPS} steps: tandem {:.2} ms, torch {:.2} ms, ratio {:.2}x",
            ours * 1e3,
            torch * 1e3,
            ours / torch
        );
    }
}
