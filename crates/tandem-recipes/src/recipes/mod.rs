//! The built-in recipes, run from [`TrainOptions`] on one rank: the classifier (mlp, cnn,
//! resnet18 on digits, MNIST, CIFAR-10, synthetic data) and the face recipe (insightface's
//! arcface_torch: IResNet + PartialFC on RecordIO, verification sets). Both take their steps
//! through one [`Step`], their schedules from [`LrSchedule`](tandem_train::LrSchedule), and report a
//! [`RunSummary`] and a metrics file.
//!
//! ```ignore
//! let summary = tandem::recipes::train(&options, &Reporter::new().with(my_logger))?;   // on every rank
//! ```
pub mod classifier;
pub mod face;
pub mod net;
pub mod optimizer;
mod training_log;
mod wrapped;

use std::sync::Arc;

use tandem_comm::{LiveOptions, ProcessGroup};
use tandem_train::events::{Event, Reporter};
use tandem_train::{
    bail_option, Context, Never, Periodic, Result, RunSummary, Step, TrainError, TrainerOptions,
    World,
};

use crate::options::{Backend, CommHook, DeviceKind, Precision, TrainOptions};

/// Trains the recipe `opts.model.kind` names on this rank (every rank calls it; the process
/// group comes from the environment: `tandem run`, torchrun, Slurm, mpirun, or a world of
/// one). Under `tandem run --live-recovery` the classifier keeps going through a rank's death.
/// The run's events go to `reporter`'s loggers.
pub fn train(opts: &TrainOptions, reporter: &Reporter) -> Result<RunSummary> {
    tandem_train::fault::check_build()?;
    opts.validate()?;
    // A run resumes from the face recipe's earlier checkpoints too.
    crate::face::register_checkpoint_formats();
    let face = opts.model.kind.is_face();
    if let Some(live) = live_options(opts)? {
        // The face recipe's head rows are mirrored every `mirror_every` steps and re-split at
        // every regroup; the classifier's ZeRO shards likewise.
        return match face {
            true => run_live(opts, live, reporter, |group, comm| {
                face::Face::build_with(opts, group, Some(comm), reporter)
            }),
            false => run_live(opts, live, reporter, |group, comm| {
                classifier::Classifier::build(opts, group, Some(comm), reporter)
            }),
        };
    }
    let group = join_group(opts, reporter)?;
    match face {
        true => run(opts, group, reporter, |g| face::Face::build(opts, g, reporter)),
        false => {
            run(opts, group, reporter, |g| classifier::Classifier::build(opts, g, None, reporter))
        }
    }
}

/// What a recipe's build gives the trainer.
type Built<R> = (R, tandem_data::DataLoader<<R as tandem_train::Recipe>::Data>, Step);

/// A rank of a job without live recovery: the recipe built on `group`, resumed if asked, trained.
fn run<R: tandem_train::Recipe>(
    cfg: &TrainOptions,
    group: ProcessGroup,
    reporter: &Reporter,
    build: impl FnOnce(&ProcessGroup) -> Result<Built<R>>,
) -> Result<RunSummary> {
    let (recipe, loader, step) = build(&group)?;
    let trainer = trainer(cfg, recipe, loader, step, group.clone(), reporter)?;
    World::from_group(group).fit(trainer)
}

/// The trainer of a built recipe, reporting to `reporter`.
fn trainer<R: tandem_train::Recipe>(
    cfg: &TrainOptions,
    recipe: R,
    loader: tandem_data::DataLoader<R::Data>,
    step: Step,
    group: ProcessGroup,
    reporter: &Reporter,
) -> Result<tandem_train::Trainer<R>> {
    let opts = trainer_options(cfg);
    Ok(tandem_train::Trainer::new(recipe, loader, step, group, opts)?.reporter(reporter.clone()))
}

/// The loop's part of the options.
fn trainer_options(o: &TrainOptions) -> TrainerOptions {
    TrainerOptions {
        dir: o.run.dir.clone(),
        epochs: o.run.epochs,
        max_steps: o.run.max_steps,
        checkpoints: match o.checkpoint.enabled {
            true => Arc::new(
                Periodic::every(o.checkpoint.save_every)
                    .keeping(o.checkpoint.keep_last)
                    .in_background(o.checkpoint.background),
            ),
            false => Arc::new(Never),
        },
        // (A recipe without verification sets returns nothing from `validate`.)
        validate_every: o.face.verify_every,
        resume: o.run.resume,
        tensorboard: o.run.tensorboard,
        timing_warmup_steps: o.run.timing_warmup_steps,
        log_files: match o.run.log_every {
            0 => Vec::new(),
            every => vec![training_log::open(every)],
        },
        mirror_every: o.comm.mirror_every,
    }
}

