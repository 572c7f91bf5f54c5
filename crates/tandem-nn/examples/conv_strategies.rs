//! The 3x3 "same" convolutions of CIFAR ResNet-18 and of IResNet-18 and -50, through im2col +
//! gemm and through Winograd with 2x2 and with 4x4 output tiles, on this thread count
//! (`RAYON_NUM_THREADS`; a rank of a 2-rank job on 2 cores has 1): best-of-N milliseconds
//! forward and backward (both gradients), the three taken in turn N times so that a slow
//! spell of a noisy machine falls on all of them. (A Winograd forward is the path a
//! Winograd-eligible shape takes: for 16 channels whose im2col buffer fits the cache, that is
//! im2col too — see `conv2d`'s choice. The last column says which `conv2d` takes for the
//! shape: Winograd only where the transformed weights do not outweigh the transformed tiles,
//! `winograd::WEIGHTS_DECIDE`, with the tile `winograd::tile_side` picks.)
//!
//!   RAYON_NUM_THREADS=1 cargo run --release -p tandem-nn --example conv_strategies [REPEATS [FILTER]]
//!
//! FILTER keeps the shapes whose name contains it.
use std::sync::atomic::Ordering;

use std::time::Instant;

use candle_core::{Device, Tensor, Var};
use tandem_nn::kernels::conv2d::{conv2d, ConvParams};
use tandem_nn::kernels::winograd::{tile_side, MIN_CHANNELS, TILE_SIDE, WEIGHTS_DECIDE};

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

/// The strategies timed: (name, `MIN_CHANNELS`, `TILE_SIDE`).
const STRATEGIES: [(&str, usize, usize); 3] =
    [("im2col", usize::MAX, 0), ("2x2", 1, 2), ("4x4", 1, 4)];

fn ms(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

fn main() -> candle_core::Result<()> {
    tandem_nn::tune_allocator(); // as the tandem binary does: freed buffers are reused
    let repeats = std::env::args().nth(1).and_then(|r| r.parse().ok()).unwrap_or(5);
    let filter = std::env::args().nth(2).unwrap_or_default();
    let p = ConvParams { stride: 1, padding: 1, dilation: 1 };
    let min_channels_default = MIN_CHANNELS.load(Ordering::Relaxed);
    println!("{} thread(s), best of {repeats} (ms)", rayon::current_num_threads());
    let names = STRATEGIES.map(|s| s.0);
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  conv2d takes",
        "shape",
        format!("{} fwd", names[0]),
        format!("{} fwd", names[1]),
        format!("{} fwd", names[2]),
        format!("{} bwd", names[0]),
        format!("{} bwd", names[1]),
        format!("{} bwd", names[2]),
    );
    for &(name, n, c, side) in SHAPES.iter().filter(|s| s.0.contains(&filter)) {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c, side, side), &Device::Cpu)?)?;
        let w = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (c, c, 3, 3), &Device::Cpu)? * 0.1)?)?;
        // Per strategy: the fastest forward, and the fastest forward + backward.
        let mut best = [(f64::MAX, f64::MAX); STRATEGIES.len()];
        for round in 0..=repeats {
            for (s, &(_, min_channels, tile)) in STRATEGIES.iter().enumerate() {
                MIN_CHANNELS.store(min_channels, Ordering::Relaxed);
                TILE_SIDE.store(tile, Ordering::Relaxed);
                WEIGHTS_DECIDE.store(false, Ordering::Relaxed);
                let fwd = ms(|| drop(conv2d(x.as_tensor(), w.as_tensor(), p).unwrap()));
                let total = ms(|| {
                    let y = conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
                    y.sum_all().unwrap().backward().unwrap();
                });
                if round > 0 {
                    best[s] = (best[s].0.min(fwd), best[s].1.min(total));
                }
            }
        }
        MIN_CHANNELS.store(min_channels_default, Ordering::Relaxed);
        TILE_SIDE.store(0, Ordering::Relaxed);
        WEIGHTS_DECIDE.store(true, Ordering::Relaxed);
        let takes = match tile_side((3, 3), (1, 1, 1), [n, c, side, side], c) {
            Some(m) => format!("wino {m}x{m}"),
            None => "im2col".into(),
        };
        let [a, b, f] = best;
        println!(
            "{name:<24} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3}  {takes}",
            a.0,
            b.0,
            f.0,
            a.1 - a.0,
            b.1 - b.0,
            f.1 - f.0,
        );
    }
    Ok(())
}
