//! [`TrainConfig`]: the settings of a run of the built-in recipes as a person writes them —
//! `tandem train`'s flags (derived from it with the `clap` feature), the keys of a `--config`
//! file and of a run's `config.toml` — each with its doc, default and check, defined once.
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tandem_models::ModelKind;
use tandem_train::{bail_option, LrSchedule, Result, Warmup};

use crate::options::{
    Backend, CheckpointOptions, CommHook, CommOptions, DataOptions, DataSource, DatasetSpec,
    DeviceKind, FaceOptions, FsdpRunOptions, FsdpUnits, Margin, ModelOptions, OptimOptions,
    OptimizerKind, Precision, RunOptions, TrainOptions,
};

/// Parses a flag whose values are a library option's names (listed in `--help` and in the
/// error for any other value).
#[cfg(feature = "clap")]
pub fn choice<T: crate::options::Choice>() -> ChoiceParser<T> {
    ChoiceParser(std::marker::PhantomData)
}

#[cfg(feature = "clap")]
#[derive(Clone)]
pub struct ChoiceParser<T>(std::marker::PhantomData<T>);

#[cfg(feature = "clap")]
impl<T: crate::options::Choice> clap::builder::TypedValueParser for ChoiceParser<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let names = clap::builder::PossibleValuesParser::new(T::NAMES);
        let name = names.parse_ref(cmd, arg, value)?;
        name.parse::<T>().map_err(|_| clap::Error::new(clap::error::ErrorKind::InvalidValue))
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(T::NAMES.iter().map(|n| clap::builder::PossibleValue::new(*n))))
    }
}

/// How the learning rate moves, stepped after every optimizer step (arcface_torch's recipe).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum SchedulerKind {
    /// A constant --lr.
    #[default]
    None,
    /// insightface's PolyScheduler: linear warm-up from 0 over the warm-up steps, then
    /// `lr * (1 - progress)^2` to 0 at the last step.
    Poly,
    /// arcface_torch's PolynomialLRWarmup (what its train_v2.py uses today): linear warm-up to
    /// --lr over the warm-up steps, then `lr * (1 - progress)` to 0 at the last step.
    #[serde(rename = "polynomial-warmup")]
    #[cfg_attr(feature = "clap", value(name = "polynomial-warmup"))]
    PolynomialWarmup,
    /// torch's CosineAnnealingLR over the run's steps, down to 0.
    Cosine,
    /// torch's StepLR: times 0.1 every --lr-step-epochs epochs.
    Step,
}

