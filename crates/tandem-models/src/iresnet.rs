//! IResNet, the face-recognition backbone of insightface's arcface_torch
//! (`recognition/arcface_torch/backbones/iresnet.py`), with its layout and state-dict names so
//! arcface_torch's `model.pt` loads strictly and what tandem saves loads back into it:
//!
//! - stem: `conv1` (3x3, stride 1, no bias), `bn1`, `prelu`;
//! - `layer1`..`layer4` of `IBasicBlock`s at widths w, 2w, 4w, 8w (arcface_torch: w = 64), each
//!   stage's first block with stride 2: `bn1`, `conv1` (3x3), `bn2`, `prelu`, `conv2` (3x3, the
//!   block's stride), `bn3`, plus the input — through `downsample.0` (1x1 conv, stride 2) and
//!   `downsample.1` (BatchNorm) in a stage's first block;
//! - `bn2`, flatten, dropout, `fc` (`8w * 7 * 7 -> E`), `features` (BatchNorm1d over the
//!   embedding whose weight is fixed at 1 and never trained: [`IResNet::FROZEN`]).
//!
//! Every BatchNorm has eps 1e-5 and momentum 0.1; inputs are 112x112 RGB. The convolutions run
//! on tandem's CPU kernels ([`tandem_nn::FastConv2d`]).
use candle_core::{Tensor, Var};
use candle_nn::{Conv2dConfig, Module, ModuleT, VarBuilder};
use rand::rngs::StdRng;
use rand::Rng;
use tandem_nn::torch_init::standard_normal;

use tandem_nn::{
    fast_batch_norm2d, fast_conv2d_no_bias, fast_linear, fast_prelu, FastBatchNorm2d, FastConv2d,
    FastLinear, FastPRelu, HasBatchNorm,
};

use crate::UnitRunner;

/// The input side arcface_torch's IResNets take (the last stage is then 7x7).
pub const FACE_SIDE: usize = 112;

