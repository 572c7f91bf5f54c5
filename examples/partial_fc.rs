//! Face-recognition-style training (insightface's arcface_torch recipe, on the embedded digits):
//! a candle-nn embedding network under Ddp, and a PartialFc head whose class centres are split
//! across the ranks, with the ArcFace margin. One optimizer steps both as two parameter groups
//! (SGD, momentum 0.9, weight decay 5e-4, as arcface_torch); the centres' gradients come back
//! from `Ddp::backward_with_local` untouched, the backbone's averaged.
//!
//! At the end rank 0 runs a verification test as on LFW: pairs of eval images, the same digit or
//! not, judged by the cosine of their embeddings against a threshold chosen by 10-fold
//! cross-validation, and prints `verification_accuracy=X`.
//!
//!   cargo build --release --example partial_fc
//!   tandem run --nproc-per-node 2 -- target/release/examples/partial_fc
use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use tandem::comm::Collectives;
use tandem::data::{datasets, DataLoader, Dataset, DistributedSampler, LoaderOptions};
use tandem::ddp::{Ddp, DdpOptions};
use tandem::optim::{SgdConfig, TorchOptimizer, TorchSgd};
use tandem::partial_fc::{CombinedMarginLoss, PartialFc, PartialFcConfig};

const EMBEDDING: usize = 32;
const EPOCHS: usize = 20;

/// The backbone: images to embeddings. Nothing tandem-specific.
struct Embedder {
    fc1: Linear,
    fc2: Linear,
}

impl Module for Embedder {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

fn main() -> Result<()> {
    tandem::tune_allocator();
    let group = tandem::init()?;
    let (train, eval) = datasets::digits()?;
    let classes = train.num_classes();

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let backbone = Embedder {
        fc1: linear(train.input_dim(), 128, vb.pp("fc1"))?,
        fc2: linear(128, EMBEDDING, vb.pp("fc2"))?,
    };
    let ddp = Ddp::from_varmap(&varmap, &group, DdpOptions::default())?;
    let comm: Arc<dyn Collectives> = Arc::new(group.clone());
    let margin = CombinedMarginLoss::arcface(64.0, 0.5);
    let mut head =
        PartialFc::new(PartialFcConfig::new(classes, EMBEDDING, margin), comm, &Device::Cpu)?;
    let sgd = SgdConfig { lr: 0.05, momentum: 0.9, weight_decay: 5e-4, ..Default::default() };
    let mut opt = TorchSgd::with_groups(vec![
        (varmap.all_vars(), sgd.clone()),
        (vec![head.weight().clone()], sgd),
    ])?;

    let sampler = DistributedSampler::builder(train.len()).group(&group).build()?;
    let mut loader =
        DataLoader::new(Arc::new(train), sampler, LoaderOptions::new(32), Device::Cpu)?;
    for epoch in 0..EPOCHS {
        loader.set_epoch(epoch as u64);
        let (mut total, mut steps) = (0.0, 0);
        for batch in loader.iter()? {
            let batch = batch?;
            let labels = batch.y.to_dtype(DType::I64)?.to_vec1::<i64>()?;
            let loss = head.forward(&backbone.forward(&batch.x)?, &labels)?;
            total += loss.to_scalar::<f32>()?;
            steps += 1;
            let grads = ddp.backward_with_local(&loss, std::slice::from_ref(head.weight()))?;
            opt.step(&grads)?;
        }
        if group.rank() == 0 {
            println!("epoch {epoch}: loss={:.4} (lr {})", total / steps.max(1) as f32, opt.lr());
        }
    }

    if group.rank() == 0 {
        let x: Vec<f32> = (0..eval.len())
            .map(|i| eval.get(i).map(|e| e.features))
            .collect::<Result<Vec<_>, _>>()?
            .concat();
        let labels: Vec<i64> =
            (0..eval.len()).map(|i| eval.get(i).map(|e| e.label)).collect::<Result<_, _>>()?;
        let x = Tensor::from_vec(x, (eval.len(), eval.input_dim()), &Device::Cpu)?;
        let emb = backbone.forward(&x)?;
        let emb = emb.broadcast_div(&emb.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?)?;
        let accuracy = verification_accuracy(&emb.to_vec2::<f32>()?, &labels, classes);
        println!(
            "partial_fc: world={} classes per rank={} verification_accuracy={accuracy:.4}",
            group.size(),
            head.split().len
        );
    }
    Ok(())
}

/// LFW-style verification on `emb` (unit rows): as many same-digit pairs as different-digit
/// pairs, their cosines thresholded, the threshold picked on 9 folds and scored on the 10th.
fn verification_accuracy(emb: &[Vec<f32>], labels: &[i64], classes: usize) -> f64 {
    let by_class: Vec<Vec<usize>> = (0..classes)
        .map(|c| (0..labels.len()).filter(|&i| labels[i] == c as i64).collect())
        .collect();
    let mut pairs = Vec::new(); // (a, b, same)
    for (c, members) in by_class.iter().enumerate() {
        let others = &by_class[(c + 1) % classes];
        for k in 0..members.len().saturating_sub(1) {
            pairs.push((members[k], members[k + 1], true));
            if let Some(&o) = others.get(k) {
                pairs.push((members[k], o, false));
            }
        }
    }
    let cos = |a: usize, b: usize| emb[a].iter().zip(&emb[b]).map(|(x, y)| x * y).sum::<f32>();
    let scored: Vec<(f32, bool, usize)> =
        pairs.iter().enumerate().map(|(i, &(a, b, same))| (cos(a, b), same, i % 10)).collect();
    let accuracy = |t: f32, fold: Option<usize>, held_out: bool| {
        let chosen: Vec<&(f32, bool, usize)> =
            scored.iter().filter(|p| fold.is_none_or(|f| (p.2 == f) == held_out)).collect();
        let right = chosen.iter().filter(|p| (p.0 > t) == p.1).count();
        right as f64 / chosen.len().max(1) as f64
    };
    let thresholds: Vec<f32> = (0..=400).map(|i| -1.0 + i as f32 * 0.005).collect();
    let folds: Vec<f64> = (0..10)
        .map(|f| {
            let best = thresholds
                .iter()
                .copied()
                .max_by(|a, b| {
                    accuracy(*a, Some(f), false).total_cmp(&accuracy(*b, Some(f), false))
                })
                .unwrap_or(0.0);
            accuracy(best, Some(f), true)
        })
        .collect();
    folds.iter().sum::<f64>() / folds.len() as f64
}