/// What a run of the built-in recipes is asked to do, as a person writes it: every
/// `tandem train` flag (with the `clap` feature its `clap::Args` derive is the command line),
/// every key of a `--config` file and of the run's `config.toml` (the snake_case field names).
/// Each setting's doc, default ([`TrainConfig::default`]) and check ([`TrainConfig::validate`])
/// live here; [`TrainConfig::options`] gives the typed [`TrainOptions`] the recipes read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct TrainConfig {
    /// Ranks to start on this host (ignored when already launched by tandem run / torchrun).
    #[cfg_attr(feature = "clap", arg(long = "nproc-per-node", alias = "nproc_per_node", default_value_t = TrainConfig::default().nproc_per_node))]
    pub nproc_per_node: usize,
    /// Passes over the training data.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().epochs))]
    pub epochs: usize,
    /// Stop after this many optimizer steps (overrides --epochs when reached first; an
    /// --lr-scheduler still spans --epochs, so a run stopped early resumes on the same curve).
    #[cfg_attr(feature = "clap", arg(long))]
    pub steps: Option<u64>,
    /// Samples per rank per step, as in DDP (global batch = batch-size x world size).
    #[cfg_attr(feature = "clap", arg(long = "batch-size", default_value_t = TrainConfig::default().batch_size))]
    pub batch_size: usize,
    /// Learning rate.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().lr))]
    pub lr: f64,
    /// Optimizer.
    #[cfg_attr(feature = "clap", arg(long, value_parser = choice::<OptimizerKind>(), default_value_t = TrainConfig::default().optimizer))]
    pub optimizer: OptimizerKind,
    /// SGD momentum.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().momentum))]
    pub momentum: f64,
    /// Weight decay (SGD: L2 added to the gradient; AdamW: decoupled).
    #[cfg_attr(feature = "clap", arg(long = "weight-decay", default_value_t = TrainConfig::default().weight_decay))]
    pub weight_decay: f64,
    /// Model: a classifier (mlp, cnn, resnet18), or a face backbone (iresnet18 .. iresnet200 or
    /// arcface_torch's r18 .. r200, mbf, mbf_large) trained with a PartialFC margin head on
    /// `--data rec:DIR`.
    #[cfg_attr(feature = "clap", arg(long, value_parser = choice::<ModelKind>(), default_value_t = TrainConfig::default().model))]
    pub model: ModelKind,
    /// Hidden width of the MLP.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().hidden))]
    pub hidden: usize,
    /// Width of the ResNet's first stage (stages are w, 2w, 4w, 8w; torchvision's is 64).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().width))]
    pub width: usize,
    /// Synchronise BatchNorm statistics across ranks (PyTorch's SyncBatchNorm; resnet18 only).
    #[cfg_attr(feature = "clap", arg(long = "sync-batchnorm"))]
    pub sync_batchnorm: bool,
    /// What gradient buckets go through: `none` (f32 all-reduce average), `fp16` or `bf16`
    /// (compressed to 16 bits on the wire, PyTorch's fp16/bf16_compress_hook), `powersgd`
    /// (rank-2 PowerSGD with error feedback after 10 plain steps).
    #[cfg_attr(feature = "clap", arg(long = "comm-hook", value_name = "HOOK", value_parser = choice::<CommHook>(), default_value_t = TrainConfig::default().comm_hook))]
    pub comm_hook: CommHook,
    /// Normalise each image channel with the training set's mean and standard deviation.
    #[cfg_attr(feature = "clap", arg(long))]
    pub normalize: bool,
    /// Augment training images: random crop after 4-pixel zero padding, then random
    /// horizontal flip, drawn from --seed, the epoch and the example (same for any world size).
    #[cfg_attr(feature = "clap", arg(long))]
    pub augment: bool,
    /// Data: digits (embedded), mnist:DIR (IDX files), cifar10:DIR (binary batches),
    /// `synthetic[:N[:DIM[:CLASSES]]]` or `synthetic-cifar[:N]`; for the face models rec:DIR
    /// (insightface RecordIO) or folder:DIR (one sub-folder of 112x112 images per identity).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().data))]
    pub data: DataSource,
    /// Seed for model init and the sampler's shuffle.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().seed))]
    pub seed: u64,
    /// Keep the dataset order (no per-epoch shuffle).
    #[cfg_attr(feature = "clap", arg(long = "no-shuffle"))]
    pub no_shuffle: bool,
    /// Leave the first N steps out of the reported samples/s (their one-off costs: cuDNN's
    /// algorithm search, kernel compilation).
    #[cfg_attr(feature = "clap", arg(long = "timing-warmup-steps", default_value_t = TrainConfig::default().timing_warmup_steps))]
    pub timing_warmup_steps: u64,
    /// Threads decoding batches ahead of the step (arcface_torch's `num_workers`; default 2
    /// for the face models, 1 for the classifiers; 0 decodes on the training thread).
    #[cfg_attr(feature = "clap", arg(long = "num-workers"))]
    pub num_workers: Option<usize>,
    /// Run directory (default `runs/<model>-<data>-<timestamp>`).
    #[cfg_attr(feature = "clap", arg(long))]
    pub out: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (0: at the end of each epoch only).
    #[cfg_attr(feature = "clap", arg(long = "save-every", default_value_t = TrainConfig::default().save_every))]
    pub save_every: u64,
    /// Checkpoints to keep in the run directory.
    #[cfg_attr(feature = "clap", arg(long = "keep-last", default_value_t = TrainConfig::default().keep_last))]
    pub keep_last: usize,
    /// Write no checkpoint at all, not even at the end (a benchmark or a throwaway run: there
    /// is nothing to resume from, and --save-final still writes the final weights).
    #[cfg_attr(feature = "clap", arg(long = "no-checkpoints"))]
    pub no_checkpoints: bool,
    /// Write checkpoints on a background thread: training waits only while the state is copied
    /// to host memory. At most one save in flight; a failed write stops the run at the next save
    /// or at the end, naming the file.
    #[cfg_attr(feature = "clap", arg(long = "async-save"))]
    pub async_save: bool,
    /// Continue from the newest valid checkpoint in --out.
    #[cfg_attr(feature = "clap", arg(long))]
    pub resume: bool,
    /// Keep training through a rank's death: the survivors regroup and go on, a restarted rank
    /// joins at a step boundary and gets the whole training state from a peer (no checkpoint
    /// read), at most one step is redone. Under `tandem run --live-recovery` it is on by itself;
    /// run plainly, tandem train starts its ranks that way (with --max-restarts).
    #[cfg_attr(feature = "clap", arg(long = "live-recovery"))]
    pub live_recovery: bool,
    /// With --live-recovery and no outside launcher: times a dead rank is started again.
    #[cfg_attr(feature = "clap", arg(long = "max-restarts", default_value_t = TrainConfig::default().max_restarts))]
    pub max_restarts: u32,
    /// Initial weights from a PyTorch or tandem checkpoint (any wrapping; strict key check). A
    /// face backbone under --fsdp reads a .safetensors file row by row (each rank its rows).
    #[cfg_attr(feature = "clap", arg(long = "init-from"))]
    pub init_from: Option<PathBuf>,
    /// Write the final model weights here (.pt or .safetensors, canonical keys).
    #[cfg_attr(feature = "clap", arg(long = "save-final"))]
    pub save_final: Option<PathBuf>,
    /// Shard the optimizer state over the ranks (ZeRO-1, PyTorch's ZeroRedundancyOptimizer):
    /// each rank keeps the state of its share of the parameters; same weights as without.
    #[cfg_attr(feature = "clap", arg(long))]
    pub zero: bool,
    /// Shard the model over the ranks (PyTorch FSDP2's `fully_shard`): each rank keeps its
    /// rows of every parameter, their gradients and optimizer state, and gathers a block's
    /// weights only while the block runs. Checkpoints hold each rank's rows and resume on any
    /// world size (or under Ddp); `tandem ckpt convert --to dcp` writes FSDP2's layout.
    #[cfg_attr(feature = "clap", arg(long))]
    pub fsdp: bool,
    /// With --fsdp: `blocks` (a unit per block where the model has them: a ViT's blocks and
    /// head, an IResNet's residual blocks; then the root) or `root` (the whole model one unit).
    #[cfg_attr(feature = "clap", arg(long = "fsdp-units", value_parser = choice::<FsdpUnits>(), default_value_t = TrainConfig::default().fsdp_units))]
    pub fsdp_units: FsdpUnits,
    /// With --fsdp: free a unit's gathered weights after its forward and gather them again for
    /// its backward (true, FSDP2's default), or keep them until its backward (false).
    #[cfg_attr(feature = "clap", arg(long = "fsdp-reshard-after-forward", action = clap::ArgAction::Set, value_name = "BOOL", default_value_t = TrainConfig::default().fsdp_reshard_after_forward))]
    pub fsdp_reshard_after_forward: bool,
    /// With --fsdp: recompute each unit in backward instead of keeping its activations until
    /// then (true: the memory of the units' inputs, one more forward a step; false: FSDP2's
    /// default). Default: as the model asks (arcface_torch's `using_checkpoint`: vit_b, vit_l).
    #[cfg_attr(feature = "clap", arg(long = "fsdp-activation-checkpointing", action = clap::ArgAction::Set, value_name = "BOOL"))]
    pub fsdp_activation_checkpointing: Option<bool>,
    /// With --fsdp: HSDP — the ranks form this many rows, each a copy of the model sharded over
    /// its ranks (gradients reduce-scattered within a row, averaged across rows); 1: plain FSDP.
    #[cfg_attr(feature = "clap", arg(long = "hsdp-rows", default_value_t = TrainConfig::default().fsdp_hsdp_rows, value_name = "R"))]
    pub fsdp_hsdp_rows: usize,
    /// With --fsdp: the dtype parameters are all-gathered in (FSDP2's
    /// `MixedPrecisionPolicy.param_dtype`; the weights a block computes with are the float32
    /// master weights rounded to it; what it computes in is --precision's).
    #[cfg_attr(feature = "clap", arg(long = "fsdp-param-dtype", value_parser = choice::<Precision>(), default_value_t = TrainConfig::default().fsdp_param_dtype))]
    pub fsdp_param_dtype: Precision,
    /// With --fsdp: the dtype gradients are reduce-scattered in (`reduce_dtype`; default:
    /// --fsdp-param-dtype's).
    #[cfg_attr(feature = "clap", arg(long = "fsdp-reduce-dtype", value_parser = choice::<Precision>()))]
    pub fsdp_reduce_dtype: Option<Precision>,
    /// At the end, rank 0 writes the trained model (eval mode) as ONNX here.
    #[cfg_attr(feature = "clap", arg(long = "export-onnx", value_name = "FILE"))]
    pub export_onnx: Option<PathBuf>,
    /// Mixed precision (PyTorch's autocast + GradScaler recipe). The MLP computes in 16 bits;
    /// the convolution nets' kernels compute in f32 inside, their input and output (the face
    /// models: embeddings and PartialFC logits) pass through the 16-bit type.
    #[cfg_attr(feature = "clap", arg(long, value_parser = choice::<Precision>(), default_value_t = TrainConfig::default().precision))]
    pub precision: Precision,
    /// Collective backend. nccl reduces CUDA gradients on the GPUs (with --device cuda); the
    /// others stage them through host memory.
    #[cfg_attr(feature = "clap", arg(long, value_parser = choice::<Backend>(), default_value_t = TrainConfig::default().backend))]
    pub backend: Backend,
    /// Where each rank trains: cpu, or cuda (rank r on GPU LOCAL_RANK).
    #[cfg_attr(feature = "clap", arg(long, value_parser = choice::<DeviceKind>(), default_value_t = TrainConfig::default().device))]
    pub device: DeviceKind,
    /// Write TensorBoard event files (loss, lr, accuracy, samples/s) into the run directory.
    #[cfg_attr(feature = "clap", arg(long))]
    pub tensorboard: bool,
    /// Learning-rate schedule, stepped after every optimizer step.
    #[cfg_attr(feature = "clap", arg(long = "lr-scheduler", value_enum, default_value_t = TrainConfig::default().lr_scheduler))]
    pub lr_scheduler: SchedulerKind,
    /// Linear warm-up steps of --lr-scheduler poly.
    #[cfg_attr(feature = "clap", arg(long = "warmup-steps", conflicts_with = "warmup_epochs"))]
    pub warmup_steps: Option<u64>,
    /// Warm-up in epochs of --lr-scheduler poly (arcface_torch's `warmup_epoch`: this many
    /// times images / global batch steps).
    #[cfg_attr(feature = "clap", arg(long = "warmup-epochs"))]
    pub warmup_epochs: Option<u64>,
    /// Epochs between the x0.1 decays of --lr-scheduler step.
    #[cfg_attr(feature = "clap", arg(long = "lr-step-epochs", default_value_t = TrainConfig::default().lr_step_epochs))]
    pub lr_step_epochs: u64,
    /// Clip the gradient norm of the model (the face backbone, not its head, as arcface_torch)
    /// to this value before every step.
    #[cfg_attr(feature = "clap", arg(long = "clip-grad-norm"))]
    pub clip_grad_norm: Option<f64>,
    /// GradScaler growth interval with --precision f16 (default: 100 for the face models as
    /// arcface_torch, torch's 2000 otherwise).
    #[cfg_attr(feature = "clap", arg(long = "grad-scaler-growth-interval"))]
    pub grad_scaler_growth_interval: Option<i64>,
    /// Face models: the embedding width.
    #[cfg_attr(feature = "clap", arg(long = "embedding-size", default_value_t = TrainConfig::default().embedding_size))]
    pub embedding_size: usize,
    /// Face models: the margin, `arcface` (= 1,0.5,0), `cosface` (= 1,0,0.4) or `M1,M2,M3` of
    /// arcface_torch's CombinedMarginLoss.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().margin))]
    pub margin: Margin,
    /// Face models: the logit scale s of the margin loss.
    #[cfg_attr(feature = "clap", arg(long = "margin-scale", default_value_t = TrainConfig::default().margin_scale))]
    pub margin_scale: f64,
    /// Face models: the fraction of each rank's class centres sampled per step (PartialFC; 0:
    /// a batch's positive classes only, as arcface_torch).
    #[cfg_attr(feature = "clap", arg(long = "sample-rate", default_value_t = TrainConfig::default().sample_rate))]
    pub sample_rate: f64,
    /// Face models: non-target cosines above this are zeroed (0: off).
    #[cfg_attr(feature = "clap", arg(long = "interclass-filtering-threshold", default_value_t = TrainConfig::default().interclass_filtering_threshold))]
    pub interclass_filtering_threshold: f64,
    /// Face models: batches whose gradients are summed before each optimizer step
    /// (arcface_torch's `gradient_acc`); the learning-rate schedule still moves every batch.
    #[cfg_attr(feature = "clap", arg(long = "gradient-acc", default_value_t = TrainConfig::default().gradient_acc))]
    pub gradient_acc: u64,
    /// Face models: the number of identities (default: from the rec's header record).
    #[cfg_attr(feature = "clap", arg(long = "num-classes"))]
    pub num_classes: Option<usize>,
    /// Face models: a verification pair set (insightface `.bin`), repeatable; evaluated every
    /// --verbose steps and at the end.
    #[cfg_attr(feature = "clap", arg(long = "val", value_name = "FILE.bin"))]
    pub val: Vec<PathBuf>,
    /// Face models: run the verification sets every N steps (0: only at the end).
    #[cfg_attr(feature = "clap", arg(long, default_value_t = TrainConfig::default().verbose))]
    pub verbose: u64,
    /// Under --live-recovery: state each rank holds alone (the face recipe's class centres
    /// with their optimizer state, --zero's optimizer shard) is mirrored to the next rank every
    /// N steps; a rank's death loses at most N - 1 steps of it. Each mirror sends one shard.
    #[cfg_attr(feature = "clap", arg(long = "mirror-every", default_value_t = TrainConfig::default().mirror_every, value_name = "N"))]
    pub mirror_every: u64,
    /// A line in RUN/training.log every N steps, arcface_torch's log (its `frequent`): speed,
    /// loss average, lr, epoch, global step, f16 grad scale, hours left; and the verification
    /// sets' XNorm, Accuracy-Flip and Accuracy-Highest lines. 0: no training.log.
    #[cfg_attr(feature = "clap", arg(long = "log-every", default_value_t = TrainConfig::default().log_every, value_name = "N"))]
    pub log_every: u64,
    /// Settings from a TOML file whose keys are these flags' names (`batch-size = 128`), or
    /// arcface_torch's Python config (`configs/ms1mv3_r50.py`: its `config.key = value` lines
    /// over base.py's defaults, read as data); a flag given on the command line wins.
    #[serde(skip)]
    #[cfg_attr(feature = "clap", arg(long, value_name = "FILE.toml|FILE.py"))]
    pub config: Option<PathBuf>,
}

