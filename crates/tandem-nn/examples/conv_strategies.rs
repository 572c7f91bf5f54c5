//! The 3x3 "same" convolutions of CIFAR ResNet-18 and of IResNet-18, through im2col + gemm and
//! through Winograd F(2x2, 3x3), on this thread count (`RAYON_NUM_THREADS`; a rank of a 2-rank
//! job on 2 cores has 1): best-of-N milliseconds forward and backward (both gradients).
//! (The "wino" forward is the path a Winograd-eligible shape takes: for 16 channels whose
//! im2col buffer fits the cache, that is im2col too — see `conv2d`'s choice. The last column
//! says which of the two `conv2d` takes for the shape: Winograd only where the transformed
//! weights do not outweigh the transformed tiles, `winograd::WEIGHTS_DECIDE`.)
//!
//!   RAYON_NUM_THREADS=1 cargo run --release -p tandem-nn --example conv_strategies [REPEATS [FILTER]]
//!
//! FILTER keeps the shapes whose name contains it.
use std::sync::atomic::Ordering;

#[path = "common/best_of.rs"]
mod best_of;
use best_of::best_ms;

use candle_core::{Device, Tensor, Var};
use tandem_nn::kernels::conv2d::{conv2d, ConvParams};
use tandem_nn::kernels::winograd::{applies, MIN_CHANNELS, WEIGHTS_DECIDE};

/// (name, batch, channels, side): every distinct 3x3 stride-1 convolution (C → C).
const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("resnet18 w16 32x32", 32, 16, 32),
    ("resnet18 w16 16x16", 32, 32, 16),
    ("resnet18 w16 8x8", 32, 64, 8),
    ("resnet18 w16 4x4", 32, 128, 4),
    ("resnet18 w64 32x32", 32, 64, 32),
    ("resnet18 w64 16x16", 32, 128, 16),
    ("resnet18 w64 8x8", 32, 256, 8),
    ("resnet18 w64 4x4", 32, 512, 4),
    ("iresnet18 w16 112x112", 8, 16, 112),
    ("iresnet18 w16 56x56", 8, 32, 56),
    ("iresnet18 w16 28x28", 8, 64, 28),
    ("iresnet18 w16 14x14", 8, 128, 14),
    ("iresnet50 w64 56x56", 8, 64, 56),
    ("iresnet50 w64 28x28", 8, 128, 28),
    ("iresnet50 w64 14x14", 8, 256, 14),
    ("iresnet50 w64 7x7", 8, 512, 7),
];

fn main() -> candle_core::Result<()> {
    tandem_nn::tune_allocator(); // as the tandem binary does: freed buffers are reused
    let repeats = std::env::args().nth(1).and_then(|r| r.parse().ok()).unwrap_or(5);
    let filter = std::env::args().nth(2).unwrap_or_default();
    let p = ConvParams { stride: 1, padding: 1, dilation: 1 };
    let min_channels_default = MIN_CHANNELS.load(Ordering::Relaxed);
    println!("{} thread(s), best of {repeats} (ms)", rayon::current_num_threads());
    println!(
        "{:<24} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7}  conv2d takes",
        "shape", "im2col fwd", "wino fwd", "x", "im2col bwd", "wino bwd", "x"
    );
    for &(name, n, c, side) in SHAPES.iter().filter(|s| s.0.contains(&filter)) {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c, side, side), &Device::Cpu)?)?;
        let w = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (c, c, 3, 3), &Device::Cpu)? * 0.1)?)?;
        let mut row = Vec::new();
        let only_winograd = std::env::var_os("ONLY_WINOGRAD").is_some(); // for profiling
        for min_channels in [usize::MAX, 1] {
            if only_winograd && min_channels == usize::MAX {
                row.push((f64::NAN, f64::NAN));
                continue;
            }
            MIN_CHANNELS.store(min_channels, Ordering::Relaxed);
            WEIGHTS_DECIDE.store(min_channels == usize::MAX, Ordering::Relaxed);
            let fwd = best_ms(repeats, || {
                conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
            });
            let y = conv2d(x.as_tensor(), w.as_tensor(), p)?;
            let total = best_ms(repeats, || {
                conv2d(x.as_tensor(), w.as_tensor(), p)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
            });
            drop(y);
            row.push((fwd, total - fwd));
        }
        let (a, b) = (row[0], row[1]);
        MIN_CHANNELS.store(min_channels_default, Ordering::Relaxed);
        WEIGHTS_DECIDE.store(true, Ordering::Relaxed);
        let takes =
            if applies((3, 3), (1, 1, 1), [n, c, side, side], c) { "wino" } else { "im2col" };
        println!(
            "{name:<24} {:>10.3} {:>10.3} {:>7.2} {:>10.3} {:>10.3} {:>7.2}  {takes}",
            a.0,
            b.0,
            a.0 / b.0,
            a.1,
            b.1,
            a.1 / b.1
        );
    }
    Ok(())
}
