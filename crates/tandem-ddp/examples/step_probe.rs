//! Splits one plain training step of the bench MLP (784-1024-1024-10, SGD) into forward+loss,
//! backward and optimizer time, to see where the tensor engine spends it.
//! `RAYON_NUM_THREADS=1 cargo run --release -p tandem-ddp --example step_probe -- 64`
//! (PyTorch's counterpart for the same split: `scripts/torch_step_probe.py 64`)
use std::time::Instant;

use candle_core::{Device, Tensor};
use tandem_models::Mlp;
use tandem_nn::ParamModule;
use tandem_optim::{SgdConfig, TorchSgd};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batch: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(64);
    // As `tandem::init()` does; `TANDEM_MALLOC=system` measures glibc's defaults.
    let tuned = tandem_nn::tune_allocator();
    let d = Device::Cpu;
    let m = Mlp::new(&[784, 1024, 1024, 10], 0, &d)?;
    let mut opt = TorchSgd::new(m.params(), SgdConfig { lr: 0.01, ..Default::default() })?;
    let x = Tensor::randn(0f32, 1., (batch, 784), &d)?;
    let y = Tensor::from_vec((0..batch as u32).map(|i| i % 10).collect::<Vec<_>>(), batch, &d)?;
    let (mut tf, mut tb, mut to) = (0.0, 0.0, 0.0);
    let n = 30;
    for i in 0..n + 3 {
        let t0 = Instant::now();
        let loss = m.loss(&x, &y)?;
        let t1 = Instant::now();
        let grads = loss.backward()?;
        let t2 = Instant::now();
        opt.step(&grads)?;
        let t3 = Instant::now();
        if i >= 3 {
            tf += (t1 - t0).as_secs_f64();
            tb += (t2 - t1).as_secs_f64();
            to += (t3 - t2).as_secs_f64();
        }
    }
    let ms = |t: f64| t / n as f64 * 1e3;
    println!("batch {batch} (malloc kept: {tuned}): forward {:.2} ms backward {:.2} ms opt {:.2} ms total {:.2} ms ({:.0} samples/s)", ms(tf), ms(tb), ms(to), ms(tf + tb + to), batch as f64 * n as f64 / (tf + tb + to));
    Ok(())
}
