//! The Vision Transformer of arcface_torch's `vit_t`, `vit_s`, `vit_b` and `vit_l`
//! (`recognition/arcface_torch/backbones/vit.py`), with its module layout and state-dict names
//! so its checkpoints load strictly and ours load back into it:
//!
//! - `patch_embed.proj`: a 9x9 stride-9 convolution `3 → D` with bias, on 112x112 inputs: 12x12
//!   = 144 patches (the last 4 rows and columns are never read, as in PyTorch); plus `pos_embed`
//!   `[1, 144, D]`;
//! - in training, arcface_torch's `random_masking`: each sample keeps `int(144 · 0.9)` = 129
//!   patches chosen by sorting uniform noise (the ratio is 0.1 whenever `mask_ratio > 0`: the
//!   model calls it without its own ratio); after the final LayerNorm the dropped positions get
//!   `mask_token` and every patch goes back to its place;
//! - `blocks.{i}`: pre-norm transformer blocks, `x + drop_path(attn(norm1(x)))` then
//!   `x + drop_path(mlp(norm2(x)))`; attention with `qkv` (no bias), 8 heads scaled by
//!   `head_dim^-0.5`, `proj` with bias; the MLP `fc1 → ReLU6 → fc2` at 4x width; stochastic
//!   depth rising linearly from 0 to `drop_path_rate` over the blocks;
//! - `norm` (LayerNorm, eps 1e-5), then `feature`: `Linear(144·D → D, no bias)`,
//!   `BatchNorm1d(D, eps 2e-5)`, `Linear(D → E, no bias)`, `BatchNorm1d(E, eps 2e-5)`.
//!
//! With `using_checkpoint` (arcface_torch's for `vit_b` and larger) the blocks' activations are
//! recomputed in backward instead of kept.
use std::sync::Mutex;

use candle_core::{DType, Tensor, Var};
use candle_nn::{Init, Module, ModuleT, VarBuilder};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tandem_nn::functional::{attention, encoder_block, fused_linear, layer_norm, EncoderBlock};
use tandem_nn::torch_init::standard_normal;
use tandem_nn::{
    fast_batch_norm2d, fast_linear, fast_linear_no_bias, FastBatchNorm2d, FastLinear, HasBatchNorm,
};

use crate::{UnitRunner, FACE_SIDE};

/// Patch side and patches per side on 112x112 inputs.
const PATCH: usize = 9;
const GRID: usize = FACE_SIDE / PATCH;
/// Patches per image (144).
pub const VIT_PATCHES: usize = GRID * GRID;
/// arcface_torch's LayerNorm and feature-head BatchNorm epsilons.
const LN_EPS: f64 = 1e-5;
const FEATURE_BN_EPS: f64 = 2e-5;
/// The ratio `random_masking` uses whenever masking is on (see the module docs).
const MASK_RATIO_USED: f64 = 0.1;

/// One of arcface_torch's ViT sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VitConfig {
    pub embed_dim: usize,
    pub depth: usize,
    pub num_heads: usize,
    /// The MLP's hidden width over `embed_dim`.
    pub mlp_ratio: usize,
    /// Stochastic depth of the last block (0 for the first, linear between).
    pub drop_path_rate: f64,
    /// Masking is on in training when above 0 (it then drops 10% of the patches).
    pub mask_ratio: f64,
    /// arcface_torch's `using_checkpoint`: in training each block's activations are recomputed
    /// in backward rather than kept (`tandem_nn::checkpoint`), so deep ViTs train in the memory
    /// of their block inputs. Needs tandem's backward (`Ddp::backward`, the trainer).
    pub using_checkpoint: bool,
    /// In training on CPU f32, each block is one autograd node
    /// (`tandem_nn::functional::encoder_block`: the same values, without candle's per-op
    /// gradient accumulators — ~12% of ViT-T's step), its checkpointed recomputation too.
    /// Needs tandem's backward, as `using_checkpoint` does; a block run as an FSDP unit is
    /// composed op by op.
    pub fused_blocks: bool,
}

