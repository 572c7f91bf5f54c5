//! The training job's settings: command-line flags, their validation, and the `config.toml`
//! written into every run directory (the effective settings, so a run can be reproduced).
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
pub use tandem_models::ModelKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Sgd,
    Adamw,
}

/// What the model computes in; parameters and optimizer state stay float32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    /// bf16 autocast: layers compute in bf16 over float32 weights (no loss scaling needed).
    Bf16,
    /// f16 autocast with a GradScaler: dynamic loss scale, steps with inf/NaN gradients
    /// skipped, the scaler's state in every checkpoint.
    F16,
}

impl Precision {
    /// The dtype the model computes in.
    pub fn compute_dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::F16 => candle_core::DType::F16,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// shm for ranks on one host, tcp otherwise.
    Auto,
    Tcp,
    Shm,
    /// The MPI library of a job started by mpirun (needs the `mpi` build feature).
    Mpi,
    /// NVIDIA NCCL (needs the `cuda` build feature).
    Nccl,
}

/// Where each rank trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    /// GPU `LOCAL_RANK` of the host, as torchrun's recipe does (needs the `cuda` build feature).
    Cuda,
}

impl DeviceKind {
    /// The device of the rank with this local rank.
    pub fn device(self, local_rank: usize) -> anyhow::Result<candle_core::Device> {
        let location = match self {
            DeviceKind::Cpu => tandem_ckpt::MapLocation::Cpu,
            DeviceKind::Cuda => tandem_ckpt::MapLocation::Cuda(local_rank),
        };
        tandem_nn::convert::map_location_device(location).with_context(|| {
            let flag = format!("{self:?}").to_lowercase();
            format!("--device {flag} (this rank's LOCAL_RANK is {local_rank})")
        })
    }
}

