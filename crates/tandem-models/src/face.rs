//! [`FaceBackbone`]: the face-recognition backbone a [`ModelKind`] names (IResNet,
//! MobileFaceNet or ViT), built, initialised and run through one type, so the face recipe, evaluation
//! and export need not know which.
use candle_core::{Tensor, Var};
use candle_nn::{ModuleT, VarBuilder};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tandem_nn::{FastBatchNorm2d, HasBatchNorm};

use crate::{IResNet, MobileFaceNet, ModelKind, UnitRunner, Vit};

pub enum FaceBackbone {
    IResNet(IResNet),
    MobileFaceNet(MobileFaceNet),
    /// Boxed: a ViT's blocks make it the largest by far.
    Vit(Box<Vit>),
}

impl FaceBackbone {
    /// The backbone `kind` names with an `embedding`-wide output; `width` is an IResNet's stage
    /// width (MobileFaceNet's widths are fixed by its scale), `dropout` an IResNet's before `fc`.
    pub fn new(
        kind: ModelKind,
        width: usize,
        embedding: usize,
        dropout: f32,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        if let Some(depth) = kind.iresnet_depth() {
            return Ok(FaceBackbone::IResNet(IResNet::new(depth, width, embedding, dropout, vb)?));
        }
        if let Some((blocks, scale)) = kind.mobilefacenet() {
            return Ok(FaceBackbone::MobileFaceNet(MobileFaceNet::new(
                blocks, scale, embedding, vb,
            )?));
        }
        if let Some(cfg) = kind.vit() {
            return Ok(FaceBackbone::Vit(Box::new(Vit::new(cfg, embedding, vb)?)));
        }
        candle_core::bail!("`{kind}` is not a face backbone")
    }

    /// arcface_torch's initialisation of `kind` from `seed` (see each model's
    /// `reset_parameters`).
    pub fn reset_parameters(
        kind: ModelKind,
        named: &[(String, Var)],
        seed: u64,
    ) -> candle_core::Result<()> {
        if kind.mobilefacenet().is_some() {
            MobileFaceNet::reset_parameters(named, seed)
        } else if kind.vit().is_some() {
            Vit::reset_parameters(named, seed)
        } else {
            IResNet::reset_parameters(named, seed)
        }
    }

    /// Parameters of `kind` that never train (IResNet's `features.weight`).
    pub fn frozen(kind: ModelKind) -> &'static [&'static str] {
        if kind.iresnet_depth().is_some() {
            IResNet::FROZEN
        } else {
            &[]
        }
    }

    /// Seeds what a training forward draws (a ViT's patch masks and stochastic depth; the
    /// convolutional backbones draw nothing, IResNet's dropout aside). Give each rank its own.
    pub fn seed(&self, seed: u64) {
        if let FaceBackbone::Vit(m) = self {
            m.seed(seed);
        }
    }

    /// Runs the backbone's blocks through `runner` (FSDP2's `fully_shard` per block: a ViT's
    /// blocks and head, an IResNet's residual blocks); false for a MobileFaceNet, which has no
    /// such units (shard it as one root).
    pub fn run_blocks_with(&mut self, runner: UnitRunner) -> bool {
        match self {
            FaceBackbone::IResNet(m) => m.run_blocks_with(runner),
            FaceBackbone::Vit(m) => m.run_blocks_with(runner),
            FaceBackbone::MobileFaceNet(_) => return false,
        }
        true
    }

    /// The unit of parameter `param` of a `kind` backbone running its blocks through a
    /// [`UnitRunner`] (`None`: the root's).
    pub fn unit_of(kind: ModelKind, param: &str) -> Option<String> {
        if kind.vit().is_some() {
            Vit::unit_of(param)
        } else if kind.iresnet_depth().is_some() {
            IResNet::unit_of(param)
        } else {
            None
        }
    }

    /// Embeddings `[N, E]` for `x: [N, 3, 112, 112]`.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        match self {
            FaceBackbone::IResNet(m) => m.forward_t(x, train),
            FaceBackbone::MobileFaceNet(m) => m.forward_t(x, train),
            FaceBackbone::Vit(m) => m.forward_t(x, train),
        }
    }

    /// The embedding width.
    pub fn embedding(&self) -> usize {
        match self {
            FaceBackbone::IResNet(m) => m.embedding(),
            FaceBackbone::MobileFaceNet(m) => m.embedding(),
            FaceBackbone::Vit(m) => m.embedding(),
        }
    }
}

impl ModuleT for FaceBackbone {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        FaceBackbone::forward_t(self, x, train)
    }
}

impl HasBatchNorm for FaceBackbone {
    fn batch_norms(&self) -> Vec<&FastBatchNorm2d> {
        match self {
            FaceBackbone::IResNet(m) => m.batch_norms(),
            FaceBackbone::MobileFaceNet(m) => m.batch_norms(),
            FaceBackbone::Vit(m) => m.batch_norms(),
        }
    }
}

/// arcface_torch's initialisation of a face backbone one variable at a time — the values
/// [`FaceBackbone::reset_parameters`] sets, for a model built without values (FSDP's meta
/// init): [`SeededInit::values`] gives one variable's values whole from one seeded stream, so
/// it must be asked in the variables' creation order (buffers and constants draw nothing and
/// may be asked for at any point, or not at all). A sharded build keeps its rows of each and
/// drops the rest, so no rank holds the model.
pub struct SeededInit {
    kind: ModelKind,
    rng: StdRng,
    fc_bound: f32,
}