impl VitConfig {
    /// `vit_t`: width 256, 12 blocks, 8 heads, drop path 0.1, masking on.
    pub const VIT_T: VitConfig = VitConfig::new(256, 12, 0.1, 0.1);
    /// `vit_s`: width 512, 12 blocks.
    pub const VIT_S: VitConfig = VitConfig::new(512, 12, 0.1, 0.1);
    /// `vit_b`: width 512, 24 blocks, activation checkpointing.
    pub const VIT_B: VitConfig = VitConfig::new(512, 24, 0.1, 0.1).checkpointed();
    /// `vit_l` (arcface_torch's `vit_l_dp005_mask_005`, its only large ViT): width 768, 24
    /// blocks, drop path 0.05, masking on, activation checkpointing.
    pub const VIT_L: VitConfig = VitConfig::new(768, 24, 0.05, 0.05).checkpointed();

    /// 8 heads and a 4x MLP, as every arcface_torch ViT.
    pub const fn new(embed_dim: usize, depth: usize, drop_path_rate: f64, mask_ratio: f64) -> Self {
        VitConfig {
            embed_dim,
            depth,
            num_heads: 8,
            mlp_ratio: 4,
            drop_path_rate,
            mask_ratio,
            using_checkpoint: false,
            fused_blocks: false,
        }
    }

    /// With activation checkpointing (arcface_torch's `using_checkpoint=True`).
    pub const fn checkpointed(self) -> Self {
        VitConfig { using_checkpoint: true, ..self }
    }

    /// With each block one autograd node in training (see [`VitConfig::fused_blocks`]).
    pub const fn fused(self) -> Self {
        VitConfig { fused_blocks: true, ..self }
    }
}

#[derive(Clone)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(dim: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(LayerNorm {
            weight: vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(dim, "bias", Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, LN_EPS)
    }
}

#[derive(Clone)]
struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: FastLinear,
    proj: FastLinear,
    fc1: FastLinear,
    fc2: FastLinear,
    num_heads: usize,
    /// This block's stochastic depth.
    drop_path: f64,
}

impl Block {
    /// Variables in arcface_torch's registration order (both norms, then attention, then MLP).
    fn new(cfg: &VitConfig, drop_path: f64, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.embed_dim;
        let norm1 = LayerNorm::new(d, vb.pp("norm1"))?;
        let norm2 = LayerNorm::new(d, vb.pp("norm2"))?;
        let attn = vb.pp("attn");
        let qkv = fast_linear_no_bias(d, 3 * d, attn.pp("qkv"))?;
        let proj = fast_linear(d, d, attn.pp("proj"))?;
        let mlp = vb.pp("mlp");
        let fc1 = fast_linear(d, d * cfg.mlp_ratio, mlp.pp("fc1"))?;
        let fc2 = fast_linear(d * cfg.mlp_ratio, d, mlp.pp("fc2"))?;
        Ok(Block { norm1, norm2, qkv, proj, fc1, fc2, num_heads: cfg.num_heads, drop_path })
    }

    /// Under autocast on a GPU the four linear layers compute in the 16-bit type and the
    /// residual stream stays f32 (PyTorch promotes `x + branch`), as in arcface_torch.
    fn forward(&self, x: &Tensor, masks: Option<&[Tensor; 2]>) -> candle_core::Result<Tensor> {
        let a = self.attention(&self.norm1.forward(x)?)?;
        let x = residual(x, &dropped(&a, masks.map(|m| &m[0]))?)?;
        let h = self.fc1.forward_relu6(&self.norm2.forward(&x)?)?;
        let m = self.fc2.forward(&h)?;
        residual(&x, &dropped(&m, masks.map(|m| &m[1]))?)
    }

    /// The forward as one autograd node when `fused` and the node applies (see
    /// [`VitConfig::fused_blocks`]), else op by op.
    fn forward_maybe_fused(
        &self,
        x: &Tensor,
        masks: Option<&[Tensor; 2]>,
        fused: bool,
    ) -> candle_core::Result<Tensor> {
        if fused {
            if let Some(y) = self.forward_fused(x, masks)? {
                return Ok(y);
            }
        }
        self.forward(x, masks)
    }

    /// [`Block::forward`] as one autograd node (`None` where it does not apply).
    fn forward_fused(
        &self,
        x: &Tensor,
        masks: Option<&[Tensor; 2]>,
    ) -> candle_core::Result<Option<Tensor>> {
        fn linear(l: &FastLinear) -> (&Tensor, Option<&Tensor>) {
            (l.weight(), l.bias())
        }
        let block = EncoderBlock {
            norm1: (&self.norm1.weight, &self.norm1.bias),
            qkv: linear(&self.qkv),
            proj: linear(&self.proj),
            norm2: (&self.norm2.weight, &self.norm2.bias),
            fc1: linear(&self.fc1),
            fc2: linear(&self.fc2),
            heads: self.num_heads,
            eps: LN_EPS,
        };
        encoder_block(x, &block, masks)
    }

