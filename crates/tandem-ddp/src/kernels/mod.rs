//! CPU kernels for convolutional nets, written here because candle's CPU path is the
//! bottleneck (see each module) and no crate offers trainable conv kernels on plain slices. The
//! matrix products are `gemm`'s (the crate candle itself uses); what is ours is the data layout
//! around them and the backward passes.
pub mod batch_norm;
pub mod conv2d;
mod matmul;
pub mod pool;
pub mod relu;
