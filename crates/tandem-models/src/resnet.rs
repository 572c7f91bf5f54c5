//! ResNet-18 for CIFAR, written the way users write candle models: candle-nn layers built from
//! a `VarBuilder` (convolutions, linear) plus tandem's [`FastBatchNorm2d`] (PyTorch's BatchNorm
//! with a SyncBatchNorm switch), nothing tandem-specific in the forward pass.
//!
//! Layout and names are torchvision's `resnet18` (so state dicts move both ways) with the usual
//! CIFAR stem: `conv1` is a 3x3 stride-1 convolution without bias and there is no max-pool.
//! BasicBlocks [2, 2, 2, 2] at widths w, 2w, 4w, 8w (torchvision: w = 64); each stage after the
//! first halves the resolution in its first block, whose shortcut is `downsample.0` (1x1 conv,
//! stride 2, no bias) and `downsample.1` (BatchNorm). Then global average pooling and `fc`.
use candle_core::{Tensor, Var};
use candle_nn::{Conv2dConfig, Module, ModuleT, VarBuilder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tandem_nn::torch_init::standard_normal;

use tandem_nn::kernels::pool::adaptive_avg_pool2d;
use tandem_nn::{
    fast_batch_norm2d, fast_conv2d_no_bias, fast_linear, FastBatchNorm2d, FastConv2d, FastLinear,
    HasBatchNorm,
};

struct BasicBlock {
    conv1: FastConv2d,
    bn1: FastBatchNorm2d,
    conv2: FastConv2d,
    bn2: FastBatchNorm2d,
    downsample: Option<(FastConv2d, FastBatchNorm2d)>,
}

fn conv3x3(
    cin: usize,
    cout: usize,
    stride: usize,
    vb: VarBuilder,
) -> candle_core::Result<FastConv2d> {
    let cfg = Conv2dConfig { padding: 1, stride, ..Default::default() };
    fast_conv2d_no_bias(cin, cout, 3, cfg, vb)
}

impl BasicBlock {
    fn new(cin: usize, cout: usize, stride: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let conv1 = conv3x3(cin, cout, stride, vb.pp("conv1"))?;
        let bn1 = fast_batch_norm2d(cout, vb.pp("bn1"))?;
        let conv2 = conv3x3(cout, cout, 1, vb.pp("conv2"))?;
        let bn2 = fast_batch_norm2d(cout, vb.pp("bn2"))?;
        let downsample = if stride != 1 || cin != cout {
            let cfg = Conv2dConfig { stride, ..Default::default() };
            let conv = fast_conv2d_no_bias(cin, cout, 1, cfg, vb.pp("downsample.0"))?;
            Some((conv, fast_batch_norm2d(cout, vb.pp("downsample.1"))?))
        } else {
            None
        };
        Ok(BasicBlock { conv1, bn1, conv2, bn2, downsample })
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let out = self.bn1.forward_conv_t_relu(&self.conv1, x, train)?;
        let shortcut = match &self.downsample {
            Some((conv, bn)) => bn.forward_conv_t(conv, x, train)?,
            None => x.clone(),
        };
        self.bn2.forward_t_add_relu(&self.conv2.forward(&out)?, &shortcut, train)
    }
}

pub struct ResNet {
    conv1: FastConv2d,
    bn1: FastBatchNorm2d,
    layers: Vec<Vec<BasicBlock>>,
    fc: FastLinear,
}

impl ResNet {
    /// ResNet-18 for 3x32x32 inputs with stage widths `width` x [1, 2, 4, 8] and `classes`
    /// outputs. candle initialises the variables with its unseeded RNG; call
    /// [`ResNet::reset_parameters`] for torchvision's initialisation from a seed.
    pub fn resnet18_cifar(
        width: usize,
        classes: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        if width == 0 || classes == 0 {
            candle_core::bail!("ResNet-18 needs width and classes >= 1, got {width} and {classes}")
        }
        let conv1 = conv3x3(3, width, 1, vb.pp("conv1"))?;
        let bn1 = fast_batch_norm2d(width, vb.pp("bn1"))?;
        let mut layers = Vec::new();
        let mut cin = width;
        for (stage, mult) in [1, 2, 4, 8].into_iter().enumerate() {
            let cout = width * mult;
            let stride = if stage == 0 { 1 } else { 2 };
            let vb = vb.pp(format!("layer{}", stage + 1));
            let blocks = vec![
                BasicBlock::new(cin, cout, stride, vb.pp("0"))?,
                BasicBlock::new(cout, cout, 1, vb.pp("1"))?,
            ];
            layers.push(blocks);
            cin = cout;
        }
        let fc = fast_linear(cin, classes, vb.pp("fc"))?;
        Ok(ResNet { conv1, bn1, layers, fc })
    }

    /// torchvision's initialisation, seeded (our stream, not torch's): convolution weights
    /// Kaiming-normal with fan-out (std sqrt(2 / (out * k * k))), BatchNorm weight 1 and bias
    /// 0, `fc` U(-1/sqrt(in), 1/sqrt(in)) for weight and bias. `named` are the model's variables
    /// in creation order ([`tandem_nn::OrderedVarMap::named`]), which fixes the stream.
    pub fn reset_parameters(named: &[(String, Var)], seed: u64) -> candle_core::Result<()> {
        let mut rng = StdRng::seed_from_u64(seed);
        let fc_fan_in = named
            .iter()
            .find(|(n, _)| n == "fc.weight")
            .and_then(|(_, v)| v.dims().get(1).copied())
            .unwrap_or(1);
        for (name, var) in named {
            let dims = var.dims().to_vec();
            let last = name.rsplit('.').next().unwrap_or("");
            let values: Vec<f32> = if last == "weight" && dims.len() == 4 {
                let std = (2.0 / (dims[0] * dims[2] * dims[3]) as f64).sqrt();
                (0..var.elem_count()).map(|_| (standard_normal(&mut rng) * std) as f32).collect()
            } else if name.starts_with("fc.") {
                let bound = 1.0 / (fc_fan_in as f32).sqrt();
                (0..var.elem_count()).map(|_| rng.random_range(-bound..=bound)).collect()
            } else {
                continue;
            };
            var.set(&Tensor::from_vec(values, dims, var.device())?)?;
        }
        Ok(())
    }

    /// Logits `[N, classes]` for `x: [N, 3, 32, 32]` (or `[N, 3072]`, reshaped). BatchNorm
    /// uses batch statistics when `train`, the running ones otherwise.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let x = if x.rank() == 2 { x.reshape((x.dim(0)?, 3, 32, 32))? } else { x.clone() };
        let mut x = self.bn1.forward_conv_t_relu(&self.conv1, &x, train)?;
        for block in self.layers.iter().flatten() {
            x = block.forward_t(&x, train)?;
        }
        let pooled = adaptive_avg_pool2d(&x, (1, 1))?.flatten_from(1)?;
        self.fc.forward(&pooled)
    }
}