    /// The block's variables.
    fn params(&self) -> Vec<Tensor> {
        let mut out = vec![self.norm1.weight.clone(), self.norm1.bias.clone()];
        out.extend([self.norm2.weight.clone(), self.norm2.bias.clone()]);
        for l in [&self.qkv, &self.proj, &self.fc1, &self.fc2] {
            out.push(l.weight().clone());
            out.extend(l.bias().cloned());
        }
        out
    }

    /// arcface_torch computes the products and softmax between `qkv` and `proj` in f32 (its
    /// `autocast(False)` block), whatever the projections' type.
    fn attention(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let qkv = self.qkv.forward(x)?.to_dtype(DType::F32)?;
        self.proj.forward(&attention(&qkv, self.num_heads)?)
    }
}

/// `x + branch` in the stream's type (the branch may come from a 16-bit layer under autocast).
fn residual(x: &Tensor, branch: &Tensor) -> candle_core::Result<Tensor> {
    x + branch.to_dtype(x.dtype())?
}

/// Stochastic depth over a forward: in training each sample's residual branch is kept with
/// probability `1 − p` (and then scaled by `1 / (1 − p)`), as timm's `DropPath`. The masks are
/// drawn before a block runs, so a checkpointed block recomputes with the same ones.
struct DropPath<'a> {
    rng: Option<&'a mut StdRng>,
}

impl DropPath<'_> {
    /// The two `[N, 1, 1]` masks (attention, MLP) of a block with rate `p`; `None` when off.
    fn masks(
        &mut self,
        n: usize,
        p: f64,
        device: &candle_core::Device,
    ) -> candle_core::Result<Option<[Tensor; 2]>> {
        let Some(rng) = self.rng.as_deref_mut() else { return Ok(None) };
        if p <= 0.0 {
            return Ok(None);
        }
        let keep = 1.0 - p;
        let mut draw = || -> candle_core::Result<Tensor> {
            let mask: Vec<f32> = (0..n)
                .map(|_| if rng.random::<f64>() < keep { (1.0 / keep) as f32 } else { 0.0 })
                .collect();
            Tensor::from_vec(mask, (n, 1, 1), device)
        };
        Ok(Some([draw()?, draw()?]))
    }
}

/// `branch · mask` (a sample's whole branch kept, scaled, or dropped).
fn dropped(branch: &Tensor, mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match mask {
        Some(m) => branch.broadcast_mul(&m.to_dtype(branch.dtype())?),
        None => Ok(branch.clone()),
    }
}

/// What follows the blocks: the final LayerNorm, the mask tokens and the feature head.
struct Head {
    norm: LayerNorm,
    mask_token: Tensor,
    feature_linear: FastLinear,
    feature_bn: FastBatchNorm2d,
    embed_linear: FastLinear,
    embed_bn: FastBatchNorm2d,
    embed_dim: usize,
    embedding: usize,
}

impl Head {
    /// The final LayerNorm, the mask tokens put back (`restore`, in training with masking) and
    /// the feature head.
    fn forward(
        &self,
        x: &Tensor,
        restore: Option<&Tensor>,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        let (n, d) = (x.dim(0)?, self.embed_dim);
        let x = self.norm.forward(&x.to_dtype(DType::F32)?)?;
        let x = match restore {
            Some(restore) => {
                let kept = x.dim(1)?;
                let tokens = self.mask_token.broadcast_as((n, VIT_PATCHES - kept, d))?;
                let all = Tensor::cat(&[&x, &tokens.contiguous()?], 1)?;
                all.reshape((n * VIT_PATCHES, d))?.index_select(restore, 0)?
            }
            None => x,
        };
        let x = self.feature_linear.forward(&x.reshape((n, VIT_PATCHES * d))?)?;
        let x = self.feature_bn.forward_t(&x.reshape((n, d, 1, 1))?, train)?.reshape((n, d))?;
        let x = self.embed_linear.forward(&x)?;
        let e = self.embedding;
        self.embed_bn.forward_t(&x.reshape((n, e, 1, 1))?, train)?.reshape((n, e))
    }
}