/// Why a CPU-only build refuses the GPU flags.
#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this build has no CUDA support; rebuild with `cargo build --release \
    --features cuda` (needs the CUDA toolkit's nvcc; NCCL is loaded at run time)";

impl Backend {
    /// The transport the process group is asked for (`None`: its own choice). Each rank's
    /// worker applies it, under tandem's own launcher or any other.
    pub fn transport(self) -> Option<tandem_comm::TransportKind> {
        use tandem_comm::TransportKind;
        match self {
            Backend::Auto | Backend::Nccl => None,
            Backend::Tcp => Some(TransportKind::Tcp),
            Backend::Shm => Some(TransportKind::Shm),
            Backend::Mpi => Some(TransportKind::Mpi),
        }
    }
}

/// `tandem train` flags. Every field is also recorded in the run's `config.toml`.
#[derive(Clone, Debug, clap::Args, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Ranks to start on this host (ignored when already launched by tandem run / torchrun).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", default_value_t = 2)]
    pub nproc_per_node: usize,
    /// Passes over the training data.
    #[arg(long, default_value_t = 20)]
    pub epochs: usize,
    /// Stop after this many optimizer steps (overrides --epochs when reached first).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Samples per rank per step, as in DDP (global batch = batch-size x world size).
    #[arg(long = "batch-size", default_value_t = 32)]
    pub batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    pub optimizer: OptimizerKind,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (SGD: L2 added to the gradient; AdamW: decoupled).
    #[arg(long = "weight-decay", default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Model: mlp (fc1 -> ReLU -> fc2) or a small cnn.
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    pub model: ModelKind,
    /// Hidden width of the MLP.
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    /// Width of the ResNet's first stage (stages are w, 2w, 4w, 8w; torchvision's is 64).
    #[arg(long, default_value_t = 64)]
    pub width: usize,
    /// Synchronise BatchNorm statistics across ranks (PyTorch's SyncBatchNorm; resnet18 only).
    #[arg(long = "sync-batchnorm")]
    pub sync_batchnorm: bool,
    /// What gradient buckets go through: `none` (f32 all-reduce average), `fp16` or `bf16`
    /// (compressed to 16 bits on the wire, PyTorch's fp16/bf16_compress_hook), `powersgd`
    /// (rank-2 PowerSGD with error feedback after 10 plain steps).
    #[arg(long = "comm-hook", value_name = "HOOK", default_value = "none", value_parser = ["none", "fp16", "bf16", "powersgd"])]
    pub comm_hook: String,
    /// Normalise each image channel with the training set's mean and standard deviation.
    #[arg(long)]
    pub normalize: bool,
    /// Augment training images: random crop after 4-pixel zero padding, then random
    /// horizontal flip, drawn from --seed, the epoch and the example (same for any world size).
    #[arg(long)]
    pub augment: bool,
    /// Data: digits (embedded), mnist:DIR (IDX files), cifar10:DIR (binary batches),
    /// synthetic[:N[:DIM[:CLASSES]]] or synthetic-cifar[:N].
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Seed for model init and the sampler's shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep the dataset order (no per-epoch shuffle).
    #[arg(long = "no-shuffle")]
    pub no_shuffle: bool,
    /// Run directory (default runs/<model>-<data>-<timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (0: at the end of each epoch only).
    #[arg(long = "save-every", default_value_t = 0)]
    pub save_every: u64,
    /// Checkpoints to keep in the run directory.
    #[arg(long = "keep-last", default_value_t = 3)]
    pub keep_last: usize,
    /// Write checkpoints on a background thread: training waits only while the state is copied
    /// to host memory. At most one save in flight; a failed write stops the run at the next save
    /// or at the end, naming the file.
    #[arg(long = "async-save")]
    #[serde(default)]
    pub async_save: bool,
    /// Continue from the newest valid checkpoint in --out.
    #[arg(long)]
    pub resume: bool,
    /// Initial weights from a PyTorch or tandem checkpoint (any wrapping; strict key check).
    #[arg(long = "init-from")]
    pub init_from: Option<PathBuf>,
    /// Write the final model weights here (.pt or .safetensors, canonical keys).
    #[arg(long = "save-final")]
    pub save_final: Option<PathBuf>,
    /// Shard the optimizer state over the ranks (ZeRO-1, PyTorch's ZeroRedundancyOptimizer):
    /// each rank keeps the state of its share of the parameters; same weights as without.
    #[arg(long)]
    #[serde(default)]
    pub zero: bool,
    /// At the end, rank 0 writes the trained model (eval mode) as ONNX here.
    #[arg(long = "export-onnx", value_name = "FILE")]
    #[serde(default)]
    pub export_onnx: Option<PathBuf>,
    /// Mixed precision (PyTorch's autocast + GradScaler recipe); --model mlp only.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    #[serde(default)]
    pub precision: Precision,
    /// Collective backend. nccl reduces CUDA gradients on the GPUs (with --device cuda); the
    /// others stage them through host memory.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// Where each rank trains: cpu, or cuda (rank r on GPU LOCAL_RANK).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    #[serde(default)]
    pub device: DeviceKind,
    /// Write TensorBoard event files (loss, lr, accuracy, samples/s) into the run directory.
    #[arg(long)]
    pub tensorboard: bool,
}

impl TrainConfig {
    /// Rejects settings that cannot train, naming the flag at fault.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.nproc_per_node == 0 {
            bail!("--nproc-per-node must be at least 1");
        }
        if self.batch_size == 0 {
            bail!("--batch-size must be at least 1");
        }
        if self.epochs == 0 && self.steps.is_none() {
            bail!("--epochs must be at least 1 (or give --steps)");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("--lr must be a positive number, got {}", self.lr);
        }
        if self.hidden == 0 {
            bail!("--hidden must be at least 1");
        }
        if self.width == 0 {
            bail!("--width must be at least 1");
        }
        if self.sync_batchnorm && self.model != ModelKind::ResNet18 {
            bail!("--sync-batchnorm needs --model resnet18 (the model whose BatchNorm layers can synchronise)");
        }
        if self.precision != Precision::F32 && self.model != ModelKind::Mlp {
            bail!(
                "--precision {}: mixed precision is supported for --model mlp only (the cnn and \
                 resnet18 convolution kernels compute in f32)",
                format!("{:?}", self.precision).to_lowercase()
            );
        }
        if self.keep_last == 0 {
            bail!("--keep-last must be at least 1");
        }
        if self.resume && self.out.is_none() {
            bail!("--resume needs --out DIR (the run directory to continue)");
        }
        if let Some(path) = &self.export_onnx {
            // Found out before training, not after it.
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            if dir.is_some_and(|d| !d.is_dir()) {
                bail!("--export-onnx {}: its directory does not exist", path.display());
            }
        }
        if self.backend == Backend::Nccl && self.device != DeviceKind::Cuda {
            bail!("--backend nccl reduces GPU buffers: add --device cuda (CPU backends: auto, tcp, shm, mpi)");
        }
        #[cfg(not(feature = "cuda"))]
        if self.device == DeviceKind::Cuda {
            bail!("--device cuda: {NO_CUDA}");
        }
        Ok(())
    }

    /// The run directory: --out, or runs/<model>-<data>-<unix seconds>.
    pub fn run_dir(&self) -> PathBuf {
        if let Some(out) = &self.out {
            return out.clone();
        }
        let data = self.data.split(':').next().unwrap_or("data");
        let model = self.model.name();
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from("runs").join(format!("{model}-{data}-{secs}"))
    }

    pub fn to_toml(&self) -> anyhow::Result<String> {
        toml::to_string_pretty(self).context("serialising config.toml")
    }

    /// The flags that reproduce this configuration (for re-launching the same job on each rank).
    pub fn to_args(&self) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut push = |k: &str, v: String| {
            a.push(k.to_string());
            a.push(v);
        };
        push("--epochs", self.epochs.to_string());
        if let Some(s) = self.steps {
            push("--steps", s.to_string());
        }
        push("--batch-size", self.batch_size.to_string());
        push("--lr", self.lr.to_string());
        push("--optimizer", format!("{:?}", self.optimizer).to_lowercase());
        push("--momentum", self.momentum.to_string());
        push("--weight-decay", self.weight_decay.to_string());
        push("--model", self.model.name().to_string());
        push("--hidden", self.hidden.to_string());
        push("--width", self.width.to_string());
        push("--data", self.data.clone());
        push("--seed", self.seed.to_string());
        if let Some(o) = &self.out {
            push("--out", o.display().to_string());
        }
        push("--save-every", self.save_every.to_string());
        push("--keep-last", self.keep_last.to_string());
        if let Some(p) = &self.init_from {
            push("--init-from", p.display().to_string());
        }
        if let Some(p) = &self.save_final {
            push("--save-final", p.display().to_string());
        }
        if let Some(p) = &self.export_onnx {
            push("--export-onnx", p.display().to_string());
        }
        push("--backend", format!("{:?}", self.backend).to_lowercase());
        push("--device", format!("{:?}", self.device).to_lowercase());
        push("--comm-hook", self.comm_hook.clone());
        push("--precision", format!("{:?}", self.precision).to_lowercase());
        if self.no_shuffle {
            a.push("--no-shuffle".into());
        }
        if self.resume {
            a.push("--resume".into());
        }
        if self.async_save {
            a.push("--async-save".into());
        }
        if self.zero {
            a.push("--zero".into());
        }
        if self.tensorboard {
            a.push("--tensorboard".into());
        }
        if self.sync_batchnorm {
            a.push("--sync-batchnorm".into());
        }
        if self.normalize {
            a.push("--normalize".into());
        }
        if self.augment {
            a.push("--augment".into());
        }
        a
    }
}
