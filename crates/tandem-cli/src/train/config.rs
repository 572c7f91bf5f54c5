//! The training job's settings: command-line flags, their validation, and the `config.toml`
//! written into every run directory (the effective settings, so a run can be reproduced).
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
pub use tandem::models::ModelKind;
use tandem::recipes::face;
pub use tandem::recipes::options::{Backend, DeviceKind, OptimizerKind, Precision};
use tandem::recipes::options::{Choice, TrainOptions};

/// The `tandem train` flag of a training-library option key (`TrainError::Option`'s): each
/// key is its `--config` key, and each flag that key with dashes.
pub fn flag_of(key: &str) -> String {
    format!("--{}", key.replace('_', "-"))
}

/// Parses a flag whose values are a library option's names (listed in `--help` and in the
/// error for any other value).
pub fn choice<T: Choice>() -> ChoiceParser<T> {
    ChoiceParser(std::marker::PhantomData)
}

#[derive(Clone)]
pub struct ChoiceParser<T>(std::marker::PhantomData<T>);

impl<T: Choice> clap::builder::TypedValueParser for ChoiceParser<T> {
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
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
    #[value(name = "polynomial-warmup")]
    PolynomialWarmup,
    /// torch's CosineAnnealingLR over the run's steps, down to 0.
    Cosine,
    /// torch's StepLR: times 0.1 every --lr-step-epochs epochs.
    Step,
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
    /// Stop after this many optimizer steps (overrides --epochs when reached first; an
    /// --lr-scheduler still spans --epochs, so a run stopped early resumes on the same curve).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Samples per rank per step, as in DDP (global batch = batch-size x world size).
    #[arg(long = "batch-size", default_value_t = 32)]
    pub batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    pub lr: f64,
    /// Optimizer.
    #[arg(long, value_parser = choice::<OptimizerKind>(), default_value = "sgd")]
    pub optimizer: OptimizerKind,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (SGD: L2 added to the gradient; AdamW: decoupled).
    #[arg(long = "weight-decay", default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Model: a classifier (mlp, cnn, resnet18), or a face backbone (iresnet18 .. iresnet200 or
    /// arcface_torch's r18 .. r200, mbf, mbf_large) trained with a PartialFC margin head on
    /// `--data rec:DIR`.
    #[arg(long, value_parser = choice::<ModelKind>(), default_value = "mlp")]
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
    /// synthetic[:N[:DIM[:CLASSES]]] or synthetic-cifar[:N]; for the face models rec:DIR
    /// (insightface RecordIO) or folder:DIR (one sub-folder of 112x112 images per identity).
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Seed for model init and the sampler's shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep the dataset order (no per-epoch shuffle).
    #[arg(long = "no-shuffle")]
    pub no_shuffle: bool,
    /// Leave the first N steps out of the reported samples/s (their one-off costs: cuDNN's
    /// algorithm search, kernel compilation).
    #[arg(long = "timing-warmup-steps", default_value_t = 0)]
    pub timing_warmup_steps: u64,
    /// Threads decoding batches ahead of the step (arcface_torch's `num_workers`; default 2
    /// for the face models, 1 for the classifiers; 0 decodes on the training thread).
    #[arg(long = "num-workers")]
    pub num_workers: Option<usize>,
    /// Run directory (default runs/<model>-<data>-<timestamp>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (0: at the end of each epoch only).
    #[arg(long = "save-every", default_value_t = 0)]
    pub save_every: u64,
    /// Checkpoints to keep in the run directory.
    #[arg(long = "keep-last", default_value_t = 3)]
    pub keep_last: usize,
    /// Write no checkpoint at all, not even at the end (a benchmark or a throwaway run: there
    /// is nothing to resume from, and --save-final still writes the final weights).
    #[arg(long = "no-checkpoints")]
    pub no_checkpoints: bool,
    /// Write checkpoints on a background thread: training waits only while the state is copied
    /// to host memory. At most one save in flight; a failed write stops the run at the next save
    /// or at the end, naming the file.
    #[arg(long = "async-save")]
    pub async_save: bool,
    /// Continue from the newest valid checkpoint in --out.
    #[arg(long)]
    pub resume: bool,
    /// Keep training through a rank's death: the survivors regroup and go on, a restarted rank
    /// joins at a step boundary and gets the whole training state from a peer (no checkpoint
    /// read), at most one step is redone. Under `tandem run --live-recovery` it is on by itself;
    /// run plainly, tandem train starts its ranks that way (with --max-restarts).
    #[arg(long = "live-recovery")]
    pub live_recovery: bool,
    /// With --live-recovery and no outside launcher: times a dead rank is started again.
    #[arg(long = "max-restarts", default_value_t = 0)]
    pub max_restarts: u32,
    /// Initial weights from a PyTorch or tandem checkpoint (any wrapping; strict key check).
    #[arg(long = "init-from")]
    pub init_from: Option<PathBuf>,
    /// Write the final model weights here (.pt or .safetensors, canonical keys).
    #[arg(long = "save-final")]
    pub save_final: Option<PathBuf>,
    /// Shard the optimizer state over the ranks (ZeRO-1, PyTorch's ZeroRedundancyOptimizer):
    /// each rank keeps the state of its share of the parameters; same weights as without.
    #[arg(long)]
    pub zero: bool,
    /// At the end, rank 0 writes the trained model (eval mode) as ONNX here.
    #[arg(long = "export-onnx", value_name = "FILE")]
    pub export_onnx: Option<PathBuf>,
    /// Mixed precision (PyTorch's autocast + GradScaler recipe). The MLP computes in 16 bits;
    /// the convolution nets' kernels compute in f32 inside, their input and output (the face
    /// models: embeddings and PartialFC logits) pass through the 16-bit type.
    #[arg(long, value_parser = choice::<Precision>(), default_value = "f32")]
    pub precision: Precision,
    /// Collective backend. nccl reduces CUDA gradients on the GPUs (with --device cuda); the
    /// others stage them through host memory.
    #[arg(long, value_parser = choice::<Backend>(), default_value = "auto")]
    pub backend: Backend,
    /// Where each rank trains: cpu, or cuda (rank r on GPU LOCAL_RANK).
    #[arg(long, value_parser = choice::<DeviceKind>(), default_value = "cpu")]
    pub device: DeviceKind,
    /// Write TensorBoard event files (loss, lr, accuracy, samples/s) into the run directory.
    #[arg(long)]
    pub tensorboard: bool,
    /// Learning-rate schedule, stepped after every optimizer step.
    #[arg(long = "lr-scheduler", value_enum, default_value_t = SchedulerKind::None)]
    pub lr_scheduler: SchedulerKind,
    /// Linear warm-up steps of --lr-scheduler poly.
    #[arg(long = "warmup-steps", conflicts_with = "warmup_epochs")]
    pub warmup_steps: Option<u64>,
    /// Warm-up in epochs of --lr-scheduler poly (arcface_torch's `warmup_epoch`: this many
    /// times images / global batch steps).
    #[arg(long = "warmup-epochs")]
    pub warmup_epochs: Option<u64>,
    /// Epochs between the x0.1 decays of --lr-scheduler step.
    #[arg(long = "lr-step-epochs", default_value_t = 10)]
    pub lr_step_epochs: u64,
    /// Clip the gradient norm of the model (the face backbone, not its head, as arcface_torch)
    /// to this value before every step.
    #[arg(long = "clip-grad-norm")]
    pub clip_grad_norm: Option<f64>,
    /// GradScaler growth interval with --precision f16 (default: 100 for the face models as
    /// arcface_torch, torch's 2000 otherwise).
    #[arg(long = "grad-scaler-growth-interval")]
    pub grad_scaler_growth_interval: Option<i64>,
    /// Face models: the embedding width.
    #[arg(long = "embedding-size", default_value_t = 512)]
    pub embedding_size: usize,
    /// Face models: the margin, `arcface` (= 1,0.5,0), `cosface` (= 1,0,0.4) or `M1,M2,M3` of
    /// arcface_torch's CombinedMarginLoss.
    #[arg(long, default_value = "arcface")]
    pub margin: String,
    /// Face models: the logit scale s of the margin loss.
    #[arg(long = "margin-scale", default_value_t = 64.0)]
    pub margin_scale: f64,
    /// Face models: the fraction of each rank's class centres sampled per step (PartialFC).
    #[arg(long = "sample-rate", default_value_t = 1.0)]
    pub sample_rate: f64,
    /// Face models: non-target cosines above this are zeroed (0: off).
    #[arg(long = "interclass-filtering-threshold", default_value_t = 0.0)]
    pub interclass_filtering_threshold: f64,
    /// Face models: batches whose gradients are summed before each optimizer step
    /// (arcface_torch's `gradient_acc`); the learning-rate schedule still moves every batch.
    #[arg(long = "gradient-acc", default_value_t = 1)]
    pub gradient_acc: u64,
    /// Face models: the number of identities (default: from the rec's header record).
    #[arg(long = "num-classes")]
    pub num_classes: Option<usize>,
    /// Face models: a verification pair set (insightface `.bin`), repeatable; evaluated every
    /// --verbose steps and at the end.
    #[arg(long = "val", value_name = "FILE.bin")]
    pub val: Vec<PathBuf>,
    /// Face models: run the verification sets every N steps (0: only at the end).
    #[arg(long, default_value_t = 2000)]
    pub verbose: u64,
    /// Under --live-recovery: state each rank holds alone (the face recipe's class centres
    /// with their optimizer state, --zero's optimizer shard) is mirrored to the next rank every
    /// N steps; a rank's death loses at most N - 1 steps of it. Each mirror sends one shard.
    #[arg(long = "mirror-every", default_value_t = 10, value_name = "N")]
    pub mirror_every: u64,
    /// A line in RUN/training.log every N steps, arcface_torch's log (its `frequent`): speed,
    /// loss average, lr, epoch, global step, f16 grad scale, hours left; and the verification
    /// sets' XNorm, Accuracy-Flip and Accuracy-Highest lines. 0: no training.log.
    #[arg(long = "log-every", default_value_t = 10, value_name = "N")]
    pub log_every: u64,
    /// Settings from a TOML file whose keys are these flags' names (`batch-size = 128`), or
    /// arcface_torch's Python config (`configs/ms1mv3_r50.py`: its `config.key = value` lines
    /// over base.py's defaults, read as data); a flag given on the command line wins.
    #[arg(long, value_name = "FILE.toml|FILE.py")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
}