/// arcface_torch's VisionTransformer at any [`VitConfig`] (see the module docs).
pub struct Vit {
    cfg: VitConfig,
    pos_embed: Tensor,
    patch_weight: Tensor,
    patch_bias: Tensor,
    blocks: Vec<std::sync::Arc<Block>>,
    head: std::sync::Arc<Head>,
    /// Masks and stochastic depth in training.
    rng: Mutex<StdRng>,
    runner: Option<UnitRunner>,
}

impl Vit {
    /// The ViT of `cfg` with an `embedding`-wide output. candle initialises the variables; call
    /// [`Vit::reset_parameters`] for arcface_torch's initialisation from a seed.
    pub fn new(cfg: VitConfig, embedding: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.embed_dim;
        if d == 0
            || cfg.depth == 0
            || embedding == 0
            || cfg.num_heads == 0
            || !d.is_multiple_of(cfg.num_heads)
        {
            candle_core::bail!(
                "ViT needs width, depth, heads and embedding >= 1 and the width a multiple of the \
                 heads, got width {d}, depth {}, heads {}, embedding {embedding}",
                cfg.depth,
                cfg.num_heads
            )
        }
        // Registration order of arcface_torch's module: its own parameters, then children.
        let pos_embed = vb.get_with_hints((1, VIT_PATCHES, d), "pos_embed", Init::Const(0.0))?;
        let mask_token = vb.get_with_hints((1, 1, d), "mask_token", Init::Const(0.0))?;
        let proj = vb.pp("patch_embed").pp("proj");
        let bound = 1.0 / ((3 * PATCH * PATCH) as f64).sqrt();
        let uniform = Init::Uniform { lo: -bound, up: bound };
        let patch_weight = proj.get_with_hints((d, 3, PATCH, PATCH), "weight", uniform)?;
        let patch_bias = proj.get_with_hints(d, "bias", uniform)?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let rate = match cfg.depth {
                    1 => 0.0,
                    n => cfg.drop_path_rate * i as f64 / (n - 1) as f64,
                };
                Block::new(&cfg, rate, vb.pp("blocks").pp(i.to_string())).map(std::sync::Arc::new)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = LayerNorm::new(d, vb.pp("norm"))?;
        let feature = vb.pp("feature");
        let feature_linear = fast_linear_no_bias(d * VIT_PATCHES, d, feature.pp("0"))?;
        let feature_bn = fast_batch_norm2d(d, feature.pp("1"))?.with_eps(FEATURE_BN_EPS);
        let embed_linear = fast_linear_no_bias(d, embedding, feature.pp("2"))?;
        let embed_bn = fast_batch_norm2d(embedding, feature.pp("3"))?.with_eps(FEATURE_BN_EPS);
        let head = Head {
            norm,
            mask_token,
            feature_linear,
            feature_bn,
            embed_linear,
            embed_bn,
            embed_dim: d,
            embedding,
        };
        Ok(Vit {
            cfg,
            pos_embed,
            patch_weight,
            patch_bias,
            blocks,
            head: std::sync::Arc::new(head),
            rng: Mutex::new(StdRng::seed_from_u64(0)),
            runner: None,
        })
    }

    /// Runs every block and the head through `runner` (FSDP2's `fully_shard` per block), in
    /// place of the activation checkpointing of `using_checkpoint` (the runner's units
    /// recompute or not, as it is told).
    ///
    /// [`Vit::unit_of`] names each parameter's unit (tandem-fsdp's `Units::by_name`).
    pub fn run_blocks_with(&mut self, runner: UnitRunner) {
        self.runner = Some(runner);
    }

    /// The unit of parameter `param` when the model runs through a [`UnitRunner`]:
    /// `blocks.{i}` for a block's, `head` for the final norm's, the mask token's and the feature
    /// head's, `None` (the root) for the patch embedding's and the position embedding's.
    pub fn unit_of(param: &str) -> Option<String> {
        if let Some(rest) = param.strip_prefix("blocks.") {
            return rest.split('.').next().map(|i| format!("blocks.{i}"));
        }
        let head =
            param == "mask_token" || param.starts_with("norm.") || param.starts_with("feature.");
        head.then(|| "head".to_string())
    }

    /// The embedding width.
    pub fn embedding(&self) -> usize {
        self.head.embedding
    }

    pub fn config(&self) -> VitConfig {
        self.cfg
    }

