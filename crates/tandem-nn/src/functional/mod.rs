//! Differentiable functions over tensors with training-grade CPU paths (PyTorch's
//! `torch.nn.functional`): [`fused_linear`] (`F.linear`), [`cross_entropy`] (`F.cross_entropy`),
//! [`normalize`] (`F.normalize(x, dim=1)`), [`layer_norm`] (`F.layer_norm` over the last
//! dimension), [`softmax_last_dim`] (`x.softmax(-1)`), [`relu6`] (`F.relu6`), [`attention`]
//! (a ViT block's multi-head self-attention on its packed `qkv` projection), [`encoder_block`] (a
//! whole pre-norm ViT block as one autograd node).
mod attention;
mod cross_entropy;
mod encoder_block;
mod layer_norm;
mod linear;
mod normalize;
mod relu6;
mod softmax;

pub use attention::attention;
pub use cross_entropy::cross_entropy;
pub use encoder_block::{encoder_block, EncoderBlock, LinearParams};
pub use layer_norm::layer_norm;
pub use linear::{fused_linear, fused_linear_relu6};
pub use normalize::normalize;
pub use relu6::relu6;
pub use softmax::softmax_last_dim;
