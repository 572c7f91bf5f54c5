//! Verification sets (`.bin` pairs, as `--val FILE.bin`): insightface's verification test (its CallBackVerification): every image and
//! its mirror embedded in eval mode, the two embeddings summed, and the pairs' accuracy with a
//! 10-fold cross-validated threshold.
//!
//! arcface_torch runs it on rank 0 alone while the other ranks wait. Here every rank embeds a
//! share of the images with rank 0's model — the parameters are the same everywhere, and rank 0's
//! BatchNorm statistics are lent to the others for the test (with `broadcast_buffers=False` each
//! rank keeps its own) — and the embeddings are gathered: the same numbers as rank 0 alone, in
//! 1/W of the time, and no rank sits in a collective while another computes.
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use candle_nn::ModuleT;
use tandem_comm::ProcessGroup;
use tandem_data::datasets::faces::{verification_accuracy, VerificationSet};
use tandem_models::FACE_SIDE;

use tandem_train::metrics::ValidationMetrics;
use tandem_train::{bail, Context, Result, TrainError};

/// Images per forward pass.
const BATCH: usize = 32;
const FOLDS: usize = 10;
/// The collectives of a verification may wait this long for a slower rank's share (a large
/// set on a loaded machine), instead of the group's usual stall timeout.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// One verification set, named by its file stem (`lfw.bin` is `lfw`), as arcface_torch names
/// them.
pub struct ValSet {
    pub name: String,
    set: VerificationSet,
}

impl ValSet {
    pub fn path(&self) -> &Path {
        &self.set.path
    }
}

/// A set's result: mean accuracy over the folds and its standard deviation, and the
/// embeddings' mean L2 norm as the figure [`XNORM`].
pub type ValResult = ValidationMetrics;

/// The figure of a [`ValResult`] holding the mean L2 norm of the embeddings (each image's and
/// its mirror's): arcface_torch's `XNorm`, in `training.log`.
pub const XNORM: &str = "xnorm";

/// Reads the verification sets at `paths` (each needs at least as many pairs as folds).
pub fn load(paths: &[PathBuf]) -> Result<Vec<ValSet>> {
    paths
        .iter()
        .map(|p| {
            let set = VerificationSet::load(p)?;
            if set.pairs() < FOLDS {
                let pairs = set.pairs();
                bail!("{}: {pairs} pairs, fewer than the {FOLDS} folds", p.display());
            }
            Ok(ValSet { name: stem(p), set })
        })
        .collect()
}

/// Verification sets read now, or on a thread: a live replacement joins the running job first
/// (the survivors train on a smaller world until it does) and needs them only at the next
/// verification.
pub enum ValSets {
    Ready(Vec<ValSet>),
    Reading(Option<std::thread::JoinHandle<Result<Vec<ValSet>>>>),
}

impl ValSets {
    /// Reads `paths` now ([`load`]), or with `background` on a thread.
    pub fn load(paths: &[PathBuf], background: bool) -> Result<ValSets> {
        if !background || paths.is_empty() {
            return load(paths).map(ValSets::Ready);
        }
        let paths = paths.to_vec();
        let reader = std::thread::Builder::new()
            .name("tandem-val-read".into())
            .spawn(move || load(&paths))
            .context("starting the verification sets' reader")?;
        Ok(ValSets::Reading(Some(reader)))
    }

    /// The sets, waiting for the reader if it is still at work.
    pub fn get(&mut self) -> Result<&[ValSet]> {
        if let ValSets::Reading(reader) = self {
            let reader = reader.take().ok_or_else(|| {
                TrainError::Invalid("the verification sets' reader failed before".into())
            })?;
            let sets = reader.join().map_err(|_| {
                TrainError::Invalid("the verification sets' reader panicked".into())
            })??;
            *self = ValSets::Ready(sets);
        }
        match self {
            ValSets::Ready(sets) => Ok(sets),
            ValSets::Reading(_) => unreachable!("set to Ready above"),
        }
    }
}

fn stem(p: &Path) -> String {
    p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned())
}

/// Rank 0's BatchNorm statistics on every rank while it lives; each rank's own come back when
/// it is dropped.
struct LentStatistics<'a> {
    buffers: &'a [(String, Var)],
    own: Vec<Tensor>,
}

impl<'a> LentStatistics<'a> {
    fn lend(buffers: &'a [(String, Var)], group: &ProcessGroup, path: &Path) -> Result<Self> {
        let mut own = Vec::with_capacity(buffers.len());
        for (name, var) in buffers {
            let t = var.as_tensor();
            own.push(t.copy()?);
            let dtype = t.dtype();
            let mut values =
                t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
            group.broadcast(&mut values, 0).map_err(|source| {
                TrainError::comm(format!("{}: lending rank 0's `{name}`", path.display()), source)
            })?;
            let lent = Tensor::from_vec(values, t.shape(), t.device())?.to_dtype(dtype)?;
            var.set(&lent)?;
        }
        Ok(LentStatistics { buffers, own })
    }
}