    /// Seeds the masks and stochastic depth of later training forwards (give each rank its
    /// own seed, as each draws for its own batch).
    pub fn seed(&self, seed: u64) {
        *self.rng.lock().unwrap_or_else(|p| p.into_inner()) = StdRng::seed_from_u64(seed);
    }

    /// arcface_torch's initialisation, seeded (our stream, not torch's): Linear weights and
    /// `pos_embed` normal with std 0.02 (timm's `trunc_normal_` cuts at ±2, 100 std away),
    /// `mask_token` normal std 0.02, Linear biases 0, LayerNorm and BatchNorm weight 1 and bias
    /// 0; the patch convolution keeps PyTorch's default (uniform within `1/sqrt(fan_in)`).
    pub fn reset_parameters(named: &[(String, Var)], seed: u64) -> candle_core::Result<()> {
        crate::face::set_initial_values(named, seed, Vit::initial_values)
    }

    /// The values [`Vit::reset_parameters`] gives the variable `name` of shape `dims`, drawn
    /// from `rng` (`None`: it keeps its builder's).
    pub(crate) fn initial_values(name: &str, dims: &[usize], rng: &mut StdRng) -> Option<Vec<f32>> {
        let n = dims.iter().product();
        let last = name.rsplit('.').next().unwrap_or("");
        Some(if name.starts_with("patch_embed.") {
            let bound = 1.0 / ((3 * PATCH * PATCH) as f32).sqrt();
            (0..n).map(|_| rng.random_range(-bound..=bound)).collect()
        } else if name == "pos_embed" || name == "mask_token" || last == "weight" && dims.len() == 2
        {
            (0..n).map(|_| (standard_normal(rng) * 0.02) as f32).collect()
        } else {
            return crate::face::norm_default(last, n);
        })
    }

    /// Embeddings `[N, E]` for `x: [N, 3, 112, 112]` (or `[N, 3 * 112 * 112]`, reshaped); in
    /// training with this model's masks and stochastic depth.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        if !train {
            return self.forward_inner(x, false, None, None);
        }
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        let noise = if self.cfg.mask_ratio > 0.0 {
            let n = x.dim(0)?;
            let v: Vec<f32> = (0..n * VIT_PATCHES).map(|_| rng.random::<f32>()).collect();
            Some(Tensor::from_vec(v, (n, VIT_PATCHES), &candle_core::Device::Cpu)?)
        } else {
            None
        };
        self.forward_inner(x, true, noise.as_ref(), Some(&mut rng))
    }

    /// A training forward whose patch mask comes from `noise: [N, 144]` as arcface_torch's
    /// `random_masking` draws it with `torch.rand` (the 129 lowest of each sample are kept), and
    /// without stochastic depth: to reproduce a PyTorch run exactly.
    pub fn forward_masked(&self, x: &Tensor, noise: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_inner(x, true, Some(noise), None)
    }

    fn forward_inner(
        &self,
        x: &Tensor,
        train: bool,
        noise: Option<&Tensor>,
        drop_rng: Option<&mut StdRng>,
    ) -> candle_core::Result<Tensor> {
        let x = if x.rank() == 2 {
            x.reshape((x.dim(0)?, 3, FACE_SIDE, FACE_SIDE))?
        } else {
            x.clone()
        };
        if x.dims()[1..] != [3, FACE_SIDE, FACE_SIDE] {
            candle_core::bail!("ViT takes [N, 3, 112, 112] images, got {:?}", x.dims())
        }
        let (n, d) = (x.dim(0)?, self.cfg.embed_dim);
        let x = self.patch_embed(&x)?.broadcast_add(&self.pos_embed)?;
        let order = noise.map(|noise| shuffle_order(noise, n, x.device())).transpose()?;
        let mut x = match &order {
            Some((keep, _)) => {
                let kept = keep.dim(0)? / n;
                x.reshape((n * VIT_PATCHES, d))?.index_select(keep, 0)?.reshape((n, kept, d))?
            }
            None => x,
        };
        let mut drop = DropPath { rng: drop_rng };
        for (i, block) in self.blocks.iter().enumerate() {
            let masks = drop.masks(n, block.drop_path, x.device())?;
            x = tandem_nn::cut_graph(x);
            x = if let Some(run) = &self.runner {
                let (b, m) = (std::sync::Arc::clone(block), masks.clone());
                run(
                    &format!("blocks.{i}"),
                    &x,
                    std::sync::Arc::new(move |x| b.forward(x, m.as_ref())),
                )?
            } else if train && self.cfg.using_checkpoint {
                // arcface_torch's using_checkpoint: the block's activations are recomputed in
                // backward (with the same masks) instead of kept.
                // The recomputation runs inside tandem's backward, so a fused block's
                // parameter gradients reach the store from there too.
                let (b, m, fused) =
                    (std::sync::Arc::clone(block), masks.clone(), self.cfg.fused_blocks);
                let f: tandem_nn::CheckpointFn =
                    std::sync::Arc::new(move |x| b.forward_maybe_fused(x, m.as_ref(), fused));
                tandem_nn::checkpoint(&x, f, block.params())?
            } else {
                // (Evaluation composes the block: a node would keep its activations for nothing.)
                block.forward_maybe_fused(&x, masks.as_ref(), train && self.cfg.fused_blocks)?
            };
        }
        // arcface_torch leaves autocast here: the final norm and the feature head run in f32.
        let (head, restore) = (std::sync::Arc::clone(&self.head), order.map(|o| o.1));
        let f: tandem_nn::CheckpointFn = std::sync::Arc::new(move |x| {
            tandem_nn::autocast(None, || head.forward(x, restore.as_ref(), train))
        });
        match &self.runner {
            Some(run) => run("head", &x, f),
            None => f(&x),
        }
    }

    fn patch_embed(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        patch_embed(x, &self.patch_weight, &self.patch_bias)
    }
}