impl Default for TrainConfig {
    /// Every setting's default: what `tandem train` does with no flags (the MLP on the
    /// embedded digits, 2 ranks, 20 epochs).
    fn default() -> Self {
        TrainConfig {
            nproc_per_node: 2,
            epochs: 20,
            steps: None,
            batch_size: 32,
            lr: 0.05,
            optimizer: OptimizerKind::Sgd,
            momentum: 0.9,
            weight_decay: 0.0,
            model: ModelKind::Mlp,
            hidden: 128,
            width: 64,
            sync_batchnorm: false,
            comm_hook: CommHook::Off,
            normalize: false,
            augment: false,
            data: DataSource::Dataset(DatasetSpec::Digits),
            seed: 0,
            no_shuffle: false,
            timing_warmup_steps: 0,
            num_workers: None,
            out: None,
            save_every: 0,
            keep_last: 3,
            no_checkpoints: false,
            async_save: false,
            resume: false,
            live_recovery: false,
            max_restarts: 0,
            init_from: None,
            save_final: None,
            zero: false,
            fsdp: false,
            fsdp_units: FsdpUnits::Blocks,
            fsdp_reshard_after_forward: true,
            fsdp_activation_checkpointing: None,
            fsdp_hsdp_rows: 1,
            fsdp_param_dtype: Precision::F32,
            fsdp_reduce_dtype: None,
            export_onnx: None,
            precision: Precision::F32,
            backend: Backend::Auto,
            device: DeviceKind::Cpu,
            tensorboard: false,
            lr_scheduler: SchedulerKind::None,
            warmup_steps: None,
            warmup_epochs: None,
            lr_step_epochs: 10,
            clip_grad_norm: None,
            grad_scaler_growth_interval: None,
            embedding_size: 512,
            margin: Margin::ArcFace,
            margin_scale: 64.0,
            sample_rate: 1.0,
            interclass_filtering_threshold: 0.0,
            gradient_acc: 1,
            num_classes: None,
            val: Vec::new(),
            verbose: 2000,
            mirror_every: 10,
            log_every: 10,
            config: None,
        }
    }
}

