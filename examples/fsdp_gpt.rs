//! A GPT-shaped candle-nn model trained under `Fsdp` (FSDP2's `fully_shard` per block, then the
//! root): a rank holds a shard of each weight, its gradient and its AdamW moments, and gathers a
//! block's weights only for its forward and backward. Built without values (FSDP2's meta device),
//! each rank draws only its rows. It learns to continue counting sequences.
//!   cargo build --release --example fsdp_gpt
//!   tandem run --nproc-per-node 2 -- target/release/examples/fsdp_gpt
use anyhow::Result;
use candle_core::{Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_nn::{embedding, layer_norm, linear, linear_no_bias, Embedding, LayerNorm, Linear};
use tandem::fsdp::{Fsdp, FsdpOptions, MetaVarMap, Units};
use tandem::optim::{AdamWConfig, TorchAdamW};

const VOCAB: usize = 61;
const DIM: usize = 64;
const HEADS: usize = 4;
const BLOCKS: usize = 4;
const SEQ: usize = 16;
const BATCH: usize = 8;
const STEPS: usize = 120;

/// candle-nn's LayerNorm has no backward through its fused forward: the plain one.
fn norm(ln: &LayerNorm, x: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::ops::layer_norm_slow(x, ln.weight(), ln.bias().expect("a bias"), 1e-5)
}

struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> candle_core::Result<Block> {
        Ok(Block {
            ln1: layer_norm(DIM, 1e-5, vb.pp("ln1"))?,
            qkv: linear_no_bias(DIM, 3 * DIM, vb.pp("qkv"))?,
            proj: linear(DIM, DIM, vb.pp("proj"))?,
            ln2: layer_norm(DIM, 1e-5, vb.pp("ln2"))?,
            fc1: linear(DIM, 4 * DIM, vb.pp("fc1"))?,
            fc2: linear(4 * DIM, DIM, vb.pp("fc2"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let qkv = self.qkv.forward(&norm(&self.ln1, x)?)?;
        let qkv = qkv.reshape((b, t, 3 * HEADS, d / HEADS))?.transpose(1, 2)?; // (b, 3·heads, t, ·)
        let head = |i| qkv.narrow(1, i * HEADS, HEADS)?.contiguous();
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        let mask: Vec<f32> =
            (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?;
        let att = (q.matmul(&k.t()?)? / ((d / HEADS) as f64).sqrt())?.broadcast_add(&mask)?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let x = (x + self.proj.forward(&att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?)?)?;
        let mlp = self.fc2.forward(&self.fc1.forward(&norm(&self.ln2, &x)?)?.gelu_erf()?)?;
        x + mlp
    }
}

/// Token sequences counting up by a stride (1 to 4) from a start, different per rank and step.
fn batch(rank: usize, step: usize) -> Result<Tensor> {
    let seed = |row: usize| (rank * 7_919 + step * 104_729 + row * 15_485_863) % 1_000_003;
    let token = |row, i| ((seed(row) % VOCAB + i * (1 + seed(row) / VOCAB % 4)) % VOCAB) as u32;
    let tokens = (0..BATCH).flat_map(|row| (0..=SEQ).map(move |i| token(row, i)));
    Ok(Tensor::from_vec(tokens.collect(), (BATCH, SEQ + 1), &Device::Cpu)?)
}

fn main() -> Result<()> {
    tandem::release_freed_memory(); // a sharded rank's memory follows what it holds
    let group = tandem::init()?;
    let meta = MetaVarMap::new(0); // the seed of every rank's rows
    let vb = meta.var_builder();
    let wte: Embedding = embedding(VOCAB, DIM, vb.pp("wte"))?;
    let wpe = vb.get((SEQ, DIM), "wpe.weight")?;
    let names: Vec<String> = (0..BLOCKS).map(|i| format!("blocks.{i}")).collect();
    let blocks: Vec<Block> =
        names.iter().map(|n| Block::new(vb.pp(n))).collect::<Result<_, _>>()?;
    let ln_f = layer_norm(DIM, 1e-5, vb.pp("ln_f"))?;

    // One unit per block; the root (embeddings, tied output head, last norm) is the rest.
    let units = Units::prefixes(names.clone());
    let fsdp = Fsdp::from_meta(&meta, &group, FsdpOptions { units, ..Default::default() })?;
    let blocks = blocks.into_iter().zip(&names).map(|(b, n)| fsdp.fully_shard(n, b));
    let blocks = blocks.collect::<Result<Vec<_>, _>>()?;
    let mut opt = TorchAdamW::new(fsdp.params(), AdamWConfig { lr: 3e-3, ..Default::default() })?;

    let mut losses = Vec::with_capacity(STEPS);
    for step in 0..STEPS {
        let tokens = batch(group.rank(), step)?;
        let loss = fsdp.forward(|| {
            let mut x = wte.forward(&tokens.narrow(1, 0, SEQ)?)?.broadcast_add(&wpe)?;
            for block in &blocks {
                x = block.forward(&x)?;
            }
            let logits =
                norm(&ln_f, &x)?.reshape((BATCH * SEQ, DIM))?.matmul(&wte.embeddings().t()?)?;
            candle_nn::loss::cross_entropy(&logits, &tokens.narrow(1, 1, SEQ)?.flatten_all()?)
        })?;
        let mut grads = fsdp.backward(&loss)?; // this rank's shards' gradients, averaged
        let norm = fsdp.clip_grad_norm(&mut grads, 1.0)?;
        opt.step(&grads)?;
        losses.push(loss.to_scalar::<f32>()?);
        if group.rank() == 0 && step % 20 == 0 {
            println!("step {step:3}  loss {:.3}  grad norm {norm:.3}", losses[step]);
        }
    }
    let (first, last): (f32, f32) = (losses[..10].iter().sum(), losses[STEPS - 10..].iter().sum());
    let rank = group.rank();
    println!("rank {rank}: summed loss of the first 10 steps {first:.2}, the last 10 {last:.2}");
    anyhow::ensure!(last < 0.5 * first, "the model did not learn: {first:.3} -> {last:.3}");
    Ok(())
}