/// arcface_torch's `patch_embed.proj` (a 9x9 stride-9 convolution `3 → D` with bias) of
/// `x: [N, 3, 112, 112]` as [`Vit`] computes it: stride = kernel, so each output is one
/// patch's 243 values against the flattened kernel — one product. `[N, 144, D]` (the
/// convolution's `[N, D, 12, 12]` flattened and transposed, as `PatchEmbed` hands it on).
pub fn patch_embed(x: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.dim(0)?;
    let side = GRID * PATCH;
    let patches = x
        .narrow(2, 0, side)?
        .narrow(3, 0, side)?
        .reshape((n, 3, GRID, PATCH, GRID, PATCH))?
        .permute((0, 2, 4, 1, 3, 5))?
        .reshape((n, VIT_PATCHES, 3 * PATCH * PATCH))?;
    let w = weight.reshape((weight.dim(0)?, 3 * PATCH * PATCH))?;
    fused_linear(&patches, &w, Some(bias))
}

/// From `noise: [N, 144]`: the rows of the flattened `[N·144, D]` tokens the blocks see (each
/// sample's 129 lowest-noise patches, lowest first), and for every patch the row of the
/// blocks' output, followed per sample by its mask tokens, that goes back to its place.
fn shuffle_order(
    noise: &Tensor,
    n: usize,
    device: &candle_core::Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    if noise.dims() != [n, VIT_PATCHES] {
        candle_core::bail!("ViT masking noise must be [{n}, {VIT_PATCHES}], got {:?}", noise.dims())
    }
    let noise = noise.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let kept = (VIT_PATCHES as f64 * (1.0 - MASK_RATIO_USED)) as usize;
    let (mut keep, mut restore) = (Vec::with_capacity(n * kept), vec![0u32; n * VIT_PATCHES]);
    for (s, row) in noise.iter().enumerate() {
        let mut order: Vec<usize> = (0..VIT_PATCHES).collect();
        order.sort_by(|&a, &b| row[a].total_cmp(&row[b]));
        for (rank, &patch) in order.iter().enumerate() {
            if rank < kept {
                keep.push((s * VIT_PATCHES + patch) as u32);
            }
            // Sample s's kept tokens, then its mask tokens, fill rows s·144 .. s·144 + 143.
            restore[s * VIT_PATCHES + patch] = (s * VIT_PATCHES + rank) as u32;
        }
    }
    Ok((
        Tensor::from_vec(keep, n * kept, device)?,
        Tensor::from_vec(restore, n * VIT_PATCHES, device)?,
    ))
}

impl ModuleT for Vit {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        Vit::forward_t(self, x, train)
    }
}

impl HasBatchNorm for Vit {
    /// None: the feature head's two BatchNorm1d stay per rank, as IResNet's embedding one.
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d> {
        Vec::new()
    }
}
