//! tandem-ckpt: reading and writing `.pt` (torch.save) and safetensors files, key
//! canonicalisation with load reports, and atomic training checkpoints.
//! Knows nothing of process groups: "save on rank 0 only" is the caller's business.
pub mod value;
pub use value::{DType, Tensor, Value};