impl TrainConfig {
    fn warmup(&self) -> Warmup {
        match (self.warmup_steps, self.warmup_epochs) {
            (Some(s), _) => Warmup::Steps(s),
            (None, Some(e)) => Warmup::Epochs(e),
            (None, None) => Warmup::None,
        }
    }

    /// `--lr-scheduler` with its warm-up and step length, as the library's schedule.
    pub fn lr_schedule(&self) -> LrSchedule {
        match self.lr_scheduler {
            SchedulerKind::None => LrSchedule::Constant,
            SchedulerKind::Poly => LrSchedule::Poly { warmup: self.warmup() },
            SchedulerKind::PolynomialWarmup => {
                LrSchedule::PolynomialWarmup { warmup: self.warmup() }
            }
            SchedulerKind::Cosine => LrSchedule::Cosine,
            SchedulerKind::Step => LrSchedule::Step { every_epochs: self.lr_step_epochs },
        }
    }

    /// The `fsdp_*` settings (whether or not `fsdp` is on).
    fn fsdp_settings(&self) -> FsdpRunOptions {
        FsdpRunOptions {
            units: self.fsdp_units,
            reshard_after_forward: self.fsdp_reshard_after_forward,
            activation_checkpointing: self.fsdp_activation_checkpointing,
            hsdp_rows: self.fsdp_hsdp_rows,
            param_dtype: self.fsdp_param_dtype,
            reduce_dtype: self.fsdp_reduce_dtype,
        }
    }