impl SeededInit {
    /// The stream of `kind` from `seed`; `shapes` are the model's variables (IResNet's `fc`
    /// bound is read from them).
    pub fn new(kind: ModelKind, shapes: &[(&str, &[usize])], seed: u64) -> SeededInit {
        let fc_bound = IResNet::fc_bound(shapes.iter().copied());
        SeededInit { kind, rng: StdRng::seed_from_u64(seed), fc_bound }
    }

    /// The values of variable `name` of shape `dims`, or `None` where the model keeps its
    /// builder's.
    pub fn values(&mut self, name: &str, dims: &[usize]) -> Option<Vec<f32>> {
        let rng = &mut self.rng;
        if self.kind.mobilefacenet().is_some() {
            MobileFaceNet::initial_values(name, dims, rng)
        } else if self.kind.vit().is_some() {
            Vit::initial_values(name, dims, rng)
        } else {
            IResNet::initial_values(name, dims, rng, self.fc_bound)
        }
    }
}

/// A normalisation's defaults by a variable's last name component: weights and running
/// variances 1, biases and running means 0 (`None` for any other name).
pub(crate) fn norm_default(last: &str, n: usize) -> Option<Vec<f32>> {
    match last {
        "weight" | "running_var" => Some(vec![1.0; n]),
        "bias" | "running_mean" => Some(vec![0.0; n]),
        _ => None,
    }
}

/// Sets each of `named` (in order: one stream from `seed`) to what `values` gives it.
pub(crate) fn set_initial_values(
    named: &[(String, Var)],
    seed: u64,
    mut values: impl FnMut(&str, &[usize], &mut StdRng) -> Option<Vec<f32>>,
) -> candle_core::Result<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    for (name, var) in named {
        if let Some(v) = values(name, var.dims(), &mut rng) {
            var.set(&Tensor::from_vec(v, var.dims(), var.device())?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use tandem_nn::{is_buffer, OrderedVarMap};

    /// Every kind of backbone, at a small width.
    const KINDS: [(&str, usize); 3] = [("r18", 8), ("mbf", 0), ("vit_t", 0)];

    /// Backbone `kind` with a 16-wide embedding and arcface_torch's init from seed 5, and its
    /// variables in creation order.
    fn seeded(kind: &str, width: usize) -> (ModelKind, FaceBackbone, Vec<(String, Var)>) {
        let kind: ModelKind = kind.parse().unwrap();
        let vars = OrderedVarMap::new();
        let vb = vars.var_builder(DType::F32, &Device::Cpu);
        let model = FaceBackbone::new(kind, width, 16, 0.0, vb).unwrap();
        let named = vars.named();
        FaceBackbone::reset_parameters(kind, &named, 5).unwrap();
        (kind, model, named)
    }

    /// A sharded build asks [`SeededInit`] for the trained parameters in creation order, then
    /// the frozen ones, never the buffers: it must give what `reset_parameters` sets, bit for
    /// bit, for every kind of backbone.
    #[test]
    fn seeded_init_gives_reset_parameters_values_in_a_sharded_builds_order() {
        for (kind, width) in KINDS {
            let (kind, _, named) = seeded(kind, width);
            let shapes: Vec<(&str, &[usize])> =
                named.iter().map(|(n, v)| (n.as_str(), v.dims())).collect();
            let mut init = SeededInit::new(kind, &shapes, 5);
            let frozen = FaceBackbone::frozen(kind);
            let (trained, rest): (Vec<_>, Vec<_>) = named
                .iter()
                .filter(|(n, _)| !is_buffer(n))
                .partition(|(n, _)| !frozen.contains(&n.as_str()));
            let mut asked = 0;
            for (name, var) in trained.into_iter().chain(rest) {
                let want = var.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let got = init.values(name, var.dims());
                let got = got.unwrap_or_else(|| panic!("{kind}: `{name}` has no initial value"));
                assert!(want == got, "{kind}: `{name}` differs from reset_parameters'");
                asked += 1;
            }
            assert!(asked > 20, "{kind}: only {asked} parameters");
        }
    }

    /// An evaluation under `tandem_nn::no_grad` computes the same bits, and keeps no graph
    /// back past the last block: the stem's parameters are out of reach of its result (each
    /// block's activations were freed as the next block began), as they are not without it.
    #[test]
    fn no_grad_cuts_the_graph_between_blocks_and_keeps_the_values() {
        for (kind, width) in KINDS {
            let (kind, model, named) = seeded(kind, width);
            let x = Tensor::randn(0f32, 1., (2, 3, 112, 112), &Device::Cpu).unwrap();
            let reached = |y: &Tensor| -> Vec<String> {
                let grads = y.sum_all().unwrap().backward().unwrap();
                let reached = named.iter().filter(|(_, v)| grads.get(v.as_tensor()).is_some());
                reached.map(|(n, _)| n.clone()).collect()
            };
            let whole = model.forward_t(&x, false).unwrap();
            let cut = tandem_nn::no_grad(|| model.forward_t(&x, false)).unwrap();
            let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(values(&whole) == values(&cut), "{kind}: no_grad changed the embeddings");
            let (all, after_cut) = (reached(&whole), reached(&cut));
            let stem = &named.iter().find(|(n, _)| !is_buffer(n)).unwrap().0;
            assert!(all.contains(stem), "{kind}: `{stem}` unreached by a plain forward");
            assert!(!after_cut.contains(stem), "{kind}: `{stem}` still reached under no_grad");
            assert!(
                !after_cut.is_empty() && after_cut.len() * 2 < all.len(),
                "{kind}: {after_cut:?}"
            );
        }
    }
}
