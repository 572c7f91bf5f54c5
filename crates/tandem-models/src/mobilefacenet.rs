//! MobileFaceNet, arcface_torch's `mbf` and `mbf_large`
//! (`recognition/arcface_torch/backbones/mobilefacenet.py`), with its module layout and
//! state-dict names so its checkpoints load strictly and ours load back into it:
//!
//! - `ConvBlock` = conv (no bias) → BatchNorm → PReLU, `LinearBlock` = conv → BatchNorm, each a
//!   `layers` Sequential (`.layers.0` conv, `.layers.1` BatchNorm, `.layers.2` PReLU);
//! - `DepthWise(cin, cout, inner)` = 1x1 ConvBlock `cin → inner`, 3x3 depthwise ConvBlock over
//!   `inner` channels (its stride), 1x1 LinearBlock `inner → cout`, plus the input when residual;
//!   `Residual` a Sequential of residual DepthWise blocks;
//! - `layers`: 3x3 stride-2 ConvBlock `3 → 64s`; then a 3x3 ConvBlock in 64 groups (when
//!   `blocks[0] == 1`) or a Residual of `blocks[0]`; DepthWise stride 2 (inner 128), Residual
//!   (inner 128), DepthWise to 128s stride 2 (inner 256), Residual (inner 256), DepthWise stride 2
//!   (inner 512), Residual (inner 256) — `s` the scale (mbf 2, mbf_large 4), blocks (1, 4, 6, 2)
//!   and (2, 8, 12, 4);
//! - `conv_sep`: 1x1 ConvBlock to 512; `features` (GDC): a 7x7 LinearBlock in 512 groups,
//!   flatten, `Linear(512, E, bias=False)` (`features.layers.2`), BatchNorm1d
//!   (`features.layers.3`, trained, unlike IResNet's).
//!
//! Inputs are 112x112 RGB; every BatchNorm has eps 1e-5 and momentum 0.1.
use candle_core::{Tensor, Var};
use candle_nn::{Conv2dConfig, Module, ModuleT, VarBuilder};
use rand::rngs::StdRng;
use tandem_nn::torch_init::standard_normal;
use tandem_nn::{
    fast_batch_norm2d, fast_conv2d_no_bias, fast_linear_no_bias, fast_prelu, FastBatchNorm2d,
    FastConv2d, FastLinear, FastPRelu, HasBatchNorm,
};

use crate::FACE_SIDE;

/// Conv → BatchNorm (→ PReLU for a ConvBlock; none for a LinearBlock).
struct ConvBn {
    conv: FastConv2d,
    bn: FastBatchNorm2d,
    prelu: Option<FastPRelu>,
}

impl ConvBn {
    /// `(cin, cout, kernel, stride, padding, groups)`; `prelu` makes it a ConvBlock.
    fn new(
        (cin, cout, kernel, stride, padding, groups): (usize, usize, usize, usize, usize, usize),
        prelu: bool,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let vb = vb.pp("layers");
        let cfg = Conv2dConfig { padding, stride, groups, ..Default::default() };
        let conv = fast_conv2d_no_bias(cin, cout, kernel, cfg, vb.pp("0"))?;
        let bn = fast_batch_norm2d(cout, vb.pp("1"))?;
        let prelu = prelu.then(|| fast_prelu(cout, vb.pp("2"))).transpose()?;
        Ok(ConvBn { conv, bn, prelu })
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        match &self.prelu {
            Some(p) => self.bn.forward_conv_t_prelu(&self.conv, x, p, train),
            None => self.bn.forward_conv_t(&self.conv, x, train),
        }
    }
}

/// arcface_torch's `DepthWise`: expand (1x1), depthwise 3x3, project (1x1), optional residual.
struct DepthWise {
    expand: ConvBn,
    depthwise: ConvBn,
    project: ConvBn,
    residual: bool,
}

