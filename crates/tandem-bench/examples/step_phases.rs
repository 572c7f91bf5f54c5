//! Where one training step's time goes on this machine, phase by phase (forward, loss,
//! backward, optimizer), for the bench models on one process:
//! `cargo run --release -p tandem-bench --example step_phases -- mlp|cnn|resnet18 [BATCH] [WIDTH]`
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use tandem::models::{Cnn, Mlp, ResNet};
use tandem::nn::{OrderedVarMap, ParamModule};
use tandem::optim::{SgdConfig, TorchSgd};

fn main() -> anyhow::Result<()> {
    tandem::nn::join_compute_pool();
    tandem::nn::tune_allocator();
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).map(String::as_str).unwrap_or("mlp");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(128);
    let width: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    let dev = Device::Cpu;
    let y = Tensor::from_vec((0..n as u32).map(|i| i % 10).collect::<Vec<_>>(), n, &dev)?;
    type Fwd = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;
    let (x, fwd, params): (Tensor, Fwd, Vec<candle_core::Var>) = match model {
        "mlp" => {
            let m = Mlp::new(&[784, 1024, 1024, 10], 0, &dev)?;
            let p = m.param_set().named().iter().map(|(_, v)| v.clone()).collect();
            (Tensor::randn(0f32, 1.0, (n, 784), &dev)?, Box::new(move |x| m.forward(x)), p)
        }
        "cnn" => {
            let m = Cnn::new(1, 28, 28, 10, 0, &dev)?;
            let p = m.param_set().named().iter().map(|(_, v)| v.clone()).collect();
            (Tensor::randn(0f32, 1.0, (n, 1, 28, 28), &dev)?, Box::new(move |x| m.forward(x)), p)
        }
        _ => {
            let vars = OrderedVarMap::new();
            let m = ResNet::resnet18_cifar(width, 10, vars.var_builder(DType::F32, &dev))?;
            let p = vars.named_vars().params();
            (
                Tensor::randn(0f32, 1.0, (n, 3, 32, 32), &dev)?,
                Box::new(move |x| m.forward_t(x, true)),
                p,
            )
        }
    };
    let mut opt = TorchSgd::new(params, SgdConfig { lr: 0.01, ..Default::default() })?;
    let mut t = [0f64; 4];
    let steps = 30;
    for s in 0..steps + 5 {
        let t0 = Instant::now();
        let logits = fwd(&x)?;
        let t1 = Instant::now();
        let loss = tandem::nn::functional::cross_entropy(&logits, &y)?;
        let t2 = Instant::now();
        let grads = tandem::nn::backward(&loss)?;
        let t3 = Instant::now();
        opt.step(&grads)?;
        let t4 = Instant::now();
        if s >= 5 {
            for (acc, d) in t.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3]) {
                *acc += d.as_secs_f64() * 1e3 / steps as f64;
            }
        }
    }
    let total: f64 = t.iter().sum();
    println!(
        "{model} batch {n}, {} threads: {total:.2} ms/step = forward {:.2} + loss {:.2} + backward {:.2} + optimizer {:.2}; {:.0} samples/s",
        rayon::current_num_threads(), t[0], t[1], t[2], t[3], n as f64 / total * 1e3
    );
    Ok(())
}
