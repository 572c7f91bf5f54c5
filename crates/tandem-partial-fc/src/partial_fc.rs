//! The PartialFC head (see the crate docs): configuration, the rank-local centres and one
//! forward step from this rank's embeddings and labels to the loss of the global batch.
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;
use rand_distr::Distribution;
use tandem_comm::Collectives;
use tandem_dist_nn::{all_gather, GatherGrad};

use crate::cross_entropy::dist_cross_entropy;
use crate::error::PartialFcError;
use crate::margin::CombinedMarginLoss;
use crate::sample::{self, DrawAhead, SampleRequest, Sampler};
use crate::split::ClassSplit;

mod state;
pub use state::SHARD_FORMAT;

/// How a [`PartialFc`] is built.
#[derive(Clone, Debug)]
pub struct PartialFcConfig {
    pub num_classes: usize,
    pub embedding_size: usize,
    pub margin: CombinedMarginLoss,
    /// Fraction of each rank's centres that take part in a step, positives always included
    /// (arcface_torch's `sample_rate`; 1.0 = all of them, 0 = the batch's positive classes
    /// only, as its `wf42m_pfc0008` configs train).
    pub sample_rate: f64,
    /// The gradient the gathered embeddings send back: arcface_torch's `SumTimesWorld` (the
    /// default) makes Ddp's averaging of the backbone's gradients yield their sum.
    pub gather_grad: GatherGrad,
    /// The dtype of the head's matmul under autocast (`BF16`/`F16`); logits go back to f32
    /// before the clamp and the margin. `None`: f32 throughout.
    pub autocast: Option<DType>,
    /// Seeds the initial centres (N(0, 0.01), one draw per class whatever the world size) and
    /// the negative sampling.
    pub seed: u64,
    /// At `sample_rate < 1`, give the sampled rows a leaf of their own ([`PartialFc::grad_leaf`])
    /// so that backward yields their gradient alone (`[sampled, E]`), never the dense
    /// `[rows, E]` one that is zero off the sample: the optimizer steps the head from it with
    /// `TorchOptimizer::set_grad_rows` (the same update, without the dense gradient's memory
    /// and passes). Off by default: [`PartialFc::weight`]'s gradient is then the dense one.
    pub sparse_grad: bool,
}

impl PartialFcConfig {
    pub fn new(num_classes: usize, embedding_size: usize, margin: CombinedMarginLoss) -> Self {
        PartialFcConfig {
            num_classes,
            embedding_size,
            margin,
            sample_rate: 1.0,
            gather_grad: GatherGrad::SumTimesWorld,
            autocast: None,
            seed: 0,
            sparse_grad: false,
        }
    }

    fn check(&self) -> Result<(), PartialFcError> {
        let bad = |why: String| Err(PartialFcError::Config(why));
        if self.num_classes == 0 || self.embedding_size == 0 {
            return bad(format!(
                "num_classes {} and embedding_size {} must be positive",
                self.num_classes, self.embedding_size
            ));
        }
        if !(0.0..=1.0).contains(&self.sample_rate) {
            return bad(format!("sample_rate {} must be in [0, 1]", self.sample_rate));
        }
        if let Some(dt) = self.autocast {
            if !matches!(dt, DType::BF16 | DType::F16) {
                return bad(format!("autocast dtype {dt:?}: use bf16 or f16"));
            }
        }
        Ok(())
    }
}

/// The model-parallel classification head. Holds this rank's centres as a [`Var`] (give it to
/// the optimizer as its own parameter group; never to `Ddp`).
pub struct PartialFc {
    cfg: PartialFcConfig,
    split: ClassSplit,
    weight: Var,
    comm: Arc<dyn Collectives>,
    sampler: Box<dyn Sampler>,
    last_index: Option<Vec<usize>>,
    /// With `sparse_grad`, the last step's sampled rows as a leaf of their own.
    sampled: Option<Var>,
    step: u64,
}

impl std::fmt::Debug for PartialFc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartialFc").field("cfg", &self.cfg).field("split", &self.split).finish()
    }
}

/// Row `class` of the initial centres: N(0, 0.01) drawn from `(seed, class)`, so the matrix is
/// the same for every world size.
fn initial_row(seed: u64, class: usize, e: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (class as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93),
    );
    let normal = rand_distr::Normal::new(0.0f32, 0.01).expect("a valid standard deviation");
    (0..e).map(|_| normal.sample(&mut rng)).collect()
}

