//! `encoder_block(x, block, masks)`: a pre-norm transformer encoder block — arcface_torch's (and
//! timm's) ViT `Block` with a ReLU6 MLP and stochastic depth,
//! `x1 = x + drop(proj(attention(qkv(LN1(x)))))`, `y = x1 + drop(fc2(relu6(fc1(LN2(x1)))))` —
//! as one autograd node on CPU f32.
//!
//! Why one node: candle's backward gives every op's input gradient a freshly zeroed accumulator
//! and adds into it (`zeros_like`, then `add`, in its crate-private `GradStore`), and a block
//! composed of tandem's ops has ~20 such edges (each linear's reshapes, the residual adds, the
//! stochastic-depth products, whose backward also computes the mask's unused gradient). On
//! ViT-T's training step that glue was ~12% of a rank's time (`perf` on a 2-core Intel Xeon
//! with AVX-512). Here the forward runs the same ops on detached tensors and keeps what their
//! backwards read; the node's backward chains those backwards by hand, so the block input's
//! gradient is the only accumulator left. The values are the composition's bit for bit: the
//! same kernels in the same order, and a gradient that reaches a tensor twice (the residual
//! stream) is `a + b` where candle computes `(0 + a) + b`.
//!
//! The parameters are not operands of the node (candle's custom ops take at most three): their
//! gradients go to [`crate::backward`]'s store as the fused layers' do, so the node needs
//! tandem's backward and fails under a plain `loss.backward()` naming it, as
//! [`crate::checkpoint`] does.
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::attention::Attention;
use super::layer_norm::grads as layer_norm_grads;
use super::linear::grads as linear_grads;
use super::{fused_linear, fused_linear_relu6, layer_norm};
use crate::backward::require_backward_scope;

/// A linear layer's weight `[out, in]` and bias `[out]`, if it has one.
pub type LinearParams<'a> = (&'a Tensor, Option<&'a Tensor>);

/// The parameters of one [`encoder_block`] (the model's variables: their gradients are handed
/// to [`crate::backward`]'s store under their own ids).
#[derive(Clone, Copy)]
pub struct EncoderBlock<'a> {
    /// The first LayerNorm's weight and bias.
    pub norm1: (&'a Tensor, &'a Tensor),
    /// The packed query-key-value projection, `[3·D, D]`.
    pub qkv: LinearParams<'a>,
    pub proj: LinearParams<'a>,
    pub norm2: (&'a Tensor, &'a Tensor),
    /// The MLP's first layer (ReLU6 after it) and second.
    pub fc1: LinearParams<'a>,
    pub fc2: LinearParams<'a>,
    pub heads: usize,
    /// Both LayerNorms' epsilon.
    pub eps: f64,
}

impl EncoderBlock<'_> {
    fn params(&self) -> Vec<&Tensor> {
        let mut out = vec![self.norm1.0, self.norm1.1, self.norm2.0, self.norm2.1];
        for (w, b) in [self.qkv, self.proj, self.fc1, self.fc2] {
            out.push(w);
            out.extend(b);
        }
        out
    }
}

