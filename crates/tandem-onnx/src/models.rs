//! The inference graphs of tandem's built-in models, in eval mode (BatchNorm with its running
//! statistics), as `torch.onnx.export(model.eval(), ...)` writes them: the same layers, the
//! weights as initializers under their state-dict names. Sizes come from the weights' shapes,
//! so one checkpoint is all an export needs.
//!
//! - `mlp`: `fc1 .. fcN` (Gemm, ReLU between), input `[batch, in]`.
//! - `cnn`: conv1 → bn1 → relu → maxpool 2 → conv2 → relu → maxpool 2 → flatten → fc, input
//!   `[batch, C, H, H]` (H from `fc`'s in-features, square images as `tandem train` feeds).
//! - `resnet18`: torchvision's BasicBlock ResNet-18 with the CIFAR stem, input
//!   `[batch, 3, height, width]` (global average pooling makes any size ≥ 8 work).
//!
//! - `iresnet18|34|50|100|200`: arcface_torch's IResNet (conv1 → bn1 → PReLU, IBasicBlocks, bn2 →
//!   flatten → fc → `features` BatchNorm1d), input `[batch, 3, 112, 112]`, output `embedding`
//!   `[batch, E]` (dropout is the identity in eval mode).
//! - `mbf`, `mbf_large`: arcface_torch's MobileFaceNet (ConvBlocks, depthwise convolutions as
//!   grouped `Conv`s, PReLU, the GDC head: a 7x7 depthwise LinearBlock, flatten, a bias-free
//!   Gemm and BatchNorm1d), input `[batch, 3, 112, 112]`, output `embedding`.
//! - `vit_*`: arcface_torch's ViT (the patch `Conv`, `pos_embed`, pre-norm blocks of
//!   LayerNormalization, multi-head attention as MatMul / Softmax over `[batch, heads, 144, 144]`,
//!   a ReLU6 MLP as `Clip`; LayerNormalization, then the feature head's two bias-free Gemms and
//!   BatchNorm1d, eps 2e-5), input `[batch, 3, 112, 112]`, output `embedding`. The mask token
//!   only serves training: it is read, checked and left out, as `torch.onnx.export` leaves it.
//!
//! The classifiers' output is `logits`, `[batch, classes]`. The batch (and the ResNet's height and
//! width) are symbolic dimensions, so one file serves any batch size.
use crate::error::{OnnxError, Result};
use crate::graph::{float, int, ints, Dim, GraphBuilder};
use crate::proto::ModelProto;
use crate::weights::{StateDict, Weight};
use tandem_models::ModelKind;

/// BatchNorm's epsilon in the built-in models (PyTorch's default), but the ViT feature head's.
const BN_EPS: f32 = 1e-5;
/// The ViT feature head's BatchNorm1d epsilon, and its LayerNorms' (PyTorch's default).
const VIT_FEATURE_BN_EPS: f32 = 2e-5;
const LN_EPS: f32 = 1e-5;

/// What was exported: the graph, and its input and output shapes for messages.
pub struct Exported {
    pub model: ModelProto,
    pub input: Vec<Dim>,
    /// The output's name: `logits`, or `embedding` for the face backbones.
    pub output: &'static str,
    /// The output's width: classes, or the embedding size.
    pub classes: usize,
    /// Float values stored in the file (the weights).
    pub weights: usize,
}