impl DepthWise {
    fn new(
        (cin, cout, inner): (usize, usize, usize),
        stride: usize,
        residual: bool,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let vb = vb.pp("layers");
        Ok(DepthWise {
            expand: ConvBn::new((cin, inner, 1, 1, 0, 1), true, vb.pp("0"))?,
            depthwise: ConvBn::new((inner, inner, 3, stride, 1, inner), true, vb.pp("1"))?,
            project: ConvBn::new((inner, cout, 1, 1, 0, 1), false, vb.pp("2"))?,
            residual,
        })
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let y = self.expand.forward_t(x, train)?;
        let y = self.depthwise.forward_t(&y, train)?;
        let y = self.project.forward_t(&y, train)?;
        if self.residual {
            y + x
        } else {
            Ok(y)
        }
    }

    fn batch_norms(&self) -> [&FastBatchNorm2d; 3] {
        [&self.expand.bn, &self.depthwise.bn, &self.project.bn]
    }
}

/// One entry of `layers`.
enum Stage {
    Conv(ConvBn),
    Blocks(Vec<DepthWise>),
}

/// arcface_torch's MobileFaceNet at any `blocks` and `scale` (see the module docs).
pub struct MobileFaceNet {
    stages: Vec<Stage>,
    conv_sep: ConvBn,
    gdc: ConvBn,
    linear: FastLinear,
    features: FastBatchNorm2d,
    embedding: usize,
}

impl MobileFaceNet {
    /// arcface_torch's `mbf`: blocks (1, 4, 6, 2), scale 2.
    pub const MBF: ([usize; 4], usize) = ([1, 4, 6, 2], 2);
    /// arcface_torch's `mbf_large`: blocks (2, 8, 12, 4), scale 4.
    pub const MBF_LARGE: ([usize; 4], usize) = ([2, 8, 12, 4], 4);

    /// MobileFaceNet with `blocks` per residual stage, channel `scale` and an `embedding`-wide
    /// output. candle initialises the variables; call [`MobileFaceNet::reset_parameters`] for
    /// arcface_torch's initialisation from a seed.
    pub fn new(
        blocks: [usize; 4],
        scale: usize,
        embedding: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        if scale == 0 || embedding == 0 || blocks.contains(&0) {
            candle_core::bail!(
                "MobileFaceNet needs scale, embedding and every stage's blocks >= 1, got scale \
                 {scale}, embedding {embedding}, blocks {blocks:?}"
            )
        }
        let (c1, c2) = (64 * scale, 128 * scale);
        let vb_layers = vb.pp("layers");
        let at = |i: usize| vb_layers.pp(i.to_string());
        let residual = |c: usize, n: usize, inner: usize, vb: VarBuilder| {
            let vb = vb.pp("layers");
            (0..n)
                .map(|i| DepthWise::new((c, c, inner), 1, true, vb.pp(i.to_string())))
                .collect::<candle_core::Result<Vec<_>>>()
                .map(Stage::Blocks)
        };
        let mut stages = vec![Stage::Conv(ConvBn::new((3, c1, 3, 2, 1, 1), true, at(0))?)];
        stages.push(if blocks[0] == 1 {
            Stage::Conv(ConvBn::new((c1, c1, 3, 1, 1, 64), true, at(1))?)
        } else {
            residual(c1, blocks[0], 128, at(1))?
        });
        let down = |cin, cout, inner, vb| -> candle_core::Result<Stage> {
            Ok(Stage::Blocks(vec![DepthWise::new((cin, cout, inner), 2, false, vb)?]))
        };
        stages.push(down(c1, c1, 128, at(2))?);
        stages.push(residual(c1, blocks[1], 128, at(3))?);
        stages.push(down(c1, c2, 256, at(4))?);
        stages.push(residual(c2, blocks[2], 256, at(5))?);
        stages.push(down(c2, c2, 512, at(6))?);
        stages.push(residual(c2, blocks[3], 256, at(7))?);
        let conv_sep = ConvBn::new((c2, 512, 1, 1, 0, 1), true, vb.pp("conv_sep"))?;
        let vb_gdc = vb.pp("features").pp("layers");
        let gdc = ConvBn::new((512, 512, 7, 1, 0, 512), false, vb_gdc.pp("0"))?;
        let linear = fast_linear_no_bias(512, embedding, vb_gdc.pp("2"))?;
        let features = fast_batch_norm2d(embedding, vb_gdc.pp("3"))?;
        Ok(MobileFaceNet { stages, conv_sep, gdc, linear, features, embedding })
    }

