//! What a run is asked to do, one typed struct per part: the loop ([`RunOptions`]), checkpoints
//! ([`CheckpointOptions`]), data ([`DataOptions`]), the model ([`ModelOptions`]), the optimizer
//! and its step ([`OptimOptions`]), communication ([`CommOptions`]) and the face recipe's head
//! and verification ([`FaceOptions`]), built by [`TrainConfig::options`] from the settings as a
//! person writes them (`tandem train`'s flags, a `--config` file).
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tandem_models::ModelKind;
use tandem_train::{Context, LrSchedule, Result, TrainError};

#[cfg(feature = "clap")]
pub use crate::train_config::{choice, ChoiceParser};
pub use crate::train_config::{SchedulerKind, TrainConfig};
pub use tandem_data::datasets::DatasetSpec;

/// An option with a fixed set of named values (for a command line's parser and help).
pub trait Choice: FromStr + Copy + Send + Sync + 'static {
    /// Every value's name, as parsed.
    const NAMES: &'static [&'static str];
}

impl Choice for ModelKind {
    const NAMES: &'static [&'static str] = &ModelKind::PARSED_NAMES;
}

/// Names the values of a plain enum for parsing and printing (`sgd`, `adamw`, ...).
macro_rules! named_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum $name { $($(#[$vmeta])* $variant),* }

        impl Choice for $name {
            const NAMES: &'static [&'static str] = &[$($text),*];
        }

        impl $name {
            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text),* }
            }
        }

        impl FromStr for $name {
            type Err = TrainError;
            fn from_str(s: &str) -> Result<Self> {
                match s { $($text => Ok($name::$variant),)* _ => Err(TrainError::invalid(format!(
                    "`{s}` is not one of {}", Self::NAMES.join(", ")))) }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_enum! {
    /// The optimizer over every parameter (the face recipe: two groups, backbone and head).
    OptimizerKind { #[default] Sgd = "sgd", Adamw = "adamw" }
}

named_enum! {
    /// What the model computes in; parameters and optimizer state stay float32 either way.
    Precision {
        #[default]
        F32 = "f32",
        /// bf16 autocast: layers compute in bf16 over float32 weights (no loss scaling needed).
        Bf16 = "bf16",
        /// f16 autocast with a GradScaler: dynamic loss scale, steps with inf/NaN gradients
        /// skipped, the scaler's state in every checkpoint.
        F16 = "f16",
    }
}

named_enum! {
    /// What `--fsdp` makes units of (the modules FSDP2's `fully_shard` is applied to before
    /// the whole model).
    FsdpUnits {
        /// A unit per block where the model has blocks (a ViT's blocks and its head, an
        /// IResNet's residual blocks), then the root; a model without them (mlp, cnn,
        /// resnet18, mbf) is one root unit.
        #[default]
        Blocks = "blocks",
        /// The whole model one unit (`fully_shard(model)` alone).
        Root = "root",
    }
}

named_enum! {
    /// Where each rank trains: the CPU, or GPU `LOCAL_RANK` of its host.
    DeviceKind { #[default] Cpu = "cpu", Cuda = "cuda" }
}

named_enum! {
    /// The collective backend: shm within a host and tcp across (auto), one of them, the MPI
    /// library of a job started by mpirun, or NCCL on the GPUs.
    Backend { #[default] Auto = "auto", Tcp = "tcp", Shm = "shm", Mpi = "mpi", Nccl = "nccl" }
}

named_enum! {
    /// The communication hook on Ddp's gradient buckets (PyTorch's built-in hooks).
    CommHook {
        /// Buckets all-reduced as they are.
        #[default]
        #[serde(rename = "none")]
        Off = "none",
        Fp16 = "fp16",
        Bf16 = "bf16",
        PowerSgd = "powersgd",
    }
}

/// The face recipe's margin (arcface_torch's CombinedMarginLoss `(m1, m2, m3)`): `arcface`
/// (= 1,0.5,0), `cosface` (= 1,0,0.4) or three numbers `M1,M2,M3`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Margin {
    ArcFace,
    CosFace,
    Combined(f64, f64, f64),
}

impl Margin {
    /// `(m1, m2, m3)`.
    pub fn parts(self) -> (f64, f64, f64) {
        match self {
            Margin::ArcFace => (1.0, 0.5, 0.0),
            Margin::CosFace => (1.0, 0.0, 0.4),
            Margin::Combined(m1, m2, m3) => (m1, m2, m3),
        }
    }
}

impl FromStr for Margin {
    type Err = TrainError;
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "arcface" => return Ok(Margin::ArcFace),
            "cosface" => return Ok(Margin::CosFace),
            _ => {}
        }
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        let numbers: Option<Vec<f64>> = parts.iter().map(|p| p.parse::<f64>().ok()).collect();
        match numbers.as_deref() {
            Some(&[m1, m2, m3]) if [m1, m2, m3].iter().all(|m| m.is_finite()) => {
                Ok(Margin::Combined(m1, m2, m3))
            }
            _ => tandem_train::bail_option!(
                "margin",
                Some(text.to_string()),
                "expected arcface, cosface or three numbers M1,M2,M3 (arcface = 1.0,0.5,0.0)"
            ),
        }
    }
}

impl std::fmt::Display for Margin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Margin::ArcFace => f.write_str("arcface"),
            Margin::CosFace => f.write_str("cosface"),
            Margin::Combined(m1, m2, m3) => write!(f, "{m1},{m2},{m3}"),
        }
    }
}