/// arcface_torch's CombinedMarginLoss `(m1, m2, m3)` from `--margin`.
pub fn parse_margin(text: &str) -> anyhow::Result<(f64, f64, f64)> {
    match text {
        "arcface" => return Ok((1.0, 0.5, 0.0)),
        "cosface" => return Ok((1.0, 0.0, 0.4)),
        _ => {}
    }
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let numbers: Option<Vec<f64>> = parts.iter().map(|p| p.parse::<f64>().ok()).collect();
    match numbers.as_deref() {
        Some(&[m1, m2, m3]) if [m1, m2, m3].iter().all(|m| m.is_finite()) => Ok((m1, m2, m3)),
        _ => bail!("--margin {text}: expected arcface, cosface or three numbers M1,M2,M3 (arcface = 1.0,0.5,0.0)"),
    }
}

impl TrainConfig {
    fn warmup(&self) -> tandem::train::Warmup {
        use tandem::train::Warmup;
        match (self.warmup_steps, self.warmup_epochs) {
            (Some(s), _) => Warmup::Steps(s),
            (None, Some(e)) => Warmup::Epochs(e),
            (None, None) => Warmup::None,
        }
    }

    /// `--lr-scheduler` with its warm-up and step length, as the library's schedule.
    pub fn lr_schedule(&self) -> tandem::train::LrSchedule {
        use tandem::train::LrSchedule;
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

    /// The flags as the library's options, the run directory `dir`.
    pub fn options(&self, dir: PathBuf) -> anyhow::Result<TrainOptions> {
        use tandem::recipes::options::*;
        Ok(TrainOptions {
            run: RunOptions {
                dir,
                epochs: self.epochs as u64,
                max_steps: self.steps,
                seed: self.seed,
                resume: self.resume,
                tensorboard: self.tensorboard,
                record: self.to_toml()?,
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
                spec: self.data.clone(),
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
                comm_hook: self.comm_hook.clone(),
                live_recovery: self.live_recovery,
                mirror_every: self.mirror_every,
            },
            face: FaceOptions {
                embedding_size: self.embedding_size,
                margin: if self.model.is_face() {
                    parse_margin(&self.margin)?
                } else {
                    (1.0, 0.5, 0.0)
                },
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

    /// Rejects settings that cannot train, naming the flag at fault: what only the command
    /// line can get wrong (flags that combine, texts to parse) here, the rest by the library
    /// (`TrainOptions::validate`, whose option keys `error_chain` names as flags).
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.nproc_per_node == 0 {
            bail!("--nproc-per-node must be at least 1");
        }
        if self.resume && self.out.is_none() {
            bail!("--resume needs --out DIR (the run directory to continue)");
        }
        let warmup = self.warmup_steps.is_some() || self.warmup_epochs.is_some();
        let warms_up =
            matches!(self.lr_scheduler, SchedulerKind::Poly | SchedulerKind::PolynomialWarmup);
        if warmup && !warms_up {
            bail!(
                "--warmup-steps/--warmup-epochs: warm-up is part of --lr-scheduler poly or \
                 polynomial-warmup (add one)"
            );
        }
        if self.lr_scheduler == SchedulerKind::Step && self.lr_step_epochs == 0 {
            bail!("--lr-step-epochs must be at least 1");
        }
        // (`options` parses --margin for the face models.)
        self.options(PathBuf::new())?.validate()?;
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
}

/// A setting of arcface_torch's config as the TOML value a `--config` file would hold.
fn toml_value(v: face::config::PyValue) -> toml::Value {
    use face::config::PyValue;
    match v {
        PyValue::Int(i) => toml::Value::Integer(i),
        PyValue::Float(x) => toml::Value::Float(x),
        PyValue::Str(s) => toml::Value::String(s),
        PyValue::Bool(b) => toml::Value::Boolean(b),
        // (`to_settings` gives no None: an unset option is left out.)
        PyValue::None => toml::Value::String("None".into()),
        PyValue::List(items) => toml::Value::Array(items.into_iter().map(toml_value).collect()),
    }
}

/// `--config FILE.toml`: settings whose keys are the flags' long names (`batch-size = 128`;
/// the snake_case names of a run's own `config.toml` work too), or `--config FILE.py`:
/// arcface_torch's Python config (see `tandem::recipes::face::config`). A flag given on the command
/// line wins over the file; an unknown key, a nested `config` or a value of the wrong type is
/// an error naming the file and the key.
pub fn apply_config_file(
    cfg: TrainConfig,
    matches: &clap::ArgMatches,
) -> anyhow::Result<TrainConfig> {
    use clap::parser::ValueSource;
    let Some(path) = cfg.config.clone() else { return Ok(cfg) };
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {shown}"))?;
    // arcface_torch's Python configs, or TOML whose keys are the flags' names.
    let file: Vec<(String, toml::Value)> = if path.extension().is_some_and(|e| e == "py") {
        let settings = face::config::read_settings(&path).context("--config")?;
        settings.into_iter().map(|(key, v)| (key.to_string(), toml_value(v))).collect()
    } else {
        let table: toml::Table =
            text.parse().with_context(|| format!("--config {shown}: not valid TOML"))?;
        table.into_iter().collect()
    };
    let command = <TrainConfig as clap::Args>::augment_args(clap::Command::new("train"));
    let mut table = match toml::Value::try_from(&cfg).context("serialising the settings")? {
        toml::Value::Table(t) => t,
        _ => bail!("the settings did not serialise to a table"),
    };
    for (key, value) in file {
        let arg = command.get_arguments().find(|a| {
            a.get_long() == Some(key.as_str()) || a.get_id().as_str() == key.replace('-', "_")
        });
        let Some(arg) = arg else {
            bail!(
                "--config {shown}: unknown key `{key}` (keys are `tandem train` flags without \
                 the dashes, such as `batch-size` or `lr-scheduler`)"
            );
        };
        let id = arg.get_id().as_str();
        if id == "config" {
            bail!("--config {shown}: a config file cannot name another (`{key}`)");
        }
        if matches.value_source(id) == Some(ValueSource::CommandLine) {
            continue;
        }
        // An integer where the flag takes a float (`lr = 1`) is that float.
        let value = match (table.get(id), value) {
            (Some(toml::Value::Float(_)), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
            (_, v) => v,
        };
        let check: anyhow::Result<TrainConfig> = {
            let mut probe = table.clone();
            probe.insert(id.to_string(), value.clone());
            toml::Value::Table(probe).try_into().map_err(anyhow::Error::from)
        };
        if let Err(e) = check {
            bail!(
                "--config {shown}: `{key}`: {}",
                e.to_string().lines().next().unwrap_or("a value of the wrong type")
            );
        }
        table.insert(id.to_string(), value);
    }
    let mut merged: TrainConfig =
        toml::Value::Table(table).try_into().with_context(|| format!("--config {shown}"))?;
    merged.config = Some(path);
    Ok(merged)
}