impl PartialFc {
    /// This rank's share of `cfg.num_classes` centres, initialised N(0, 0.01) from `cfg.seed`.
    pub fn new(
        cfg: PartialFcConfig,
        comm: Arc<dyn Collectives>,
        device: &Device,
    ) -> Result<Self, PartialFcError> {
        let seed = cfg.seed;
        Self::with_rows(cfg, comm, device, |split, e| {
            let mut rows = Vec::with_capacity(split.len * e);
            for c in split.start..split.start + split.len {
                rows.extend(initial_row(seed, c, e));
            }
            rows
        })
    }

    /// This rank's share of the centres, all zero: for a head whose rows arrive before its
    /// first step (a live replacement receives them when it joins), without drawing the
    /// initial centres it would throw away.
    pub fn zeroed(
        cfg: PartialFcConfig,
        comm: Arc<dyn Collectives>,
        device: &Device,
    ) -> Result<Self, PartialFcError> {
        Self::with_rows(cfg, comm, device, |split, e| vec![0.0; split.len * e])
    }

    /// This rank's share with the rows `rows(split, embedding_size)` gives, row-major.
    fn with_rows(
        cfg: PartialFcConfig,
        comm: Arc<dyn Collectives>,
        device: &Device,
        rows: impl FnOnce(&ClassSplit, usize) -> Vec<f32>,
    ) -> Result<Self, PartialFcError> {
        cfg.check()?;
        let split = ClassSplit::new(cfg.num_classes, comm.size(), comm.rank());
        let e = cfg.embedding_size;
        let rows = rows(&split, e);
        let weight = Var::from_tensor(&Tensor::from_vec(rows, (split.len, e), device)?)?;
        Ok(Self::with_weight(cfg, comm, split, weight))
    }

    /// This rank's rows of the full `[num_classes, embedding_size]` matrix `full` (e.g. loaded
    /// from a checkpoint written on another world size).
    pub fn from_full_weight(
        cfg: PartialFcConfig,
        comm: Arc<dyn Collectives>,
        full: &Tensor,
    ) -> Result<Self, PartialFcError> {
        cfg.check()?;
        let dims = full.dims();
        if dims != [cfg.num_classes, cfg.embedding_size] {
            return Err(PartialFcError::Config(format!(
                "the full weight has shape {dims:?}, expected [{}, {}] (num_classes, embedding_size)",
                cfg.num_classes, cfg.embedding_size
            )));
        }
        let split = ClassSplit::new(cfg.num_classes, comm.size(), comm.rank());
        let rows = full.narrow(0, split.start, split.len)?.to_dtype(DType::F32)?.contiguous()?;
        let weight = Var::from_tensor(&rows.copy()?)?;
        Ok(Self::with_weight(cfg, comm, split, weight))
    }

    fn with_weight(
        cfg: PartialFcConfig,
        comm: Arc<dyn Collectives>,
        split: ClassSplit,
        weight: Var,
    ) -> Self {
        let sampler = Box::new(DrawAhead::new(cfg.seed));
        PartialFc { cfg, split, weight, comm, sampler, last_index: None, sampled: None, step: 0 }
    }

    /// After the head's collectives re-formed over another world (a live regroup): takes this
    /// rank's new class range from the world's size and this rank's place in it, and `rows`
    /// (`[len, embedding_size]`, the centres of that range) as its weight. Returns the new weight
    /// `Var` (a new identity when the range's length changed: give it to the optimizer in place
    /// of the old one).
    pub fn regroup(&mut self, rows: &Tensor) -> Result<Var, PartialFcError> {
        let split = ClassSplit::new(self.cfg.num_classes, self.comm.size(), self.comm.rank());
        let want = [split.len, self.cfg.embedding_size];
        if rows.dims() != want {
            return Err(PartialFcError::State(format!(
                "rank {}: regrouped rows of shape {:?}, expected {want:?} (classes {}..{})",
                self.comm.rank(),
                rows.dims(),
                split.start,
                split.start + split.len
            )));
        }
        let rows = rows.to_device(self.weight.device())?.to_dtype(self.weight.dtype())?;
        if rows.dims() == self.weight.dims() {
            self.weight.set(&rows.contiguous()?.copy()?)?;
        } else {
            self.weight = Var::from_tensor(&rows.contiguous()?.copy()?)?;
        }
        self.split = split;
        self.last_index = None;
        self.sampled = None;
        Ok(self.weight.clone())
    }

    /// The initial centres (N(0, 0.01) from the seed) of global classes `classes`, row-major:
    /// what [`PartialFc::new`] starts those rows with on any world size.
    pub fn initial_centres(&self, classes: std::ops::Range<usize>) -> Vec<f32> {
        let e = self.cfg.embedding_size;
        classes.flat_map(|c| initial_row(self.cfg.seed, c, e)).collect()
    }