/// The ONNX model of `arch` with the weights of `state` (a state dict, any wrapping).
pub fn export(arch: ModelKind, state: &[(String, tandem_ckpt::TensorData)]) -> Result<Exported> {
    let mut sd = StateDict::new(arch.name(), state);
    let mut g = Graphs { b: GraphBuilder::new(&format!("tandem_{}", arch.name())), weights: 0 };
    let (input, logits, classes) = match arch {
        ModelKind::Mlp => g.mlp(&mut sd)?,
        ModelKind::Cnn => g.cnn(&mut sd)?,
        ModelKind::ResNet18 => g.resnet18(&mut sd)?,
        face => match (face.iresnet_depth(), face.mobilefacenet(), face.vit()) {
            (Some(depth), _, _) => g.iresnet(&mut sd, depth)?,
            (None, Some((blocks, scale)), _) => g.mobilefacenet(&mut sd, blocks, scale)?,
            (None, None, Some(cfg)) => g.vit(&mut sd, cfg.num_heads)?,
            (None, None, None) => {
                unreachable!("every ModelKind is a classifier or a face backbone")
            }
        },
    };
    sd.finish()?;
    let Graphs { mut b, weights } = g;
    let out = [Dim::Named("batch"), Dim::Fixed(classes)];
    let output = if arch.is_face() { "embedding" } else { "logits" };
    b.output(&logits, output, &out);
    if weights * 4 >= i32::MAX as usize {
        return Err(OnnxError::TooLarge { bytes: weights * 4 });
    }
    let doc = format!("tandem {} (eval mode): input -> {output}", arch.name());
    let model = b.finish(&doc, &[("tandem.model", arch.name().to_string())]);
    Ok(Exported { model, input, output, classes, weights })
}

struct Graphs {
    b: GraphBuilder,
    weights: usize,
}

/// A convolution's stride, padding (every side) and groups.
#[derive(Clone, Copy)]
struct ConvShape {
    stride: usize,
    padding: usize,
    groups: usize,
}

impl Graphs {
    fn init(&mut self, w: Weight) -> String {
        self.weights += w.data.len();
        self.b.initializer(&w.name, &w.dims, &w.data)
    }

    /// `x @ W^T + b` for `nn.Linear` weights `[out, in]`; returns the output and `out`.
    fn linear(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        inputs: usize,
    ) -> Result<(String, usize)> {
        let w = sd.take(&format!("{prefix}.weight"), &[None, Some(inputs)])?;
        let out = w.dims[0];
        let b = sd.take(&format!("{prefix}.bias"), &[Some(out)])?;
        let (w, b) = (self.init(w), self.init(b));
        Ok((self.b.node("Gemm", &[x, &w, &b], vec![int("transB", 1)]), out))
    }

    /// A square "same" convolution (padding kernel / 2, one group); `bias` when the layer has
    /// one.
    fn conv(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        (cin, cout, kernel): (usize, Option<usize>, usize),
        stride: usize,
        bias: bool,
    ) -> Result<(String, usize)> {
        let shape = ConvShape { stride, padding: kernel / 2, groups: 1 };
        self.conv_with(sd, prefix, x, (cin, cout, kernel), shape, bias)
    }

    /// A square convolution of any padding and group count: weight `[cout, cin / groups, k, k]`.
    fn conv_with(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        (cin, cout, kernel): (usize, Option<usize>, usize),
        shape: ConvShape,
        bias: bool,
    ) -> Result<(String, usize)> {
        let per_group = Some(cin / shape.groups);
        let w =
            sd.take(&format!("{prefix}.weight"), &[cout, per_group, Some(kernel), Some(kernel)])?;
        let cout = w.dims[0];
        let mut inputs = vec![x.to_string(), self.init(w)];
        if bias {
            let b = sd.take(&format!("{prefix}.bias"), &[Some(cout)])?;
            inputs.push(self.init(b));
        }
        let pad = shape.padding as i64;
        let attrs = vec![
            ints("kernel_shape", &[kernel as i64, kernel as i64]),
            ints("pads", &[pad, pad, pad, pad]),
            ints("strides", &[shape.stride as i64, shape.stride as i64]),
            ints("dilations", &[1, 1]),
            int("group", shape.groups as i64),
        ];
        let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        Ok((self.b.node("Conv", &refs, attrs), cout))
    }

    /// Eval-mode BatchNorm2d: `(x - running_mean) / sqrt(running_var + eps) * weight + bias`.
    fn batch_norm(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        channels: usize,
    ) -> Result<String> {
        self.batch_norm_eps(sd, prefix, x, channels, BN_EPS)
    }

