//! Times candle's CPU matmul on the bench MLP's fc1 shapes (forward, weight grad, input grad),
//! to separate tensor-engine speed from Ddp overhead. `RAYON_NUM_THREADS=1 cargo run --release
//! -p tandem-nn --example matmul_probe`
use std::time::Instant;

use candle_core::{Device, Tensor};

fn main() -> candle_core::Result<()> {
    let d = Device::Cpu;
    let b: usize = std::env::var("PROBE_BATCH").ok().and_then(|s| s.parse().ok()).unwrap_or(64);
    let x = Tensor::randn(0f32, 1., (b, 784), &d)?;
    let w = Tensor::randn(0f32, 1., (1024, 784), &d)?;
    let g = Tensor::randn(0f32, 1., (b, 1024), &d)?;
    type Case<'a> = (&'a str, Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>);
    let cases: Vec<Case> = vec![
        ("fwd x@wT", Box::new(|| x.matmul(&w.t()?))),
        ("gw gT@x", Box::new(|| g.t()?.matmul(&x))),
        ("gx g@w", Box::new(|| g.matmul(&w))),
    ];
    for (name, f) in cases {
        f()?;
        let t = Instant::now();
        for _ in 0..50 {
            f()?;
        }
        let dt = t.elapsed().as_secs_f64() / 50.0;
        println!(
            "{name} {:.3} ms {:.1} GFLOP/s",
            dt * 1e3,
            b as f64 * 784.0 * 1024.0 * 2.0 / dt / 1e9
        );
    }
    Ok(())
}