    /// Replaces the negative sampler (for example to replay a recorded choice).
    pub fn with_sampler(mut self, sampler: impl Sampler + 'static) -> Self {
        self.sampler = Box::new(sampler);
        self
    }

    /// This rank's centres, `[split().len, embedding_size]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The variable whose gradient the head's update needs after the last forward: the
    /// sampled rows' own leaf with `sparse_grad` at `sample_rate < 1` (its gradient holds the
    /// rows of [`PartialFc::grad_rows`]), else the weight.
    pub fn grad_leaf(&self) -> Var {
        self.sampled.clone().unwrap_or_else(|| self.weight.clone())
    }

    /// The weight rows [`PartialFc::grad_leaf`]'s gradient holds (ascending), when it is the
    /// sampled rows' own leaf; `None` when it is the weight itself.
    pub fn grad_rows(&self) -> Option<Vec<u32>> {
        self.sampled.as_ref()?;
        Some(self.last_index.as_ref()?.iter().map(|&i| i as u32).collect())
    }

    pub fn split(&self) -> ClassSplit {
        self.split
    }

    pub fn config(&self) -> &PartialFcConfig {
        &self.cfg
    }

    /// Forward passes taken so far (they seed each step's negative sampling).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// Sets the count of forward passes taken, so that a run resumed from a checkpoint draws
    /// the same negatives at `sample_rate < 1` as the uninterrupted run.
    pub fn set_steps_taken(&mut self, steps: u64) {
        self.step = steps;
    }

    /// The centres that took part in the last step (local indices, sorted); `None` before the
    /// first step. At `sample_rate < 1` only these rows got a gradient.
    pub fn last_index(&self) -> Option<&[usize]> {
        self.last_index.as_deref()
    }

    /// The loss of the global batch from this rank's `embeddings` `[B, E]` and `labels` (global
    /// classes, `B` of them). A collective: every rank calls it each step with the same `B`.
    /// Bad input on any rank — another embedding size or batch size, a label outside
    /// `0..num_classes` — is an error on every rank naming the rank and the value.
    pub fn forward(
        &mut self,
        embeddings: &Tensor,
        labels: &[i64],
    ) -> Result<Tensor, PartialFcError> {
        let rank = self.comm.rank();
        let global = self.gather_labels(embeddings, labels)?;
        let gathered =
            all_gather(embeddings, &self.comm, self.cfg.gather_grad, "PartialFc embeddings")?;
        let mut local: Vec<i64> =
            global.iter().map(|&l| self.split.local(l).map_or(-1, |c| c as i64)).collect();
        let num_sample = (self.cfg.sample_rate * self.split.len as f64) as usize;
        let index = if self.cfg.sample_rate < 1.0 {
            let mut positives: Vec<usize> =
                local.iter().filter_map(|&l| usize::try_from(l).ok()).collect();
            positives.sort_unstable();
            positives.dedup();
            let index = if num_sample >= positives.len() {
                let req = SampleRequest {
                    rank,
                    step: self.step,
                    num_local: self.split.len,
                    num_sample,
                    positives: &positives,
                };
                let index = self.sampler.sample(&req);
                sample::check(&index, &req).map_err(|what| PartialFcError::Batch { rank, what })?;
                index
            } else {
                positives
            };
            for l in local.iter_mut().filter(|l| **l >= 0) {
                *l = index.binary_search(&(*l as usize)).map_or(-1, |i| i as i64);
            }
            index
        } else {
            (0..self.split.len).collect()
        };
        self.sampled = None;
        let active = if index.len() == self.split.len {
            self.weight.as_tensor().clone()
        } else {
            let ids: Vec<u32> = index.iter().map(|&i| i as u32).collect();
            if self.cfg.sparse_grad {
                // A leaf of its own: backward stops here instead of scattering into the shard.
                let leaf = sampled_leaf(self.weight.as_tensor(), &ids)?;
                self.sampled = Some(leaf.clone());
                leaf.as_tensor().clone()
            } else {
                let ids = Tensor::from_vec(ids, index.len(), self.weight.device())?;
                self.weight.as_tensor().index_select(&ids, 0)?
            }
        };
        let (ne, nw) = (normalize(&gathered)?, normalize(&active.to_device(gathered.device())?)?);
        let logits = match self.cfg.autocast {
            Some(dt) => ne.to_dtype(dt)?.matmul(&nw.to_dtype(dt)?.t()?)?.to_dtype(DType::F32)?,
            None => ne.matmul(&nw.t()?)?,
        };
        let logits = logits.clamp(-1f32, 1f32)?;
        let logits = self.cfg.margin.forward(&logits, &local)?;
        let loss = dist_cross_entropy(&logits, &local, &self.comm)?;
        self.last_index = Some(index);
        self.step += 1;
        Ok(loss)
    }