    fn batch_norm_eps(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        channels: usize,
        eps: f32,
    ) -> Result<String> {
        let mut inputs = vec![x.to_string()];
        for part in ["weight", "bias", "running_mean", "running_var"] {
            let w = sd.take(&format!("{prefix}.{part}"), &[Some(channels)])?;
            inputs.push(self.init(w));
        }
        let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        Ok(self.b.node("BatchNormalization", &refs, vec![float("epsilon", eps)]))
    }

    fn relu(&mut self, x: &str) -> String {
        self.b.node("Relu", &[x], vec![])
    }

    fn max_pool_2x2(&mut self, x: &str) -> String {
        let attrs = vec![ints("kernel_shape", &[2, 2]), ints("strides", &[2, 2])];
        self.b.node("MaxPool", &[x], attrs)
    }

    fn flatten(&mut self, x: &str) -> String {
        self.b.node("Flatten", &[x], vec![int("axis", 1)])
    }

    fn mlp(&mut self, sd: &mut StateDict) -> Result<(Vec<Dim>, String, usize)> {
        let inputs = sd.dims("fc1.weight", 2)?[1];
        let input = vec![Dim::Named("batch"), Dim::Fixed(inputs)];
        let mut x = self.b.input("input", &input);
        let mut width = inputs;
        for layer in 1.. {
            (x, width) = self.linear(sd, &format!("fc{layer}"), &x, width)?;
            if !sd.contains(&format!("fc{}.weight", layer + 1)) {
                break;
            }
            x = self.relu(&x);
        }
        Ok((input, x, width))
    }

    fn cnn(&mut self, sd: &mut StateDict) -> Result<(Vec<Dim>, String, usize)> {
        const C1: usize = 8;
        const C2: usize = 16;
        // The image side comes from fc's in-features: 16 channels of (side/4)².
        let fc_in = sd.dims("fc.weight", 2)?[1];
        let quarter = ((fc_in / C2) as f64).sqrt().round() as usize;
        if quarter == 0 || C2 * quarter * quarter != fc_in {
            return Err(OnnxError::Shape {
                model: "cnn",
                key: "fc.weight".into(),
                got: sd.dims("fc.weight", 2)?.to_vec(),
                expected: "[classes, 16·(H/4)²] for square H×H images".into(),
            });
        }
        let side = 4 * quarter;
        let channels = sd.dims("conv1.weight", 4)?[1];
        let input =
            vec![Dim::Named("batch"), Dim::Fixed(channels), Dim::Fixed(side), Dim::Fixed(side)];
        let x = self.b.input("input", &input);
        let (x, _) = self.conv(sd, "conv1", &x, (channels, Some(C1), 3), 1, true)?;
        let x = self.batch_norm(sd, "bn1", &x, C1)?;
        let x = self.relu(&x);
        let x = self.max_pool_2x2(&x);
        let (x, _) = self.conv(sd, "conv2", &x, (C1, Some(C2), 3), 1, true)?;
        let x = self.relu(&x);
        let x = self.max_pool_2x2(&x);
        let x = self.flatten(&x);
        let (logits, classes) = self.linear(sd, "fc", &x, fc_in)?;
        Ok((input, logits, classes))
    }

    fn resnet18(&mut self, sd: &mut StateDict) -> Result<(Vec<Dim>, String, usize)> {
        let input =
            vec![Dim::Named("batch"), Dim::Fixed(3), Dim::Named("height"), Dim::Named("width")];
        let x = self.b.input("input", &input);
        let (x, width) = self.conv(sd, "conv1", &x, (3, None, 3), 1, false)?;
        let x = self.batch_norm(sd, "bn1", &x, width)?;
        let mut x = self.relu(&x);
        let mut cin = width;
        for (stage, mult) in [1, 2, 4, 8].into_iter().enumerate() {
            let cout = width * mult;
            for block in 0..2 {
                let stride = if stage > 0 && block == 0 { 2 } else { 1 };
                let prefix = format!("layer{}.{block}", stage + 1);
                x = self.basic_block(sd, &prefix, &x, cin, cout, stride)?;
                cin = cout;
            }
        }
        let pooled = self.b.node("GlobalAveragePool", &[&x], vec![]);
        let flat = self.flatten(&pooled);
        let (logits, classes) = self.linear(sd, "fc", &flat, cin)?;
        Ok((input, logits, classes))
    }