/// Where a run's data comes from: a classifier's dataset ([`DatasetSpec`]: `digits`,
/// `mnist:DIR`, `cifar10:DIR`, `synthetic...`), or the face recipe's insightface RecordIO
/// (`rec:DIR`) or image folders (`folder:DIR`, a sub-folder of 112x112 images per identity).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DataSource {
    Dataset(DatasetSpec),
    Rec(PathBuf),
    Folder(PathBuf),
}

impl DataSource {
    /// Face data (a RecordIO set or image folders).
    pub fn is_face(&self) -> bool {
        matches!(self, DataSource::Rec(_) | DataSource::Folder(_))
    }
}

impl FromStr for DataSource {
    type Err = TrainError;
    fn from_str(spec: &str) -> Result<Self> {
        let dir = |kind: &str, dir: &str| {
            if dir.is_empty() {
                tandem_train::bail_option!(
                    "data",
                    Some(spec.to_string()),
                    "{kind}: needs a directory after the colon"
                );
            }
            Ok(PathBuf::from(dir))
        };
        if let Some(d) = spec.strip_prefix("rec:") {
            return Ok(DataSource::Rec(dir("rec", d)?));
        }
        if let Some(d) = spec.strip_prefix("folder:") {
            return Ok(DataSource::Folder(dir("folder", d)?));
        }
        spec.parse::<DatasetSpec>().map(DataSource::Dataset).option("data", Some(spec.to_string()))
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Dataset(spec) => write!(f, "{spec}"),
            DataSource::Rec(dir) => write!(f, "rec:{}", dir.display()),
            DataSource::Folder(dir) => write!(f, "folder:{}", dir.display()),
        }
    }
}

/// Serde reads these from their text (`try_from = "String"`) and writes them as it.
macro_rules! text_serde {
    ($($name:ident),*) => {$(
        impl TryFrom<String> for $name {
            type Error = TrainError;
            fn try_from(text: String) -> Result<Self> {
                text.parse()
            }
        }
        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.to_string()
            }
        }
    )*};
}
text_serde!(Margin, DataSource);

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

impl DeviceKind {
    /// The device of the rank with this local rank.
    pub fn device(self, local_rank: usize) -> Result<candle_core::Device> {
        let location = match self {
            DeviceKind::Cpu => tandem_ckpt::MapLocation::Cpu,
            DeviceKind::Cuda => tandem_ckpt::MapLocation::Cuda(local_rank),
        };
        tandem_nn::convert::map_location_device(location)
            .with_context(|| format!("on local rank {local_rank}"))
            .option("device", Some(self.to_string()))
    }
}

impl Backend {
    /// The transport the process group is asked for (`None`: its own choice).
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

/// The loop: how long, where, and what it reports.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The run directory (the same on every rank): checkpoints, metrics, TensorBoard.
    pub dir: PathBuf,
    pub epochs: u64,
    /// Stop after this many optimizer steps (a schedule still spans `epochs`).
    pub max_steps: Option<u64>,
    /// Seed of every draw: initial weights, the sampler's shuffle, augmentation, sampling.
    pub seed: u64,
    /// Continue from the newest valid checkpoint in `dir`.
    pub resume: bool,
    /// TensorBoard scalars into `dir/tensorboard` (rank 0).
    pub tensorboard: bool,
    /// A text stored in every checkpoint as its `config` (the run's settings).
    pub record: String,
    /// Steps left out of the run's samples/s (one-off costs of the first steps).
    pub timing_warmup_steps: u64,
    /// A `training.log` line (arcface_torch's) every N steps; 0: no `training.log`.
    pub log_every: u64,
}

