//! The GPT-shaped model of fixtures/make_torch_fsdp2.py in candle-nn layers (the same names,
//! shapes and arithmetic), and the fixture it is compared with.
#![allow(dead_code)] // each test file uses its part

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Linear, VarBuilder, VarMap};
use tandem_fsdp::{Fsdp, FsdpOptions, FullyShard, Units};

pub const V: usize = 37;
pub const DIM: usize = 16;
pub const HEADS: usize = 2;
pub const BLOCKS: usize = 2;
pub const T: usize = 7;

pub fn fixture(world: usize) -> HashMap<String, Tensor> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/fsdp2_gpt_w{world}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

struct Norm {
    w: Tensor,
    b: Tensor,
}

impl Norm {
    fn new(vb: VarBuilder) -> Norm {
        Norm {
            w: vb.get_with_hints(DIM, "weight", candle_nn::Init::Const(1.0)).unwrap(),
            b: vb.get_with_hints(DIM, "bias", candle_nn::Init::Const(0.0)).unwrap(),
        }
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        layer_norm(x, &self.w, &self.b)
    }
}

pub struct Block {
    ln1: Norm,
    qkv: Linear,
    proj: Linear,
    ln2: Norm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> Block {
        Block {
            ln1: Norm::new(vb.pp("ln1")),
            qkv: candle_nn::linear_no_bias(DIM, 3 * DIM, vb.pp("qkv")).unwrap(),
            proj: candle_nn::linear(DIM, DIM, vb.pp("proj")).unwrap(),
            ln2: Norm::new(vb.pp("ln2")),
            fc1: candle_nn::linear(DIM, 4 * DIM, vb.pp("fc1")).unwrap(),
            fc2: candle_nn::linear(4 * DIM, DIM, vb.pp("fc2")).unwrap(),
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let hd = d / HEADS;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let heads = |i: usize| {
            qkv.narrow(2, i * d, d)?.reshape((b, t, HEADS, hd))?.transpose(1, 2)?.contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let mask: Vec<f32> =
            (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?;
        let att = candle_nn::ops::softmax(&att.broadcast_add(&mask)?, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        let x = (x + self.proj.forward(&y)?)?;
        let h = self.fc1.forward(&self.ln2.forward(&x)?)?.gelu_erf()?;
        x + self.fc2.forward(&h)?
    }
}

/// The model with its blocks behind `B` (a plain block, or the FSDP unit wrapping one).
pub struct Gpt<B> {
    wte: Tensor,
    wpe: Tensor,
    pub blocks: Vec<B>,
    ln_f: Norm,
}

impl Gpt<Block> {
    /// The model's layers on `vb`, as they come.
    pub fn build(vb: VarBuilder) -> Gpt<Block> {
        Gpt {
            wte: vb.get((V, DIM), "wte.weight").unwrap(),
            wpe: vb.get((T, DIM), "wpe.weight").unwrap(),
            blocks: (0..BLOCKS).map(|i| Block::new(vb.pp(format!("blocks.{i}")))).collect(),
            ln_f: Norm::new(vb.pp("ln_f")),
        }
    }

    /// The model on `varmap`, holding the fixture's initial weights.
    pub fn new(varmap: &VarMap, init: &HashMap<String, Tensor>) -> Gpt<Block> {
        let gpt = Gpt::build(VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu));
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let t = init.get(&format!("init.{name}")).unwrap_or_else(|| panic!("init.{name}"));
            var.set(t).unwrap();
        }
        gpt
    }

    /// Sharded: a unit per block, the root holding the embeddings (the token embedding is
    /// also the output head: a tied weight) and the last norm; the position embedding frozen.
    pub fn shard(
        self,
        varmap: &VarMap,
        group: &tandem_comm::ProcessGroup,
        opts: FsdpOptions,
    ) -> (Fsdp, Gpt<FullyShard<Block>>) {
        let fsdp = Fsdp::from_varmap(varmap, group, opts).unwrap();
        let gpt = self.wrap(&fsdp);
        (fsdp, gpt)
    }

    /// Each block behind its unit of `fsdp`.
    pub fn wrap(self, fsdp: &Fsdp) -> Gpt<FullyShard<Block>> {
        let blocks = self
            .blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| fsdp.fully_shard(&format!("blocks.{i}"), b).unwrap())
            .collect();
        Gpt { wte: self.wte, wpe: self.wpe, blocks, ln_f: self.ln_f }
    }
}

/// A unit per block, the root the rest, the position embedding frozen.
pub fn options() -> FsdpOptions {
    FsdpOptions {
        units: Units::prefixes((0..BLOCKS).map(|i| format!("blocks.{i}"))),
        frozen: vec!["wpe.weight".into()],
        ..FsdpOptions::default()
    }
}

impl<B: Module> Gpt<B> {
    /// Mean next-token cross-entropy over `tokens` (B, T+1).
    pub fn loss(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t1) = tokens.dims2()?;
        let t = t1 - 1;
        let input = tokens.narrow(1, 0, t)?;
        let target = tokens.narrow(1, 1, t)?.flatten_all()?;
        let pos = self.wpe.narrow(0, 0, t)?;
        let mut x =
            self.wte.embedding(&input.flatten_all()?)?.reshape((b, t, DIM))?.broadcast_add(&pos)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        let logits = self.ln_f.forward(&x)?.reshape((b * t, DIM))?.matmul(&self.wte.t()?)?;
        candle_nn::loss::cross_entropy(&logits, &target)
    }
}

/// Step `k`'s tokens of `rank`, as u32.
pub fn tokens(f: &HashMap<String, Tensor>, k: usize, rank: usize) -> Tensor {
    f["tokens"].get(k).unwrap().get(rank).unwrap().to_dtype(DType::U32).unwrap()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}
