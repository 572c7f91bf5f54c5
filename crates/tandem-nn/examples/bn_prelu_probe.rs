//! BatchNorm → PReLU at MobileFaceNet's and IResNet's shapes (batch 16), training mode, the
//! two modules apart against the fused op (`FastBatchNorm2d::forward_t_prelu`), and the same
//! after a 1x1 convolution and after a depthwise 3x3 one (`forward_conv_t_prelu`: the expand
//! and depthwise layers of `mbf`'s DepthWise blocks): best-of-N
//! milliseconds of forward + `tandem_nn::backward` of `sum(y · r)` on this thread count
//! (`RAYON_NUM_THREADS`), the input in the graph as inside a network.
//!
//!   cargo run --release -p tandem-nn --example bn_prelu_probe [REPEATS]
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Conv2dConfig, ModuleT, VarBuilder, VarMap};
use tandem_nn::{fast_batch_norm2d, fast_conv2d_no_bias, fast_prelu};

#[path = "common/best_of.rs"]
mod best_of;
use best_of::best_ms;

/// (channels, side): mbf's 128x56, 128x28, 256x28, 512x14 and 256x7 activations.
const SHAPES: &[(usize, usize)] = &[(128, 56), (128, 28), (256, 28), (512, 14), (256, 7)];
const BATCH: usize = 16;

fn main() -> candle_core::Result<()> {
    tandem_nn::tune_allocator(); // as the tandem binary does: freed buffers are reused
    let repeats: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let dev = Device::Cpu;
    println!(
        "{} thread(s), best of {repeats} (ms), forward + backward",
        rayon::current_num_threads()
    );
    for &(c, side) in SHAPES {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let conv = fast_conv2d_no_bias(c, c, 1, Conv2dConfig::default(), vb.pp("conv"))?;
        let dw_cfg = Conv2dConfig { padding: 1, groups: c, ..Default::default() };
        let dw = fast_conv2d_no_bias(c, c, 3, dw_cfg, vb.pp("dw"))?;
        let bn = fast_batch_norm2d(c, vb.pp("bn"))?;
        let prelu = fast_prelu(c, vb.pp("prelu"))?;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (BATCH, c, side, side), &dev)?)?;
        let r = Tensor::randn(0f32, 1.0, (BATCH, c, side, side), &dev)?;
        let step = |y: Tensor| {
            let loss = (y * &r).unwrap().sum_all().unwrap();
            tandem_nn::backward(&loss).unwrap();
        };
        let x = x.as_tensor();
        let apart = best_ms(repeats, || {
            step(prelu.forward(&bn.forward_t(x, true).unwrap()).unwrap());
        });
        let fused = best_ms(repeats, || step(bn.forward_t_prelu(x, &prelu, true).unwrap()));
        let conv_apart = best_ms(repeats, || {
            step(prelu.forward(&bn.forward_conv_t(&conv, x, true).unwrap()).unwrap());
        });
        let conv_fused =
            best_ms(repeats, || step(bn.forward_conv_t_prelu(&conv, x, &prelu, true).unwrap()));
        // The depthwise layer as the build before ran it: the convolution, then BatchNorm →
        // PReLU apart.
        let dw_apart = best_ms(repeats, || {
            step(prelu.forward(&bn.forward_t(&dw.forward(x).unwrap(), true).unwrap()).unwrap());
        });
        let dw_fused =
            best_ms(repeats, || step(bn.forward_conv_t_prelu(&dw, x, &prelu, true).unwrap()));
        println!(
            "[{BATCH}, {c}, {side}, {side}]: bn, prelu {apart:.3} -> fused {fused:.3} \
             ({:.2}x); conv1x1+bn, prelu {conv_apart:.3} -> fused {conv_fused:.3} ({:.2}x); \
             dw3x3, bn, prelu {dw_apart:.3} -> fused {dw_fused:.3} ({:.2}x)",
            apart / fused,
            conv_apart / conv_fused,
            dw_apart / dw_fused
        );
    }
    Ok(())
}
