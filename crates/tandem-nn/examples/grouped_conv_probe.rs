//! MobileFaceNet's grouped convolutions (arcface_torch's `mbf` at batch 16: the depthwise 3x3
//! layers, strides 1 and 2, and the 64-group stage with two channels a group) through
//! `grouped_conv2d` on this thread count: best-of-N milliseconds forward, and forward +
//! backward of `sum(y · r)`, and a hash of the bits of the output and both gradients (the same
//! hash before and after a change to the kernels: the same bits).
//!
//! Each gradient alone is timed too (the other operand a constant), less the forward and what
//! the `sum(y · r)` harness costs by itself.
//!
//!   RAYON_NUM_THREADS=2 cargo run --release -p tandem-nn --example grouped_conv_probe [REPEATS]
#[path = "common/best_of.rs"]
mod best_of;
use best_of::best_ms;

use candle_core::{Device, Tensor, Var};
use tandem_nn::kernels::grouped_conv::{grouped_conv2d, GroupedConvParams};

/// (channels, input side, stride, groups): 3x3, padding 1, batch 16.
const SHAPES: &[(usize, usize, usize, usize)] = &[
    (128, 56, 1, 64),
    (128, 56, 2, 128),
    (128, 28, 1, 128),
    (256, 28, 2, 256),
    (256, 14, 1, 256),
    (512, 14, 2, 512),
    (256, 7, 1, 256),
];

/// Values in [-scale, scale) from a fixed sequence (the same inputs in every build).
fn filled(shape: &[usize], seed: u64, scale: f32) -> candle_core::Result<Tensor> {
    let mut s = seed;
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// FNV-1a over the bits of every element.
fn bits_hash(t: &Tensor, mut h: u64) -> candle_core::Result<u64> {
    for v in t.flatten_all()?.to_vec1::<f32>()? {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    Ok(h)
}

fn main() -> candle_core::Result<()> {
    tandem_nn::join_compute_pool();
    tandem_nn::tune_allocator();
    let repeats = std::env::args().nth(1).and_then(|r| r.parse().ok()).unwrap_or(20);
    println!("{} thread(s), best of {repeats} (ms)", rayon::current_num_threads());
    for &(c, side, stride, groups) in SHAPES {
        let p = GroupedConvParams { stride, padding: 1, dilation: 1, groups };
        let x = Var::from_tensor(&filled(&[16, c, side, side], 1, 1.0)?)?;
        let w = Var::from_tensor(&filled(&[c, c / groups, 3, 3], 2, 0.3)?)?;
        let y = grouped_conv2d(x.as_tensor(), w.as_tensor(), p)?;
        let r = filled(y.dims(), 3, 1.0)?;
        let fwd = best_ms(repeats, || {
            grouped_conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
        });
        let both = best_ms(repeats, || {
            let y = grouped_conv2d(x.as_tensor(), w.as_tensor(), p).unwrap();
            (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        });
        // Each gradient alone (the other operand a constant), less the forward and what
        // `sum(y · r)`'s backward costs by itself.
        let harness = {
            let leaf = Var::from_tensor(&r)?;
            best_ms(repeats, || {
                (leaf.as_tensor() * &r).unwrap().sum_all().unwrap().backward().unwrap();
            })
        };
        let alone = |x: &Tensor, w: &Tensor| {
            let ms = best_ms(repeats, || {
                let y = grouped_conv2d(x, w, p).unwrap();
                (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            });
            ms - fwd - harness
        };
        let data = alone(x.as_tensor(), &w.as_tensor().detach());
        let filter = alone(&x.as_tensor().detach(), w.as_tensor());
        let grads = (y * &r)?.sum_all()?.backward()?;
        let mut h =
            bits_hash(&grouped_conv2d(x.as_tensor(), w.as_tensor(), p)?, 0xcbf2_9ce4_8422_2325)?;
        for v in [x.as_tensor(), w.as_tensor()] {
            h = bits_hash(grads.get(v).expect("a gradient"), h)?;
        }
        let layer = format!("[16,{c},{side},{side}] s{stride} g{groups}");
        let parts = format!("bwd-data {data:.3} bwd-filter {filter:.3}");
        println!("{layer}: fwd {fwd:.3} fwd+bwd {both:.3} {parts}  bits {h:016x}");
    }
    Ok(())
}
