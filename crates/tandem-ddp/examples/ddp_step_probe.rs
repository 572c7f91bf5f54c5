//! Per-step time of plain training vs 1-rank Ddp on the bench MLP, alternating, to look at
//! Ddp's fixed costs without other processes. `RAYON_NUM_THREADS=1 cargo run --release -p
//! tandem-ddp --example ddp_step_probe`
use std::time::Instant;

use candle_core::{Device, Tensor};
use tandem_comm::SingleProcess;
use tandem_ddp::{Ddp, DdpOptions};
use tandem_models::Mlp;
use tandem_nn::ParamModule;
use tandem_optim::{SgdConfig, TorchSgd};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // As `tandem::init()` does (`TANDEM_MALLOC=system` to measure glibc's defaults).
    tandem_nn::tune_allocator();
    let d = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (128, 784), &d)?;
    let y = Tensor::from_vec((0..128u32).map(|i| i % 10).collect::<Vec<_>>(), 128, &d)?;
    let plain = Mlp::new(&[784, 1024, 1024, 10], 0, &d)?;
    let mut popt = TorchSgd::new(plain.params(), SgdConfig { lr: 0.01, ..Default::default() })?;
    let ddp =
        Ddp::new(Mlp::new(&[784, 1024, 1024, 10], 0, &d)?, &SingleProcess, DdpOptions::default())?;
    let mut dopt = TorchSgd::new(ddp.params(), SgdConfig { lr: 0.01, ..Default::default() })?;
    let (mut tp, mut td, mut tf, mut tb) = (0.0, 0.0, 0.0, 0.0);
    let (mut pf, mut pb, mut ps, mut ds) = (0.0, 0.0, 0.0, 0.0);
    let rounds = 10;
    for r in 0..rounds + 2 {
        let t = Instant::now();
        for _ in 0..5 {
            let t0 = Instant::now();
            let l = plain.loss(&x, &y)?;
            let t1 = Instant::now();
            let g = l.backward()?;
            let t2 = Instant::now();
            popt.step(&g)?;
            if r >= 2 {
                pf += (t1 - t0).as_secs_f64();
                pb += (t2 - t1).as_secs_f64();
                ps += t2.elapsed().as_secs_f64();
            }
        }
        let a = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..5 {
            let t0 = Instant::now();
            let loss = ddp.hooked().loss(&x, &y)?;
            let t1 = Instant::now();
            let g = ddp.backward(&loss)?;
            let t2 = Instant::now();
            dopt.step(&g)?;
            if r >= 2 {
                ds += t2.elapsed().as_secs_f64();
                tf += (t1 - t0).as_secs_f64();
                tb += (t2 - t1).as_secs_f64();
            }
        }
        let b = t.elapsed().as_secs_f64();
        if r >= 2 {
            tp += a;
            td += b;
        }
    }
    let n = (rounds * 5) as f64;
    let vars = plain.params();
    let t = Instant::now();
    for _ in 0..20 {
        for v in &vars {
            std::hint::black_box(v.as_tensor().copy()?);
        }
    }
    println!(
        "copying all parameters once (fresh allocation): {:.2} ms",
        t.elapsed().as_secs_f64() / 20.0 * 1e3
    );
    let mut buf = vec![0f32; vars.iter().map(|v| v.elem_count()).sum()];
    let t = Instant::now();
    for _ in 0..20 {
        let mut off = 0;
        for v in &vars {
            let src = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            buf[off..off + src.len()].copy_from_slice(&src);
            off += src.len();
        }
    }
    println!(
        "to_vec + copy into a reused buffer: {:.2} ms",
        t.elapsed().as_secs_f64() / 20.0 * 1e3
    );
    println!(
        "plain: forward {:.2} backward {:.2} step {:.2}; ddp step {:.2}",
        pf / n * 1e3,
        pb / n * 1e3,
        ps / n * 1e3,
        ds / n * 1e3
    );
    println!(
        "plain {:.2} ms/step, ddp {:.2} ms/step (forward {:.2}, backward {:.2}), overhead {:+.1}%",
        tp / n * 1e3,
        td / n * 1e3,
        tf / n * 1e3,
        tb / n * 1e3,
        (td / tp - 1.0) * 100.0
    );
    Ok(())
}