/// The block over `x: [N, T, D]` (see the module docs); `masks`: stochastic depth's `[N, 1, 1]`
/// multipliers of the attention and MLP branches. `None` — the caller then runs its
/// composition — when `x` or a parameter is not f32 on the CPU, under autocast, inside
/// [`crate::no_grad`], or when `x` is not in the autograd graph (the node's only operand: the
/// parameters' gradients would have no path).
pub fn encoder_block(
    x: &Tensor,
    block: &EncoderBlock<'_>,
    masks: Option<&[Tensor; 2]>,
) -> candle_core::Result<Option<Tensor>> {
    let params = block.params();
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    let in_graph = x.track_op() && crate::grad_enabled();
    let plain_f32 = f32_cpu(x) && params.iter().all(|p| f32_cpu(p));
    if !in_graph || !plain_f32 || crate::autocast::scope().is_some() {
        return Ok(None);
    }
    let (n, t, d) = x.dims3()?;
    if block.heads == 0 || d % block.heads != 0 {
        candle_core::bail!("encoder_block: width {d} does not split into {} heads", block.heads)
    }
    let rows = n * t;
    let x = x.contiguous()?;
    let detached = |p: LinearParams<'_>| (p.0.detach(), p.1.map(Tensor::detach));
    let (qkv_w, qkv_b) = detached(block.qkv);
    let (proj_w, proj_b) = detached(block.proj);
    let (fc1_w, fc1_b) = detached(block.fc1);
    let (fc2_w, fc2_b) = detached(block.fc2);
    let [m0, m1] = match masks {
        Some([a, b]) => [Some(a.clone()), Some(b.clone())],
        None => [None, None],
    };
    let xd = x.detach();
    let ln1 = layer_norm(&xd, &block.norm1.0.detach(), &block.norm1.1.detach(), block.eps)?
        .reshape((rows, d))?;
    let qkv = fused_linear(&ln1, &qkv_w, qkv_b.as_ref())?;
    let attention: AttentionOp = Arc::new(Box::new(Attention::new(block.heads)));
    let att = qkv.reshape((n, t, 3 * d))?.apply_op1_arc(attention.clone())?.reshape((rows, d))?;
    let a = fused_linear(&att, &proj_w, proj_b.as_ref())?;
    let x1 = residual(&xd.reshape((rows, d))?, &a, m0.as_ref(), (n, t, d))?;
    let ln2 = layer_norm(&x1, &block.norm2.0.detach(), &block.norm2.1.detach(), block.eps)?;
    let h = fused_linear_relu6(&ln2, &fc1_w, fc1_b.as_ref())?;
    let m = fused_linear(&h, &fc2_w, fc2_b.as_ref())?;
    let y = residual(&x1, &m, m1.as_ref(), (n, t, d))?.reshape((n, t, d))?;
    let owned = |(w, b): LinearParams<'_>| (w.clone(), b.cloned());
    let node = BlockNode {
        saved: Saved { ln1, qkv, att, a, x1, ln2, h, m, masks: [m0, m1], attention },
        params: Params {
            norm1: (block.norm1.0.clone(), block.norm1.1.clone()),
            qkv: owned(block.qkv),
            proj: owned(block.proj),
            norm2: (block.norm2.0.clone(), block.norm2.1.clone()),
            fc1: owned(block.fc1),
            fc2: owned(block.fc2),
        },
        dims: (n, t, d),
        eps: block.eps,
    };
    Ok(Some(x.apply_op2(&y, node)?))
}

/// `x + branch · mask` (the sample's mask broadcast over its rows), as the composition
/// computes it: the product rounded, then the sum.
fn residual(
    x: &Tensor,
    branch: &Tensor,
    mask: Option<&Tensor>,
    dims: (usize, usize, usize),
) -> candle_core::Result<Tensor> {
    x + masked(branch, mask, dims)?
}

/// `g · mask` over `[N, T, D]` (kept `[N·T, D]`), or `g` without a mask.
fn masked(
    g: &Tensor,
    mask: Option<&Tensor>,
    (n, t, d): (usize, usize, usize),
) -> candle_core::Result<Tensor> {
    match mask {
        Some(m) => g.reshape((n, t, d))?.broadcast_mul(m)?.reshape((n * t, d)),
        None => Ok(g.clone()),
    }
}

/// What the backwards of the block's ops read (rows `[N·T, ·]`).
struct Saved {
    ln1: Tensor,
    qkv: Tensor,
    att: Tensor,
    a: Tensor,
    x1: Tensor,
    ln2: Tensor,
    h: Tensor,
    m: Tensor,
    masks: [Option<Tensor>; 2],
    /// The attention op, which keeps its probabilities for its backward.
    attention: AttentionOp,
}

type AttentionOp = Arc<Box<dyn CustomOp1 + Send + Sync>>;

/// The block's variables (not detached: the store keys their gradients by their ids).
struct Params {
    norm1: (Tensor, Tensor),
    qkv: (Tensor, Option<Tensor>),
    proj: (Tensor, Option<Tensor>),
    norm2: (Tensor, Tensor),
    fc1: (Tensor, Option<Tensor>),
    fc2: (Tensor, Option<Tensor>),
}

struct BlockNode {
    saved: Saved,
    params: Params,
    dims: (usize, usize, usize),
    eps: f64,
}

/// The input's gradient of an op's backward, whose parameter gradients the store must have
/// taken (one left over belongs to a parameter that is not a variable: it would have no home).
fn input_grad(
    (gx, gw, gb): (Tensor, Option<Tensor>, Option<Tensor>),
) -> candle_core::Result<Tensor> {
    if gw.is_some() || gb.is_some() {
        candle_core::bail!(
            "encoder_block: a parameter is not a variable (its gradient has no home)"
        )
    }
    Ok(gx)
}