/// The end of a built-in recipe's run, after its last checkpoint (every rank calls it): rank 0
/// writes `--save-final` and `--export-onnx`; every rank meets after each file. A sharded
/// model is gathered to rank 0 alone, one parameter at a time, once for both files, and only
/// to be written (a model larger than a rank never comes whole on any other).
fn finish_run<M: tandem_nn::ParamModule>(
    cfg: &TrainOptions,
    group: &ProcessGroup,
    reporter: &Reporter,
    model: &wrapped::Wrapped<M>,
) -> Result<()> {
    let ckpt = &cfg.checkpoint;
    if ckpt.save_final.is_none() && ckpt.export_onnx.is_none() {
        return Ok(());
    }
    let final_path = ckpt.save_final.as_deref();
    // A file written as it is gathered, unless the ONNX export needs rank 0's state dict
    // anyway: then one gather serves both (`None` on the other ranks).
    let onnx = ckpt.export_onnx.is_some();
    let gathering = !onnx && final_path.is_some_and(|p| model.saves_gathering(p));
    let value = if onnx || (final_path.is_some() && !gathering) {
        model.state_dict_rank0(group.rank())?
    } else {
        None
    };
    if let Some(path) = final_path {
        let saved = match (gathering, &value) {
            (true, _) => model.save_gathering(path),
            (false, Some(value)) => Ok(tandem_nn::weights::save_state_dict(value, path)?),
            (false, None) => Ok(()),
        };
        saved.option("save_final", Some(path.display().to_string()))?;
        group.barrier()?;
    }
    if let Some(path) = &ckpt.export_onnx {
        if let Some(value) = &value {
            let summary = tandem_onnx::export_to_file(cfg.model.kind, value, path)
                .option("export_onnx", Some(path.display().to_string()))?;
            note(reporter, summary.to_string())?;
        }
        group.barrier()?;
    }
    Ok(())
}

/// Says `text` to the run's loggers (a fact about the run; the caller is rank 0).
fn note(reporter: &Reporter, text: impl Into<String>) -> Result<()> {
    reporter.report(&Event::Note(text.into())).context("reporting to the run's loggers")
}

/// The collectives of a live world (they follow its regroups), for a recipe's Ddp and any
/// model-parallel part, and whether this process replaces a dead member (then Ddp skips its
/// construction-time broadcast: its state comes when it joins).
pub struct LiveComm {
    pub comm: std::sync::Arc<dyn tandem_comm::Collectives>,
    pub replacement: bool,
}

/// A rank of a live job: an original member forms the first world with the others (and
/// resumes with them when asked); a replacement builds everything first (on a placeholder
/// world of one), then joins the running world and receives its state.
fn run_live<R: tandem_train::Recipe>(
    cfg: &TrainOptions,
    opts: LiveOptions,
    reporter: &Reporter,
    build: impl FnOnce(&ProcessGroup, LiveComm) -> Result<Built<R>>,
) -> Result<RunSummary> {
    let world = World::live(opts)?;
    let comm = LiveComm { comm: world.collectives(), replacement: world.is_replacement() };
    let (recipe, loader, step) = build(world.group(), comm)?;
    let trainer = trainer(cfg, recipe, loader, step, world.group().clone(), reporter)?;
    world.fit(trainer)
}

/// The live launcher's settings when it started this rank (`tandem run --live-recovery`, or
/// `tandem train --live-recovery` launching its own ranks).
fn live_options(opts: &TrainOptions) -> Result<Option<LiveOptions>> {
    let Some(mut live) = LiveOptions::from_env().context("reading the live launcher's settings")?
    else {
        if opts.comm.live_recovery {
            bail_option!(
                "live_recovery",
                None,
                "this rank was started by another launcher; start the job with `tandem run \
                 --live-recovery` (or plain `tandem train --live-recovery`, which starts its \
                 ranks so): torchrun, Slurm and mpirun restart whole jobs"
            );
        }
        return Ok(None);
    };
    refuse_live(opts)?;
    if let Some(kind) = opts.comm.backend.transport() {
        live.init.transport = Some(kind);
    }
    Ok(Some(live))
}

