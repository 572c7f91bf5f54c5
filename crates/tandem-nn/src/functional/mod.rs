//! Differentiable functions over tensors with training-grade CPU paths (PyTorch's
//! `torch.nn.functional`): [`fused_linear`] (`F.linear`), [`cross_entropy`] (`F.cross_entropy`),
//! [`normalize`] (`F.normalize(x, dim=1)`).
mod cross_entropy;
mod linear;
mod normalize;

pub use cross_entropy::cross_entropy;
pub use linear::fused_linear;
pub use normalize::normalize;