    /// relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), the shortcut a strided 1x1
    /// convolution and BatchNorm where the shape changes.
    fn basic_block(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        cin: usize,
        cout: usize,
        stride: usize,
    ) -> Result<String> {
        let (h, _) =
            self.conv(sd, &format!("{prefix}.conv1"), x, (cin, Some(cout), 3), stride, false)?;
        let h = self.batch_norm(sd, &format!("{prefix}.bn1"), &h, cout)?;
        let h = self.relu(&h);
        let (h, _) =
            self.conv(sd, &format!("{prefix}.conv2"), &h, (cout, Some(cout), 3), 1, false)?;
        let h = self.batch_norm(sd, &format!("{prefix}.bn2"), &h, cout)?;
        let shortcut = if stride != 1 || cin != cout {
            let (s, _) = self.conv(
                sd,
                &format!("{prefix}.downsample.0"),
                x,
                (cin, Some(cout), 1),
                stride,
                false,
            )?;
            self.batch_norm(sd, &format!("{prefix}.downsample.1"), &s, cout)?
        } else {
            x.to_string()
        };
        let sum = self.b.node("Add", &[&h, &shortcut], vec![]);
        Ok(self.relu(&sum))
    }

    /// PReLU with one slope per channel (`[C]` in the state dict, `[C, 1, 1]` in the graph so it
    /// broadcasts over `[N, C, H, W]`).
    fn prelu(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        channels: usize,
    ) -> Result<String> {
        let mut w = sd.take(&format!("{prefix}.weight"), &[Some(channels)])?;
        w.dims = vec![channels, 1, 1];
        let slope = self.init(w);
        Ok(self.b.node("PRelu", &[x, &slope], vec![]))
    }

    fn iresnet(&mut self, sd: &mut StateDict, depth: usize) -> Result<(Vec<Dim>, String, usize)> {
        let blocks: &[usize] = match depth {
            18 => &[2, 2, 2, 2],
            34 => &[3, 4, 6, 3],
            50 => &[3, 4, 14, 3],
            100 => &[3, 13, 30, 3],
            _ => &[6, 26, 60, 6],
        };
        let side = tandem_models::FACE_SIDE;
        let input = vec![Dim::Named("batch"), Dim::Fixed(3), Dim::Fixed(side), Dim::Fixed(side)];
        let x = self.b.input("input", &input);
        let (x, width) = self.conv(sd, "conv1", &x, (3, None, 3), 1, false)?;
        let x = self.batch_norm(sd, "bn1", &x, width)?;
        let mut x = self.prelu(sd, "prelu", &x, width)?;
        let mut cin = width;
        for (stage, (&n, mult)) in blocks.iter().zip([1, 2, 4, 8]).enumerate() {
            let cout = width * mult;
            for block in 0..n {
                let stride = if block == 0 { 2 } else { 1 };
                let prefix = format!("layer{}.{block}", stage + 1);
                x = self.ibasic_block(sd, &prefix, &x, cin, cout, stride)?;
                cin = cout;
            }
        }
        let x = self.batch_norm(sd, "bn2", &x, cin)?;
        let flat = self.flatten(&x);
        let fc_in = cin * (side / 16) * (side / 16);
        let (x, embedding) = self.linear(sd, "fc", &flat, fc_in)?;
        // BatchNorm1d on [N, E]: ONNX's BatchNormalization takes [N, C] as well.
        let x = self.batch_norm(sd, "features", &x, embedding)?;
        Ok((input, x, embedding))
    }