/// What live recovery cannot carry, refused with the physical reason (also checked by a
/// worker that a live launcher started without the flag).
pub fn refuse_live(opts: &TrainOptions) -> Result<()> {
    let refused = if opts.model.device == DeviceKind::Cuda {
        let why = "NCCL communicators are not re-formed (live recovery is CPU training)";
        TrainError::option("device", Some("cuda".into()), why)
    } else if matches!(opts.comm.backend, Backend::Nccl | Backend::Mpi) {
        let why = "its communicator cannot re-form (use auto, tcp or shm)";
        TrainError::option("backend", Some(opts.comm.backend.to_string()), why)
    } else {
        return Ok(());
    };
    Err(refused).option("live_recovery", None)
}

/// Joins the process group (`--backend` applies under any launcher: mpirun, srun, torchrun,
/// not only our own) and, with `--backend nccl`, makes the NCCL communicator Ddp reduces with.
pub fn join_group(opts: &TrainOptions, reporter: &Reporter) -> Result<ProcessGroup> {
    let mut init = tandem_comm::InitOptions::from_env().context("reading TANDEM_* settings")?;
    if let Some(kind) = opts.comm.backend.transport() {
        init.transport = Some(kind);
    }
    let group = tandem_comm::init_with(&tandem_comm::InitMethod::Env, &init)
        .context("joining the process group")?;
    // (Without the `cuda` feature, the binary has refused --backend nccl.)
    #[cfg(feature = "cuda")]
    if opts.comm.backend == Backend::Nccl {
        // Made now, collectively, so Ddp reduces the CUDA gradients with it.
        let comm = group
            .nccl(group.local_rank() as i32)
            .context("making the NCCL communicator")
            .option("backend", Some("nccl".into()))?;
        if group.rank() == 0 {
            let text = format!("nccl: {} rank(s), rank 0 on cuda:{}", group.size(), comm.device());
            note(reporter, text)?;
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = reporter;
    Ok(group)
}

/// Whether the built-in VarMap models reduce their gradients during backward
/// (`DdpOptions::reduce_during_backward`): yes, unless `TANDEM_DDP_OVERLAP=0` asks for the
/// reduction after backward (an A/B switch for measuring what the overlap gains).
fn overlap_allowed() -> bool {
    std::env::var("TANDEM_DDP_OVERLAP").map_or(true, |v| v != "0")
}

/// The training loader every recipe uses: the sampler (torch's shuffle from the seed, this
/// rank's shard of `group`) over `data`, `batch_size` per rank.
fn training_loader<D: tandem_data::Dataset + 'static>(
    opts: &TrainOptions,
    data: &std::sync::Arc<D>,
    group: &ProcessGroup,
    options: tandem_data::LoaderOptions,
    device: &candle_core::Device,
) -> Result<tandem_data::DataLoader<D>> {
    let sampler = tandem_data::DistributedSampler::builder(data.len())
        .group(group)
        .shuffle(opts.data.shuffle)
        .seed(opts.run.seed)
        .build()?;
    Ok(tandem_data::DataLoader::new(std::sync::Arc::clone(data), sampler, options, device.clone())?)
}

/// `--comm-hook` on `ddp` (or, unless one is given, the test-only fault-injection hook).
fn register_comm_hook<M: tandem_nn::ParamModule>(
    ddp: &tandem_ddp::Ddp<M>,
    opts: &TrainOptions,
) -> Result<()> {
    let name = opts.comm.comm_hook.name();
    if opts.comm.comm_hook != CommHook::Off {
        let Some(hook) = tandem_ddp::comm_hooks::builtin(name) else {
            bail_option!("comm_hook", Some(name.to_string()), "no such hook");
        };
        ddp.register_comm_hook(hook).option("comm_hook", Some(name.to_string()))?;
    } else if tandem_train::fault::armed() {
        ddp.register_comm_hook(tandem_train::fault::hook()).context("the fault-injection hook")?;
    }
    Ok(())
}

/// The step the options describe: f16's GradScaler (growing every
/// `grad_scaler_growth_interval` clean steps, `default_interval` without it), the clipping
/// norm and `sched`.
pub fn step_for(
    opts: &TrainOptions,
    default_interval: i64,
    sched: tandem_train::Scheduler,
) -> Result<Step> {
    use tandem_optim::{GradScaler, GradScalerConfig};
    let scaler = match opts.model.precision {
        Precision::F16 => Some(GradScaler::new(GradScalerConfig {
            growth_interval: opts.optim.grad_scaler_growth_interval.unwrap_or(default_interval),
            ..GradScalerConfig::default()
        })?),
        _ => None,
    };
    Ok(Step::new().scaler(scaler).clip_grad_norm(opts.optim.clip_grad_norm).scheduler(sched))
}
