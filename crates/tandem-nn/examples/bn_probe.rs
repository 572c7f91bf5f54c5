//! The training BatchNorm(+ReLU) kernels at CIFAR ResNet-18's shapes: best-of-N milliseconds
//! for the forward (statistics and output) and the backward (all three gradients), on this
//! thread count (`RAYON_NUM_THREADS`). `scripts/peers/torch_bn_probe.py` times PyTorch's.
//!
//!   cargo run --release -p tandem-nn --example bn_probe [REPEATS]
use candle_core::{DType, Device, Tensor};
use tandem_nn::kernels::batch_norm::{
    backward_slices, batch_norm_train_act, batch_stats, Activation, Stats,
};

#[path = "common/best_of.rs"]
mod best_of;
use best_of::best_ms;

/// (batch, channels, side) of the BatchNorms of CIFAR ResNet-18 at width 16, batch 64.
const SHAPES: &[(usize, usize, usize)] = &[(64, 16, 32), (64, 32, 16), (64, 64, 8), (64, 128, 4)];

fn main() -> candle_core::Result<()> {
    tandem_nn::tune_allocator(); // as the tandem binary does: freed buffers are reused
    let repeats: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    let dev = Device::Cpu;
    for &(n, c, side) in SHAPES {
        let hw = side * side;
        let x = Tensor::randn(0f32, 1.0, (n, c, side, side), &dev)?;
        let gamma = Tensor::ones(c, DType::F32, &dev)?;
        let beta = Tensor::zeros(c, DType::F32, &dev)?;
        let gy: Vec<f32> = Tensor::randn(0f32, 1.0, n * c * hw, &dev)?.to_vec1()?;
        let xv: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let (mean, var, _) = batch_stats(&xv, (n, c, hw));
        let invstd: Vec<f32> = var.iter().map(|v| 1.0 / (v + 1e-5).sqrt()).collect();
        let gamma_v = vec![1f32; c];
        let beta_v = vec![0f32; c];
        let stats = Stats { mean: &mean, invstd: &invstd, gamma: &gamma_v, beta: &beta_v };
        for relu in [false, true] {
            let activation = if relu { Activation::Relu } else { Activation::Identity };
            let fwd = best_ms(repeats, || {
                batch_norm_train_act(&x, &gamma, &beta, 1e-5, relu).unwrap();
            });
            let bwd = best_ms(repeats, || {
                backward_slices(&xv, &gy, &stats, activation, (n, c, hw), true);
            });
            let sums = best_ms(repeats, || {
                backward_slices(&xv, &gy, &stats, activation, (n, c, hw), false);
            });
            let act = if relu { "+relu" } else { "" };
            println!(
                "bn{act} [{n}, {c}, {side}, {side}]: forward {fwd:.3} ms, backward {bwd:.3} ms \
                 (sums {sums:.3})"
            );
        }
    }
    Ok(())
}