impl ModuleT for ResNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        ResNet::forward_t(self, x, train)
    }
}

impl HasBatchNorm for ResNet {
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d> {
        let mut out = vec![&self.bn1];
        for block in self.layers.iter().flatten() {
            out.push(&block.bn1);
            out.push(&block.bn2);
            if let Some((_, bn)) = &block.downsample {
                out.push(bn);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use tandem_nn::OrderedVarMap;

    #[test]
    fn torchvision_names_in_registration_order() {
        let vars = OrderedVarMap::new();
        let net =
            ResNet::resnet18_cifar(4, 10, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
        let named = vars.named();
        let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            &names[..7],
            [
                "conv1.weight",
                "bn1.weight",
                "bn1.bias",
                "bn1.running_mean",
                "bn1.running_var",
                "bn1.num_batches_tracked",
                "layer1.0.conv1.weight"
            ]
        );
        assert!(names.contains(&"layer2.0.downsample.0.weight"));
        assert!(!names.contains(&"layer1.0.downsample.0.weight"));
        assert_eq!(names[names.len() - 2..], ["fc.weight", "fc.bias"]);
        // torchvision resnet18: 62 parameters + 20 BatchNorms x 3 buffers.
        let params = vars.named_vars();
        use tandem_nn::ParamModule;
        assert_eq!(params.named_parameters().len(), 62);
        assert_eq!(params.named_buffers().len(), 60);
        assert_eq!(net.batch_norms().len(), 20);
        let dims = |n: &str| named.iter().find(|(k, _)| k == n).unwrap().1.dims().to_vec();
        assert_eq!(dims("conv1.weight"), [4, 3, 3, 3]);
        assert_eq!(dims("layer4.1.conv2.weight"), [32, 32, 3, 3]);
        assert_eq!(dims("fc.weight"), [10, 32]);
        let logits = net
            .forward_t(&Tensor::zeros((2, 3, 32, 32), DType::F32, &Device::Cpu).unwrap(), true)
            .unwrap();
        assert_eq!(logits.dims(), [2, 10]);
    }

    #[test]
    fn reset_parameters_is_seeded_and_follows_torchvision() {
        let build = || {
            let vars = OrderedVarMap::new();
            ResNet::resnet18_cifar(4, 10, vars.var_builder(DType::F32, &Device::Cpu)).unwrap();
            ResNet::reset_parameters(&vars.named(), 7).unwrap();
            vars.named()
        };
        let (a, b) = (build(), build());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            let (x, y) = (x.flatten_all().unwrap(), y.flatten_all().unwrap());
            if x.dtype() == DType::F32 {
                assert_eq!(x.to_vec1::<f32>().unwrap(), y.to_vec1::<f32>().unwrap(), "{n}");
            }
        }
        let get = |n: &str| {
            a.iter()
                .find(|(k, _)| k == n)
                .unwrap()
                .1
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let conv = get("layer3.0.conv1.weight"); // out 16, 3x3: std sqrt(2/144)
        let std = (conv.iter().map(|v| v * v).sum::<f32>() / conv.len() as f32).sqrt();
        assert!((std - (2.0f32 / 144.0).sqrt()).abs() < 0.02, "std {std}");
        assert!(get("fc.bias").iter().all(|v| v.abs() <= 1.0 / 32f32.sqrt()));
        assert!(get("bn1.weight").iter().all(|&v| v == 1.0));
    }
}