    /// The settings as the recipes' typed options, the run directory `dir` ([`Self::run_dir`]
    /// picks one). Its `record` (what every checkpoint stores as the run's `config`) is empty:
    /// the caller writes the settings there in its own format.
    pub fn options(&self, dir: PathBuf) -> Result<TrainOptions> {
        Ok(TrainOptions {
            run: RunOptions {
                dir,
                epochs: self.epochs as u64,
                max_steps: self.steps,
                seed: self.seed,
                resume: self.resume,
                tensorboard: self.tensorboard,
                record: String::new(),
                timing_warmup_steps: self.timing_warmup_steps,
                log_every: self.log_every,
            },
            checkpoint: CheckpointOptions {
                save_every: self.save_every,
                keep_last: self.keep_last,
                background: self.async_save,
                enabled: !self.no_checkpoints,
                init_from: self.init_from.clone(),
                save_final: self.save_final.clone(),
                export_onnx: self.export_onnx.clone(),
            },
            data: DataOptions {
                source: self.data.clone(),
                batch_size: self.batch_size,
                shuffle: !self.no_shuffle,
                augment: self.augment,
                normalize: self.normalize,
                num_workers: self.num_workers,
            },
            model: ModelOptions {
                kind: self.model,
                hidden: self.hidden,
                width: self.width,
                sync_batchnorm: self.sync_batchnorm,
                precision: self.precision,
                device: self.device,
                fsdp: self.fsdp.then(|| self.fsdp_settings()),
            },
            optim: OptimOptions {
                kind: self.optimizer,
                lr: self.lr,
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                zero: self.zero,
                schedule: self.lr_schedule(),
                clip_grad_norm: self.clip_grad_norm,
                grad_scaler_growth_interval: self.grad_scaler_growth_interval,
            },
            comm: CommOptions {
                backend: self.backend,
                comm_hook: self.comm_hook,
                live_recovery: self.live_recovery,
                mirror_every: self.mirror_every,
            },
            face: FaceOptions {
                embedding_size: self.embedding_size,
                margin: self.margin,
                margin_scale: self.margin_scale,
                sample_rate: self.sample_rate,
                interclass_filtering_threshold: self.interclass_filtering_threshold,
                num_classes: self.num_classes,
                val: self.val.clone(),
                verify_every: self.verbose,
                gradient_acc: self.gradient_acc,
            },
        })
    }