/// Checkpoints: when, how many, and the run's outputs.
#[derive(Clone, Debug)]
pub struct CheckpointOptions {
    /// Every N optimizer steps (0: at epoch ends only); always at the end.
    pub save_every: u64,
    pub keep_last: usize,
    /// Written by a background thread (the classifiers; training waits only for the copy).
    pub background: bool,
    /// False: no checkpoint is written at all (a benchmark or a throwaway run).
    pub enabled: bool,
    /// Initial weights (any wrapping; strict key check).
    pub init_from: Option<PathBuf>,
    /// The final weights (canonical keys, `.pt` or `.safetensors`), written by rank 0.
    pub save_final: Option<PathBuf>,
    /// The final model as ONNX, written by rank 0.
    pub export_onnx: Option<PathBuf>,
}

/// The data: where it comes from and how it is fed.
#[derive(Clone, Debug)]
pub struct DataOptions {
    pub source: DataSource,
    /// Samples per rank per step.
    pub batch_size: usize,
    pub shuffle: bool,
    /// Classifiers: random crop + flip; faces: flips.
    pub augment: bool,
    /// Classifiers: per-channel mean/std of the training set.
    pub normalize: bool,
    /// Background threads decoding batches (arcface_torch's `num_workers`); `None`: the
    /// recipe's default (2 for the face recipe, 1 for the classifier).
    pub num_workers: Option<usize>,
}

/// `--fsdp`: the model's parameters, gradients and optimizer state sharded over the ranks
/// (PyTorch FSDP2's `fully_shard`; tandem-fsdp).
#[derive(Clone, Debug, PartialEq)]
pub struct FsdpRunOptions {
    pub units: FsdpUnits,
    /// FSDP2's `reshard_after_forward`.
    pub reshard_after_forward: bool,
    /// Recompute each unit in backward instead of keeping its activations (`None`: as the
    /// model asks — arcface_torch's `using_checkpoint`, on for vit_b and vit_l).
    pub activation_checkpointing: Option<bool>,
    /// HSDP: the ranks form this many rows, each holding one copy of the model sharded over
    /// its ranks (1: plain FSDP over every rank).
    pub hsdp_rows: usize,
    /// FSDP2's `MixedPrecisionPolicy`: the dtype parameters are all-gathered in (the weights
    /// a unit computes with are the float32 masters rounded to it) and the one gradients are
    /// reduce-scattered in (`None`: `param_dtype`).
    pub param_dtype: Precision,
    pub reduce_dtype: Option<Precision>,
}

/// The model and where it runs.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    pub kind: ModelKind,
    /// The MLP's hidden width.
    pub hidden: usize,
    /// The ResNets' first-stage width.
    pub width: usize,
    /// SyncBatchNorm (resnet18).
    pub sync_batchnorm: bool,
    pub precision: Precision,
    pub device: DeviceKind,
    /// Shard the model (`None`: a replica per rank under Ddp).
    pub fsdp: Option<FsdpRunOptions>,
}

/// The optimizer and what happens around each of its steps.
#[derive(Clone, Debug)]
pub struct OptimOptions {
    pub kind: OptimizerKind,
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    /// ZeRO-1: optimizer state sharded over the ranks (classifiers).
    pub zero: bool,
    pub schedule: LrSchedule,
    /// Clip the model's (the face backbone's) gradient norm to this.
    pub clip_grad_norm: Option<f64>,
    /// GradScaler growth interval under f16 (default: 100 for the face recipe, 2000 otherwise).
    pub grad_scaler_growth_interval: Option<i64>,
}

/// Communication.
#[derive(Clone, Debug)]
pub struct CommOptions {
    pub backend: Backend,
    pub comm_hook: CommHook,
    /// Asked for live recovery (it needs `tandem run --live-recovery`'s launcher).
    pub live_recovery: bool,
    /// Under live recovery, state each rank holds alone (the face recipe's PartialFC rows,
    /// `--zero`'s optimizer shard) is mirrored to the next rank every N steps: a rank's death
    /// loses at most N - 1 steps of it.
    pub mirror_every: u64,
}

/// The face recipe's head and verification.
#[derive(Clone, Debug)]
pub struct FaceOptions {
    pub embedding_size: usize,
    pub margin: Margin,
    pub margin_scale: f64,
    pub sample_rate: f64,
    pub interclass_filtering_threshold: f64,
    /// Identities (default: the rec's header).
    pub num_classes: Option<usize>,
    /// Verification pair sets (`.bin`).
    pub val: Vec<PathBuf>,
    /// Verify every N steps (0: only at the end).
    pub verify_every: u64,
    /// Batches whose gradients are summed before each optimizer step (arcface_torch's
    /// `gradient_acc`; 1: a step per batch). The learning-rate schedule still moves every batch.
    pub gradient_acc: u64,
}

/// Everything a run of a built-in recipe needs.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub run: RunOptions,
    pub checkpoint: CheckpointOptions,
    pub data: DataOptions,
    pub model: ModelOptions,
    pub optim: OptimOptions,
    pub comm: CommOptions,
    pub face: FaceOptions,
}