impl CustomOp2 for BlockNode {
    fn name(&self) -> &'static str {
        "tandem-encoder-block"
    }

    /// The output is the block's, already computed: a copy of it.
    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((crate::checkpoint::contiguous_copy(s2, l2)?, l2.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _y: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        require_backward_scope("encoder_block", "the block's parameter gradients")?;
        let (s, p) = (&self.saved, &self.params);
        let (n, t, d) = self.dims;
        let rows = n * t;
        let gy = grad.contiguous()?.reshape((rows, d))?;
        // The MLP branch, from its output back to LN2's input.
        let gm = masked(&gy, s.masks[1].as_ref(), self.dims)?;
        let gh = input_grad(linear_grads(&s.h, &p.fc2.0, p.fc2.1.as_ref(), (&s.m, &gm), false)?)?;
        let gln2 =
            input_grad(linear_grads(&s.ln2, &p.fc1.0, p.fc1.1.as_ref(), (&s.h, &gh), true)?)?;
        let gx1_norm =
            input_grad(layer_norm_grads(&s.x1, &p.norm2.0, &p.norm2.1, &gln2, self.eps)?)?;
        let gx1 = (&gy + &gx1_norm)?;
        // The attention branch, back to LN1's input.
        let ga = masked(&gx1, s.masks[0].as_ref(), self.dims)?;
        let gatt =
            input_grad(linear_grads(&s.att, &p.proj.0, p.proj.1.as_ref(), (&s.a, &ga), false)?)?;
        let qkv3 = s.qkv.reshape((n, t, 3 * d))?;
        let att3 = s.att.reshape((n, t, d))?;
        let gqkv = s
            .attention
            .bwd(&qkv3, &att3, &gatt.reshape((n, t, d))?)?
            .ok_or_else(|| candle_core::Error::Msg("encoder_block: no attention gradient".into()))?
            .reshape((rows, 3 * d))?;
        let gln1 =
            input_grad(linear_grads(&s.ln1, &p.qkv.0, p.qkv.1.as_ref(), (&s.qkv, &gqkv), false)?)?;
        let gln1 = gln1.reshape((n, t, d))?;
        let x = x.contiguous()?;
        let gx_norm = input_grad(layer_norm_grads(&x, &p.norm1.0, &p.norm1.1, &gln1, self.eps)?)?;
        Ok((Some((gx1.reshape((n, t, d))? + gx_norm)?), None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn var(dims: &[usize], seed: usize) -> Var {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i * 7 + seed) as f32 * 0.37).sin() * 0.3).collect();
        Var::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// The node is made only for an input in the autograd graph, outside `no_grad`: otherwise
    /// nothing would carry the parameters' gradients, and the caller composes the block.
    #[test]
    fn an_input_outside_the_graph_leaves_the_block_to_the_caller() {
        let d = 8;
        let (n1w, n1b, n2w, n2b) = (var(&[d], 1), var(&[d], 2), var(&[d], 3), var(&[d], 4));
        let (qkv, proj) = (var(&[3 * d, d], 5), var(&[d, d], 6));
        let (fc1, fc2) = (var(&[4 * d, d], 7), var(&[d, 4 * d], 8));
        let block = EncoderBlock {
            norm1: (n1w.as_tensor(), n1b.as_tensor()),
            qkv: (qkv.as_tensor(), None),
            proj: (proj.as_tensor(), None),
            norm2: (n2w.as_tensor(), n2b.as_tensor()),
            fc1: (fc1.as_tensor(), None),
            fc2: (fc2.as_tensor(), None),
            heads: 2,
            eps: 1e-5,
        };
        let data = var(&[2, 3, d], 9);
        assert!(encoder_block(&data.as_tensor().detach(), &block, None).unwrap().is_none());
        let x = data.as_tensor();
        assert!(encoder_block(x, &block, None).unwrap().is_some());
        let under_no_grad = crate::no_grad(|| encoder_block(x, &block, None)).unwrap();
        assert!(under_no_grad.is_none());
        let odd = EncoderBlock { heads: 3, ..block };
        let e = encoder_block(x, &odd, None).unwrap_err().to_string();
        assert!(e.contains("3 heads"), "{e}");
    }
}