    /// arcface_torch's IBasicBlock: bn3(conv2(prelu(bn2(conv1(bn1(x)))))) + shortcut(x), no
    /// activation after the sum.
    fn ibasic_block(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        cin: usize,
        cout: usize,
        stride: usize,
    ) -> Result<String> {
        let h = self.batch_norm(sd, &format!("{prefix}.bn1"), x, cin)?;
        let (h, _) =
            self.conv(sd, &format!("{prefix}.conv1"), &h, (cin, Some(cout), 3), 1, false)?;
        let h = self.batch_norm(sd, &format!("{prefix}.bn2"), &h, cout)?;
        let h = self.prelu(sd, &format!("{prefix}.prelu"), &h, cout)?;
        let (h, _) =
            self.conv(sd, &format!("{prefix}.conv2"), &h, (cout, Some(cout), 3), stride, false)?;
        let h = self.batch_norm(sd, &format!("{prefix}.bn3"), &h, cout)?;
        let shortcut = if stride != 1 || cin != cout {
            let (s, _) = self.conv(
                sd,
                &format!("{prefix}.downsample.0"),
                x,
                (cin, Some(cout), 1),
                stride,
                false,
            )?;
            self.batch_norm(sd, &format!("{prefix}.downsample.1"), &s, cout)?
        } else {
            x.to_string()
        };
        Ok(self.b.node("Add", &[&h, &shortcut], vec![]))
    }

    /// arcface_torch's MobileFaceNet (tandem_models::MobileFaceNet's layout and names).
    fn mobilefacenet(
        &mut self,
        sd: &mut StateDict,
        blocks: [usize; 4],
        scale: usize,
    ) -> Result<(Vec<Dim>, String, usize)> {
        let side = tandem_models::FACE_SIDE;
        let input = vec![Dim::Named("batch"), Dim::Fixed(3), Dim::Fixed(side), Dim::Fixed(side)];
        let x = self.b.input("input", &input);
        let (c1, c2) = (64 * scale, 128 * scale);
        let stem = ConvShape { stride: 2, padding: 1, groups: 1 };
        let mut x = self.conv_bn(sd, "layers.0", &x, (3, c1, 3), stem, true)?;
        x = if blocks[0] == 1 {
            let grouped = ConvShape { stride: 1, padding: 1, groups: 64 };
            self.conv_bn(sd, "layers.1", &x, (c1, c1, 3), grouped, true)?
        } else {
            self.residual(sd, "layers.1", &x, (c1, blocks[0], 128))?
        };
        x = self.depthwise(sd, "layers.2", &x, (c1, c1, 128), 2, false)?;
        x = self.residual(sd, "layers.3", &x, (c1, blocks[1], 128))?;
        x = self.depthwise(sd, "layers.4", &x, (c1, c2, 256), 2, false)?;
        x = self.residual(sd, "layers.5", &x, (c2, blocks[2], 256))?;
        x = self.depthwise(sd, "layers.6", &x, (c2, c2, 512), 2, false)?;
        x = self.residual(sd, "layers.7", &x, (c2, blocks[3], 256))?;
        let one = ConvShape { stride: 1, padding: 0, groups: 1 };
        x = self.conv_bn(sd, "conv_sep", &x, (c2, 512, 1), one, true)?;
        let gdc = ConvShape { stride: 1, padding: 0, groups: 512 };
        x = self.conv_bn(sd, "features.layers.0", &x, (512, 512, 7), gdc, false)?;
        let flat = self.flatten(&x);
        let w = sd.take("features.layers.2.weight", &[None, Some(512)])?;
        let embedding = w.dims[0];
        let w = self.init(w);
        let x = self.b.node("Gemm", &[&flat, &w], vec![int("transB", 1)]);
        let x = self.batch_norm(sd, "features.layers.3", &x, embedding)?;
        Ok((input, x, embedding))
    }

    /// A ConvBlock (conv, BatchNorm, PReLU) or, without `prelu`, a LinearBlock, at `prefix`
    /// (its `layers.0`, `.1`, `.2`).
    fn conv_bn(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        (cin, cout, kernel): (usize, usize, usize),
        shape: ConvShape,
        prelu: bool,
    ) -> Result<String> {
        let conv = format!("{prefix}.layers.0");
        let (x, _) = self.conv_with(sd, &conv, x, (cin, Some(cout), kernel), shape, false)?;
        let x = self.batch_norm(sd, &format!("{prefix}.layers.1"), &x, cout)?;
        if prelu {
            self.prelu(sd, &format!("{prefix}.layers.2"), &x, cout)
        } else {
            Ok(x)
        }
    }