    /// Rejects settings that cannot train, naming the setting at fault (by its key): those
    /// that combine or are texts to parse here, the rest in [`TrainOptions::validate`].
    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            bail_option!("nproc_per_node", None, "must be at least 1");
        }
        if self.resume && self.out.is_none() {
            bail_option!("resume", None, "needs `out`, the run directory to continue");
        }
        let warmup = self.warmup_steps.is_some() || self.warmup_epochs.is_some();
        let warms_up =
            matches!(self.lr_scheduler, SchedulerKind::Poly | SchedulerKind::PolynomialWarmup);
        if warmup && !warms_up {
            bail_option!(
                "warmup_steps",
                None,
                "a warm-up (steps or epochs) is part of `lr_scheduler` poly or \
                 polynomial-warmup (name one)"
            );
        }
        if !self.fsdp && self.fsdp_settings() != TrainConfig::default().fsdp_settings() {
            bail_option!(
                "fsdp",
                None,
                "`fsdp_units`, `fsdp_reshard_after_forward`, `fsdp_activation_checkpointing`, \
                 `hsdp_rows` and the `fsdp_*_dtype`s \
                 are settings of a sharded model: add `fsdp`"
            );
        }
        if self.fsdp_hsdp_rows == 0 {
            bail_option!("hsdp_rows", None, "must be at least 1 (1: plain FSDP)");
        }
        if self.lr_scheduler == SchedulerKind::Step && self.lr_step_epochs == 0 {
            bail_option!("lr_step_epochs", None, "must be at least 1");
        }
        // (`options` parses --margin for the face models.)
        self.options(PathBuf::new())?.validate()?;
        Ok(())
    }

    /// The run directory: `out`, or `runs/<model>-<data>-<unix seconds>`.
    pub fn run_dir(&self) -> PathBuf {
        if let Some(out) = &self.out {
            return out.clone();
        }
        let data = self.data.to_string();
        let data = data.split(':').next().unwrap_or("data");
        let model = self.model.name();
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from("runs").join(format!("{model}-{data}-{secs}"))
    }
}

