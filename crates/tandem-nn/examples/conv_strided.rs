//! The strided convolutions of CIFAR ResNet-18 (into 16x16, 8x8, 4x4) and of IResNet (into
//! 28x28, 14x14, 7x7) with im2col / col2im line by line and through the table of taps, on this
//! thread count: best-of-N milliseconds forward, and forward + backward of `sum(y · r)`.
//!
//!   RAYON_NUM_THREADS=2 cargo run --release -p tandem-nn --example conv_strided [REPEATS]
use std::sync::atomic::Ordering;

#[path = "common/best_of.rs"]
mod best_of;
use best_of::best_ms;

use candle_core::{Device, Tensor, Var};
use tandem_nn::kernels::conv2d::{conv2d, ConvParams, SHORT_LINE_BELOW};

/// (batch, in channels, out channels, input side, kernel): all stride 2, padding kernel / 2.
const SHAPES: &[(usize, usize, usize, usize, usize)] = &[
    (64, 16, 32, 32, 3),
    (64, 32, 64, 16, 3),
    (64, 64, 128, 8, 3),
    (64, 16, 32, 32, 1),
    (64, 64, 128, 8, 1),
    (8, 64, 128, 56, 3),
    (8, 128, 256, 28, 3),
    (8, 256, 512, 14, 3),
];

fn main() -> candle_core::Result<()> {
    tandem_nn::join_compute_pool();
    tandem_nn::tune_allocator();
    let repeats = std::env::args().nth(1).and_then(|r| r.parse().ok()).unwrap_or(20);
    println!("{} thread(s), best of {repeats} (ms)", rayon::current_num_threads());
    for &(n, c, o, side, k) in SHAPES {
        let p = ConvParams { stride: 2, padding: k / 2, dilation: 1 };
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c, side, side), &dev)?)?;
        let w = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (o, c, k, k), &dev)? * 0.1)?)?;
        let mut row = format!("[{n},{c},{side},{side}] -> {o}, {k}x{k}:");
        for (name, below) in [("lines", 0), ("taps", usize::MAX)] {
            SHORT_LINE_BELOW.store(below, Ordering::Relaxed);
            let fwd = best_ms(repeats, || {
                conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
            });
            let r =
                Tensor::randn(0f32, 1.0, conv2d(x.as_tensor(), w.as_tensor(), p)?.shape(), &dev)?;
            let both = best_ms(repeats, || {
                let y = conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
                (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            });
            row += &format!("  {name} fwd {fwd:.3} fwd+bwd {both:.3}");
        }
        println!("{row}");
    }
    Ok(())
}