    /// arcface_torch's DepthWise: 1x1 to `inner`, 3x3 depthwise at `stride`, 1x1 to `cout`.
    fn depthwise(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        (cin, cout, inner): (usize, usize, usize),
        stride: usize,
        residual: bool,
    ) -> Result<String> {
        let one = ConvShape { stride: 1, padding: 0, groups: 1 };
        let dw = ConvShape { stride, padding: 1, groups: inner };
        let h = self.conv_bn(sd, &format!("{prefix}.layers.0"), x, (cin, inner, 1), one, true)?;
        let h = self.conv_bn(sd, &format!("{prefix}.layers.1"), &h, (inner, inner, 3), dw, true)?;
        let h =
            self.conv_bn(sd, &format!("{prefix}.layers.2"), &h, (inner, cout, 1), one, false)?;
        Ok(if residual { self.b.node("Add", &[&h, x], vec![]) } else { h })
    }

    /// arcface_torch's Residual: `n` residual DepthWise blocks over `c` channels.
    fn residual(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        (c, n, inner): (usize, usize, usize),
    ) -> Result<String> {
        let mut x = x.to_string();
        for i in 0..n {
            x = self.depthwise(sd, &format!("{prefix}.layers.{i}"), &x, (c, c, inner), 1, true)?;
        }
        Ok(x)
    }

    /// arcface_torch's ViT (tandem_models::Vit's layout and names); sizes from the weights.
    fn vit(&mut self, sd: &mut StateDict, heads: usize) -> Result<(Vec<Dim>, String, usize)> {
        use tandem_models::VIT_PATCHES as T;
        let side = tandem_models::FACE_SIDE;
        let input = vec![Dim::Named("batch"), Dim::Fixed(3), Dim::Fixed(side), Dim::Fixed(side)];
        let x = self.b.input("input", &input);
        let d = sd.dims("pos_embed", 3)?[2];
        let patch = ConvShape { stride: 9, padding: 0, groups: 1 };
        let (x, _) = self.conv_with(sd, "patch_embed.proj", &x, (3, Some(d), 9), patch, true)?;
        let x = self.reshape(&x, &[0, d as i64, T as i64]);
        let x = self.b.node("Transpose", &[&x], vec![ints("perm", &[0, 2, 1])]);
        let pos = sd.take("pos_embed", &[Some(1), Some(T), Some(d)])?;
        let pos = self.init(pos);
        let mut x = self.b.node("Add", &[&x, &pos], vec![]);
        sd.take("mask_token", &[Some(1), Some(1), Some(d)])?; // training only
        let mut i = 0;
        while sd.contains(&format!("blocks.{i}.norm1.weight")) {
            x = self.vit_block(sd, &format!("blocks.{i}"), &x, d, heads)?;
            i += 1;
        }
        let x = self.layer_norm(sd, "norm", &x, d)?;
        let x = self.reshape(&x, &[0, (T * d) as i64]);
        let w = sd.take("feature.0.weight", &[Some(d), Some(T * d)])?;
        let w = self.init(w);
        let x = self.b.node("Gemm", &[&x, &w], vec![int("transB", 1)]);
        let x = self.batch_norm_eps(sd, "feature.1", &x, d, VIT_FEATURE_BN_EPS)?;
        let w = sd.take("feature.2.weight", &[None, Some(d)])?;
        let embedding = w.dims[0];
        let w = self.init(w);
        let x = self.b.node("Gemm", &[&x, &w], vec![int("transB", 1)]);
        let x = self.batch_norm_eps(sd, "feature.3", &x, embedding, VIT_FEATURE_BN_EPS)?;
        Ok((input, x, embedding))
    }