#[cfg(test)]
mod tests {
    use tandem_train::TrainError;

    use super::*;

    fn key_of(e: TrainError) -> &'static str {
        match e {
            TrainError::Option { key, .. } => key,
            other => panic!("not an option's error: {other}"),
        }
    }

    #[test]
    fn the_defaults_train_and_each_refusal_names_its_setting() {
        let cfg = TrainConfig::default();
        cfg.validate().unwrap();
        let options = cfg.options(PathBuf::from("run")).unwrap();
        assert_eq!((options.run.epochs, options.data.batch_size), (20, 32));
        assert_eq!(options.optim.schedule, LrSchedule::Constant);
        let refused = |cfg: TrainConfig| key_of(cfg.validate().unwrap_err());
        assert_eq!(
            refused(TrainConfig { nproc_per_node: 0, ..TrainConfig::default() }),
            "nproc_per_node"
        );
        assert_eq!(refused(TrainConfig { resume: true, ..TrainConfig::default() }), "resume");
        let warmup = TrainConfig { warmup_steps: Some(5), ..TrainConfig::default() };
        assert_eq!(refused(warmup), "warmup_steps");
        let poly = TrainConfig {
            lr_scheduler: SchedulerKind::Poly,
            warmup_epochs: Some(2),
            ..TrainConfig::default()
        };
        let schedule = poly.options(PathBuf::new()).unwrap().optim.schedule;
        assert_eq!(schedule, LrSchedule::Poly { warmup: Warmup::Epochs(2) });
        // Text becomes a typed value once, at the edge; bad text names its setting there.
        assert_eq!(key_of("1,2".parse::<Margin>().unwrap_err()), "margin");
        assert_eq!("cosface".parse::<Margin>().unwrap().parts(), (1.0, 0.0, 0.4));
        let combined = "1, 0.3, 0.2".parse::<Margin>().unwrap();
        assert_eq!(combined.parts(), (1.0, 0.3, 0.2));
        assert_eq!(combined.to_string().parse::<Margin>().unwrap(), combined);
        assert_eq!(key_of("rec:".parse::<DataSource>().unwrap_err()), "data");
        assert_eq!(key_of("nosuch".parse::<DataSource>().unwrap_err()), "data");
        for spec in ["rec:/data/ms1m", "folder:faces", "digits", "synthetic:40:5:3", "mnist:m"] {
            assert_eq!(spec.parse::<DataSource>().unwrap().to_string(), spec);
        }
        assert_eq!("synthetic".parse::<DataSource>().unwrap().to_string(), "synthetic:10000:64:10");
        assert_eq!("powersgd".parse::<CommHook>().unwrap(), CommHook::PowerSgd);
        assert!("fp8".parse::<CommHook>().is_err());
        // A config file holds the same text (here over the defaults, as the CLI merges it).
        let mut file = serde_json::to_value(TrainConfig::default()).unwrap();
        assert_eq!((&file["data"], &file["margin"]), (&"digits".into(), &"arcface".into()));
        (file["data"], file["margin"], file["comm_hook"]) =
            ("rec:/d".into(), "cosface".into(), "fp16".into());
        let cfg: TrainConfig = serde_json::from_value(file).unwrap();
        assert_eq!(cfg.data, DataSource::Rec(PathBuf::from("/d")));
        assert_eq!((cfg.margin, cfg.comm_hook), (Margin::CosFace, CommHook::Fp16));
    }
}