impl Drop for LentStatistics<'_> {
    fn drop(&mut self) {
        for ((name, var), own) in self.buffers.iter().zip(&self.own) {
            if let Err(e) = var.set(own) {
                tracing::warn!("verification: could not restore this rank's `{name}`: {e}");
            }
        }
    }
}

/// The model's embeddings of a batch of 112x112 faces in eval mode (`forward_t(x, false)`,
/// or a sharded model's evaluation forward).
pub type Embed<'a> = &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>;

/// The accuracy on every set of the replicas' embedding model (112x112 faces in, embeddings
/// out) in eval mode with rank 0's statistics `buffers` (a collective: every rank calls it with
/// the same sets).
pub fn evaluate(
    model: &dyn ModuleT,
    buffers: &[(String, Var)],
    sets: &[ValSet],
    device: &Device,
    group: &ProcessGroup,
) -> Result<Vec<ValResult>> {
    let embed = |x: &Tensor| Ok(tandem_nn::no_grad(|| model.forward_t(x, false))?.detach());
    evaluate_with(&embed, buffers, sets, device, group)
}

/// [`evaluate`] with the model's forward given: every rank runs as many forwards (a rank whose
/// share ran out embeds a stand-in batch), so a sharded model's forwards, each a collective,
/// stay in step.
pub fn evaluate_with(
    embed: Embed,
    buffers: &[(String, Var)],
    sets: &[ValSet],
    device: &Device,
    group: &ProcessGroup,
) -> Result<Vec<ValResult>> {
    let Some(first) = sets.first() else { return Ok(Vec::new()) };
    let usual = group.timeout();
    group.set_timeout(usual.max(VERIFY_TIMEOUT));
    let result = (|| {
        let _lent = LentStatistics::lend(buffers, group, first.path())?;
        sets.iter().map(|s| evaluate_set(embed, s, device, group)).collect()
    })();
    group.set_timeout(usual);
    result
}

fn evaluate_set(
    embed: Embed,
    val: &ValSet,
    device: &Device,
    group: &ProcessGroup,
) -> Result<ValResult> {
    let path = val.set.path.display();
    let n = val.set.images.len();
    let (rank, world) = (group.rank(), group.size());
    let share = n.div_ceil(world);
    let mine = (rank * share).min(n)..((rank + 1) * share).min(n);
    let dim = 3 * FACE_SIDE * FACE_SIDE;
    let mut local: Vec<f32> = Vec::new();
    // Σ of the embeddings' L2 norms (plain and mirrored, before the sum) and their count.
    let mut norms = [0f64, 0f64];
    for batch in 0..share.div_ceil(BATCH) {
        let start = mine.start + batch * BATCH;
        let end = (start + BATCH).min(mine.end);
        // (A share that ran out: image 0 as a stand-in, embedded and dropped.)
        let images = if start < end { start..end } else { 0..1 };
        let (mut plain, mut flipped) = (Vec::new(), Vec::new());
        for i in images.clone() {
            let [p, f] = val.set.image(i, FACE_SIDE)?;
            plain.extend(p);
            flipped.extend(f);
        }
        let embed = |x: Vec<f32>| embed(&Tensor::from_vec(x, (images.len(), dim), device)?);
        let (plain, flipped) = (embed(plain)?, embed(flipped)?);
        if start >= end {
            continue;
        }
        for e in [&plain, &flipped] {
            let n = e.to_dtype(candle_core::DType::F32)?.sqr()?.sum(1)?.sqrt()?;
            let n = n.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
            norms[0] += n.iter().map(|&x| f64::from(x)).sum::<f64>();
            norms[1] += n.len() as f64;
        }
        let sum = (plain + flipped)?;
        local.extend(sum.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?);
    }
    let gathered = group
        .all_gather_bytes(&local.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
        .map_err(|source| TrainError::comm(format!("{path}: gathering the embeddings"), source))?;
    let values: Vec<f32> = gathered
        .iter()
        .flat_map(|b| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    // The model's embedding width, from what every rank sent (every image has one embedding).
    let e = values.len() / n.max(1);
    if e == 0 || values.len() != n * e {
        let got = values.len();
        bail!("{path}: gathered {got} values for {n} images of {e}");
    }
    group.all_reduce(&mut norms, tandem_comm::ReduceOp::Sum).map_err(|source| {
        TrainError::comm(format!("{path}: summing the embedding norms"), source)
    })?;
    let xnorm = norms[0] / norms[1].max(1.0);
    let embeddings: Vec<Vec<f32>> = values.chunks_exact(e).map(<[f32]>::to_vec).collect();
    let (accuracy, std) = verification_accuracy(&embeddings, &val.set.issame, FOLDS)
        .map_err(|why| TrainError::Invalid(format!("{path}: {why}")))?;
    Ok(ValResult::new(val.name.clone(), accuracy, std).with(XNORM, xnorm))
}