    /// Gathers every rank's batch size, embedding size and labels, and checks them all on every
    /// rank (so that every rank fails together, naming the culprit, instead of some waiting in
    /// the next collective). Returns the labels of the global batch in rank order.
    fn gather_labels(
        &self,
        embeddings: &Tensor,
        labels: &[i64],
    ) -> Result<Vec<i64>, PartialFcError> {
        let rank = self.comm.rank();
        let dims = embeddings.dims().to_vec();
        let mut msg: Vec<i64> = vec![dims.len() as i64];
        msg.extend(dims.iter().map(|&d| d as i64));
        msg.push(labels.len() as i64);
        msg.extend_from_slice(labels);
        let all = self.comm.all_gather_bytes(bytemuck::cast_slice(&msg)).map_err(|e| {
            PartialFcError::Comm { rank, op: "all_gather of labels", reason: e.to_string() }
        })?;
        let mut batch = None;
        let mut global = Vec::new();
        for (r, bytes) in all.iter().enumerate() {
            let words: Vec<i64> = bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            let bad = |what: String| PartialFcError::Batch { rank: r, what };
            let malformed = || bad("sent a malformed message".into());
            // [number of dims, dims..., number of labels, labels...], lengths checked before use.
            let (&nd, rest) = words.split_first().ok_or_else(malformed)?;
            let nd = usize::try_from(nd).map_err(|_| malformed())?;
            let (their_dims, rest) =
                (rest.get(..nd).ok_or_else(malformed)?, &rest[nd.min(rest.len())..]);
            let (&n_labels, rest) = rest.split_first().ok_or_else(malformed)?;
            let n_labels = usize::try_from(n_labels).map_err(|_| malformed())?;
            let their_labels = rest.get(..n_labels).ok_or_else(malformed)?;
            let [b, e] = their_dims else {
                return Err(bad(format!(
                    "embeddings have shape {their_dims:?}, expected [batch, {}]",
                    self.cfg.embedding_size
                )));
            };
            if *e as usize != self.cfg.embedding_size {
                return Err(bad(format!(
                    "embeddings have size {e}, expected {}",
                    self.cfg.embedding_size
                )));
            }
            if *b == 0 {
                return Err(
                    bad("has an empty batch (every rank needs the same batch size)".into()),
                );
            }
            if n_labels != *b as usize {
                return Err(bad(format!("has {n_labels} labels for a batch of {b}")));
            }
            match batch {
                None => batch = Some((*b, r)),
                Some((b0, r0)) if b0 != *b => {
                    return Err(bad(format!(
                        "has a batch of {b} but rank {r0} has {b0}: every rank needs the same batch size"
                    )))
                }
                Some(_) => {}
            }
            for (i, &l) in their_labels.iter().enumerate() {
                if l < 0 || l as usize >= self.cfg.num_classes {
                    return Err(PartialFcError::Label {
                        rank: r,
                        index: i,
                        label: l,
                        classes: self.cfg.num_classes,
                    });
                }
            }
            global.extend_from_slice(their_labels);
        }
        Ok(global)
    }
}

/// Rows scaled to unit L2 norm (PyTorch's `F.normalize`: `x / max(||x||, 1e-12)`), one op on
/// the CPU: the sampled centres' temporaries were the head's largest transient memory.
fn normalize(x: &Tensor) -> candle_core::Result<Tensor> {
    tandem_nn::functional::normalize(x)
}

/// Rows `ids` of `w` as a new leaf variable, copied once (`Var::from_tensor` of an
/// `index_select` copies twice: the selection, then the variable's own storage).
fn sampled_leaf(w: &Tensor, ids: &[u32]) -> candle_core::Result<Var> {
    let (_, e) = w.dims2()?;
    if !(w.device().is_cpu() && w.dtype() == DType::F32) {
        let ids = Tensor::from_vec(ids.to_vec(), ids.len(), w.device())?;
        return Var::from_tensor(&w.detach().index_select(&ids, 0)?);
    }
    let rows = tandem_nn::kernels::with_f32_slice(w, |w| {
        let mut rows = Vec::with_capacity(ids.len() * e);
        for &i in ids {
            rows.extend_from_slice(&w[i as usize * e..(i as usize + 1) * e]);
        }
        rows
    })?;
    Var::from_vec(rows, (ids.len(), e), w.device())
}