/// Blocks per stage of each depth arcface_torch defines.
fn stage_blocks(depth: usize) -> Option<[usize; 4]> {
    Some(match depth {
        18 => [2, 2, 2, 2],
        34 => [3, 4, 6, 3],
        50 => [3, 4, 14, 3],
        100 => [3, 13, 30, 3],
        200 => [6, 26, 60, 6],
        _ => return None,
    })
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

struct IBasicBlock {
    bn1: FastBatchNorm2d,
    conv1: FastConv2d,
    bn2: FastBatchNorm2d,
    prelu: FastPRelu,
    conv2: FastConv2d,
    bn3: FastBatchNorm2d,
    downsample: Option<(FastConv2d, FastBatchNorm2d)>,
}

impl IBasicBlock {
    fn new(cin: usize, cout: usize, stride: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let bn1 = fast_batch_norm2d(cin, vb.pp("bn1"))?;
        let conv1 = conv3x3(cin, cout, 1, vb.pp("conv1"))?;
        let bn2 = fast_batch_norm2d(cout, vb.pp("bn2"))?;
        let prelu = fast_prelu(cout, vb.pp("prelu"))?;
        let conv2 = conv3x3(cout, cout, stride, vb.pp("conv2"))?;
        let bn3 = fast_batch_norm2d(cout, vb.pp("bn3"))?;
        let downsample = if stride != 1 || cin != cout {
            let cfg = Conv2dConfig { stride, ..Default::default() };
            let conv = fast_conv2d_no_bias(cin, cout, 1, cfg, vb.pp("downsample.0"))?;
            Some((conv, fast_batch_norm2d(cout, vb.pp("downsample.1"))?))
        } else {
            None
        };
        Ok(IBasicBlock { bn1, conv1, bn2, prelu, conv2, bn3, downsample })
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let out = self.bn1.forward_t(x, train)?;
        let out = self.bn2.forward_conv_t_prelu(&self.conv1, &out, &self.prelu, train)?;
        let out = self.bn3.forward_conv_t(&self.conv2, &out, train)?;
        let identity = match &self.downsample {
            Some((conv, bn)) => bn.forward_conv_t(conv, x, train)?,
            None => x.clone(),
        };
        out + identity
    }
}

/// arcface_torch's IResNet-18/34/50/100/200 at any stage width (see the module docs).
pub struct IResNet {
    conv1: FastConv2d,
    bn1: FastBatchNorm2d,
    prelu: FastPRelu,
    layers: Vec<Vec<std::sync::Arc<IBasicBlock>>>,
    bn2: FastBatchNorm2d,
    dropout: f32,
    fc: FastLinear,
    features: FastBatchNorm2d,
    embedding: usize,
    runner: Option<UnitRunner>,
}

impl IResNet {
    /// Parameters that never train (arcface_torch sets `requires_grad = False` on them): give
    /// them to [`tandem_nn::NamedVars::freeze`] so Ddp and the optimizer leave them alone.
    pub const FROZEN: &'static [&'static str] = &["features.weight"];

    /// IResNet-`depth` (18, 34, 50, 100 or 200) with stage widths `width` x [1, 2, 4, 8]
    /// (arcface_torch: 64), an `embedding`-wide output and dropout `dropout` before `fc`.
    /// candle initialises the variables with its unseeded RNG; call
    /// [`IResNet::reset_parameters`] for arcface_torch's initialisation from a seed.
    pub fn new(
        depth: usize,
        width: usize,
        embedding: usize,
        dropout: f32,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let Some(blocks) = stage_blocks(depth) else {
            candle_core::bail!(
                "IResNet depth {depth}: arcface_torch defines 18, 34, 50, 100 and 200"
            )
        };
        if width == 0 || embedding == 0 {
            candle_core::bail!(
                "IResNet needs width and embedding >= 1, got {width} and {embedding}"
            )
        }
        if !(0.0..1.0).contains(&dropout) {
            candle_core::bail!("IResNet dropout {dropout}: must be in [0, 1)")
        }
        let conv1 = conv3x3(3, width, 1, vb.pp("conv1"))?;
        let bn1 = fast_batch_norm2d(width, vb.pp("bn1"))?;
        let prelu = fast_prelu(width, vb.pp("prelu"))?;
        let mut layers = Vec::new();
        let mut cin = width;
        for (stage, (n, mult)) in blocks.into_iter().zip([1, 2, 4, 8]).enumerate() {
            let cout = width * mult;
            let vb = vb.pp(format!("layer{}", stage + 1));
            let mut stage_blocks =
                vec![std::sync::Arc::new(IBasicBlock::new(cin, cout, 2, vb.pp("0"))?)];
            for i in 1..n {
                let block = IBasicBlock::new(cout, cout, 1, vb.pp(i.to_string()))?;
                stage_blocks.push(std::sync::Arc::new(block));
            }
            layers.push(stage_blocks);
            cin = cout;
        }
        let bn2 = fast_batch_norm2d(cin, vb.pp("bn2"))?;
        let side = FACE_SIDE / 16;
        let fc = fast_linear(cin * side * side, embedding, vb.pp("fc"))?;
        let features = fast_batch_norm2d(embedding, vb.pp("features"))?.with_frozen_weight();
        let runner = None;
        Ok(IResNet { conv1, bn1, prelu, layers, bn2, dropout, fc, features, embedding, runner })
    }

    /// Runs every residual block through `runner` (FSDP2's `fully_shard` per block), named
    /// `layer{stage}.{block}` as its parameters are; [`IResNet::unit_of`] names each
    /// parameter's unit (tandem-fsdp's `Units::by_name`).
    pub fn run_blocks_with(&mut self, runner: UnitRunner) {
        self.runner = Some(runner);
    }

    /// The unit of parameter `param` when the model runs through a [`UnitRunner`]:
    /// `layer{s}.{b}` for a residual block's, `None` (the root) for the stem's and the
    /// embedding head's.
    pub fn unit_of(param: &str) -> Option<String> {
        let mut parts = param.split('.');
        let (stage, block) = (parts.next()?, parts.next()?);
        let numbered = stage.strip_prefix("layer").is_some_and(|s| s.parse::<usize>().is_ok());
        (numbered && block.parse::<usize>().is_ok() && parts.next().is_some())
            .then(|| format!("{stage}.{block}"))
    }

    /// The embedding width.
    pub fn embedding(&self) -> usize {
        self.embedding
    }

    /// arcface_torch's initialisation, seeded (our stream, not torch's): convolution weights
    /// N(0, 0.1), BatchNorm weight 1 and bias 0, PReLU slopes 0.25, `fc` PyTorch's default
    /// U(-1/sqrt(in), 1/sqrt(in)) for weight and bias. `named` are the model's variables in
    /// creation order ([`tandem_nn::OrderedVarMap::named`]), which fixes the stream.
    pub fn reset_parameters(named: &[(String, Var)], seed: u64) -> candle_core::Result<()> {
        let fc_bound = IResNet::fc_bound(named.iter().map(|(n, v)| (n.as_str(), v.dims())));
        crate::face::set_initial_values(named, seed, |name, dims, rng| {
            IResNet::initial_values(name, dims, rng, fc_bound)
        })
    }

    /// `fc`'s init bound, `1/sqrt(in)`, from the variables' names and shapes.
    pub(crate) fn fc_bound<'a>(mut shapes: impl Iterator<Item = (&'a str, &'a [usize])>) -> f32 {
        let fan_in = shapes.find(|(n, _)| *n == "fc.weight").and_then(|(_, d)| d.get(1).copied());
        1.0 / (fan_in.unwrap_or(1) as f32).sqrt()
    }

    /// The values [`IResNet::reset_parameters`] gives the variable `name` of shape `dims`,
    /// drawn from `rng` (`None`: it keeps its builder's).
    pub(crate) fn initial_values(
        name: &str,
        dims: &[usize],
        rng: &mut StdRng,
        fc_bound: f32,
    ) -> Option<Vec<f32>> {
        let n = dims.iter().product();
        let last = name.rsplit('.').next().unwrap_or("");
        Some(if last == "weight" && dims.len() == 4 {
            (0..n).map(|_| (standard_normal(rng) * 0.1) as f32).collect()
        } else if name.starts_with("fc.") {
            (0..n).map(|_| rng.random_range(-fc_bound..=fc_bound)).collect()
        } else if name.ends_with("prelu.weight") {
            vec![0.25; n]
        } else {
            return crate::face::norm_default(last, n);
        })
    }

    /// Embeddings `[N, E]` for `x: [N, 3, 112, 112]` (or `[N, 3 * 112 * 112]`, reshaped).
    /// BatchNorm uses batch statistics and dropout is on when `train`.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let x = if x.rank() == 2 {
            x.reshape((x.dim(0)?, 3, FACE_SIDE, FACE_SIDE))?
        } else {
            x.clone()
        };
        if x.dims()[1..] != [3, FACE_SIDE, FACE_SIDE] {
            candle_core::bail!("IResNet takes [N, 3, 112, 112] images, got {:?}", x.dims())
        }
        let mut x = self.bn1.forward_conv_t_prelu(&self.conv1, &x, &self.prelu, train)?;
        for (stage, blocks) in self.layers.iter().enumerate() {
            for (i, block) in blocks.iter().enumerate() {
                x = tandem_nn::cut_graph(x);
                x = match &self.runner {
                    Some(run) => {
                        let b = std::sync::Arc::clone(block);
                        let f: tandem_nn::CheckpointFn =
                            std::sync::Arc::new(move |x| b.forward_t(x, train));
                        run(&format!("layer{}.{i}", stage + 1), &x, f)?
                    }
                    None => block.forward_t(&x, train)?,
                };
            }
        }
        let mut x = self.bn2.forward_t(&x, train)?.flatten_from(1)?;
        if train && self.dropout > 0.0 {
            x = candle_nn::ops::dropout(&x, self.dropout)?;
        }
        // arcface_torch runs `fc` and `features` outside its autocast scope, in f32.
        tandem_nn::autocast(None, || {
            let x = self.fc.forward(&x.to_dtype(candle_core::DType::F32)?)?;
            let n = x.dim(0)?;
            // BatchNorm1d over the embedding: FastBatchNorm2d on [N, E, 1, 1].
            let x = self.features.forward_t(&x.reshape((n, self.embedding, 1, 1))?, train)?;
            x.reshape((n, self.embedding))
        })
    }
}

impl ModuleT for IResNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        IResNet::forward_t(self, x, train)
    }
}

impl HasBatchNorm for IResNet {
    /// The 2-d BatchNorms (the embedding's `features` BatchNorm1d stays per rank, as in
    /// arcface_torch, which converts none).
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d> {
        let mut out = vec![&self.bn1];
        for block in self.layers.iter().flatten() {
            out.extend([&block.bn1, &block.bn2, &block.bn3]);
            if let Some((_, bn)) = &block.downsample {
                out.push(bn);
            }
        }
        out.push(&self.bn2);
        out
    }
}