    /// `x + attn(norm1(x))`, then `x + mlp(norm2(x))`, over `x: [batch, 144, d]`.
    fn vit_block(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        d: usize,
        heads: usize,
    ) -> Result<String> {
        use tandem_models::VIT_PATCHES as T;
        let hd = d / heads;
        let h = self.layer_norm(sd, &format!("{prefix}.norm1"), x, d)?;
        let qkv = self.matmul_linear(sd, &format!("{prefix}.attn.qkv"), &h, d, false)?;
        let qkv = self.reshape(&qkv, &[0, T as i64, 3, heads as i64, hd as i64]);
        let qkv = self.b.node("Transpose", &[&qkv], vec![ints("perm", &[2, 0, 3, 1, 4])]);
        let mut part = |i: i64| {
            let index = self.b.constant_int(i);
            self.b.node("Gather", &[&qkv, &index], vec![int("axis", 0)])
        };
        let (q, k, v) = (part(0), part(1), part(2));
        let kt = self.b.node("Transpose", &[&k], vec![ints("perm", &[0, 1, 3, 2])]);
        let scores = self.b.node("MatMul", &[&q, &kt], vec![]);
        let scale = (hd as f32).powf(-0.5);
        let scale = self.b.constant_float(scale);
        let scores = self.b.node("Mul", &[&scores, &scale], vec![]);
        let attn = self.b.node("Softmax", &[&scores], vec![int("axis", -1)]);
        let y = self.b.node("MatMul", &[&attn, &v], vec![]);
        let y = self.b.node("Transpose", &[&y], vec![ints("perm", &[0, 2, 1, 3])]);
        let y = self.reshape(&y, &[0, T as i64, d as i64]);
        let y = self.matmul_linear(sd, &format!("{prefix}.attn.proj"), &y, d, true)?;
        let x = self.b.node("Add", &[x, &y], vec![]);
        let h = self.layer_norm(sd, &format!("{prefix}.norm2"), &x, d)?;
        let hidden = sd.dims(&format!("{prefix}.mlp.fc1.weight"), 2)?[0];
        let h = self.matmul_linear(sd, &format!("{prefix}.mlp.fc1"), &h, d, true)?;
        let (low, high) = (self.b.constant_float(0.0), self.b.constant_float(6.0));
        let h = self.b.node("Clip", &[&h, &low, &high], vec![]);
        let h = self.matmul_linear(sd, &format!("{prefix}.mlp.fc2"), &h, hidden, true)?;
        Ok(self.b.node("Add", &[&x, &h], vec![]))
    }

    /// `nn.Linear` over the last dimension of a rank-3 input: MatMul with the transposed
    /// weight (plus the bias when `bias`).
    fn matmul_linear(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        inputs: usize,
        bias: bool,
    ) -> Result<String> {
        let w = sd.take(&format!("{prefix}.weight"), &[None, Some(inputs)])?;
        let out = w.dims[0];
        let w = self.init(w);
        let wt = self.b.node("Transpose", &[&w], vec![ints("perm", &[1, 0])]);
        let y = self.b.node("MatMul", &[x, &wt], vec![]);
        if !bias {
            return Ok(y);
        }
        let b = sd.take(&format!("{prefix}.bias"), &[Some(out)])?;
        let b = self.init(b);
        Ok(self.b.node("Add", &[&y, &b], vec![]))
    }

    /// `nn.LayerNorm(d)` over the last dimension.
    fn layer_norm(
        &mut self,
        sd: &mut StateDict,
        prefix: &str,
        x: &str,
        d: usize,
    ) -> Result<String> {
        let w = sd.take(&format!("{prefix}.weight"), &[Some(d)])?;
        let b = sd.take(&format!("{prefix}.bias"), &[Some(d)])?;
        let (w, b) = (self.init(w), self.init(b));
        let attrs = vec![int("axis", -1), float("epsilon", LN_EPS)];
        Ok(self.b.node("LayerNormalization", &[x, &w, &b], attrs))
    }

    /// `x.reshape(shape)`, a 0 keeping that dimension of `x` (the batch).
    fn reshape(&mut self, x: &str, shape: &[i64]) -> String {
        let shape = self.b.constant_ints(shape);
        self.b.node("Reshape", &[x, &shape], vec![])
    }
}