    /// The embedding width.
    pub fn embedding(&self) -> usize {
        self.embedding
    }

    /// arcface_torch's `_initialize_weights`, seeded (our stream, not torch's): convolution and
    /// linear weights Kaiming-normal in fan-out mode for ReLU, std `sqrt(2 / fan_out)` with
    /// fan_out = `weight.size(0)` x kernel area as torch computes it (groups not divided out);
    /// BatchNorm weight 1 and bias 0; PReLU slopes 0.25 (PyTorch's default).
    pub fn reset_parameters(named: &[(String, Var)], seed: u64) -> candle_core::Result<()> {
        crate::face::set_initial_values(named, seed, MobileFaceNet::initial_values)
    }

    /// The values [`MobileFaceNet::reset_parameters`] gives the variable `name` of shape
    /// `dims`, drawn from `rng` (`None`: it keeps its builder's).
    pub(crate) fn initial_values(name: &str, dims: &[usize], rng: &mut StdRng) -> Option<Vec<f32>> {
        let n = dims.iter().product();
        let last = name.rsplit('.').next().unwrap_or("");
        Some(if last == "weight" && dims.len() >= 2 {
            // torch's fan_out: dim 0 times the receptive field (dims 2..).
            let fan_out = dims[0] * dims[2..].iter().product::<usize>();
            let std = (2.0 / fan_out as f64).sqrt();
            (0..n).map(|_| (standard_normal(rng) * std) as f32).collect()
        } else if dims.len() == 1 && is_prelu(name) {
            vec![0.25; n]
        } else {
            return crate::face::norm_default(last, n);
        })
    }

    /// Embeddings `[N, E]` for `x: [N, 3, 112, 112]` (or `[N, 3 * 112 * 112]`, reshaped).
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let x = if x.rank() == 2 {
            x.reshape((x.dim(0)?, 3, FACE_SIDE, FACE_SIDE))?
        } else {
            x.clone()
        };
        if x.dims()[1..] != [3, FACE_SIDE, FACE_SIDE] {
            candle_core::bail!("MobileFaceNet takes [N, 3, 112, 112] images, got {:?}", x.dims())
        }
        let mut x = x;
        for stage in &self.stages {
            x = match stage {
                Stage::Conv(c) => c.forward_t(&tandem_nn::cut_graph(x), train)?,
                Stage::Blocks(blocks) => blocks
                    .iter()
                    .try_fold(x, |x, b| b.forward_t(&tandem_nn::cut_graph(x), train))?,
            };
        }
        // arcface_torch leaves its autocast scope here: conv_sep and the head run in f32.
        tandem_nn::autocast(None, || {
            let x = x.to_dtype(candle_core::DType::F32)?;
            let x = self.conv_sep.forward_t(&x, train)?;
            let x = self.gdc.forward_t(&x, train)?.flatten_from(1)?;
            let x = self.linear.forward(&x)?;
            let n = x.dim(0)?;
            let x = self.features.forward_t(&x.reshape((n, self.embedding, 1, 1))?, train)?;
            x.reshape((n, self.embedding))
        })
    }
}

/// PReLU slopes are the third module of a ConvBlock's `layers`.
fn is_prelu(name: &str) -> bool {
    name.ends_with("layers.2.weight") && !name.starts_with("features.")
}

impl ModuleT for MobileFaceNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        MobileFaceNet::forward_t(self, x, train)
    }
}

impl HasBatchNorm for MobileFaceNet {
    /// Every 2-d BatchNorm (the embedding's BatchNorm1d stays per rank, as IResNet's).
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d> {
        let mut out = Vec::new();
        for stage in &self.stages {
            match stage {
                Stage::Conv(c) => out.push(&c.bn),
                Stage::Blocks(blocks) => {
                    out.extend(blocks.iter().flat_map(DepthWise::batch_norms));
                }
            }
        }
        out.extend([&self.conv_sep.bn, &self.gdc.bn]);
        out
    }
}
