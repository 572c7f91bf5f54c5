//! A rank's place in the job: [`World`].
use std::sync::Arc;

use tandem_comm::{Collectives, LiveOptions, ProcessGroup};
use tandem_ddp::DdpOptions;

use crate::live::LiveTraining;
use crate::trainer::{Recipe, Trainer};
use crate::RunSummary;
use crate::{Context, Result};

/// Where a rank trains: the job's process group, or — started by `tandem run --live-recovery` —
/// a live world that regroups when a rank dies and takes in its replacement. A program written
/// on [`World`] and the [`Trainer`] runs unchanged under either launcher:
///
/// ```ignore
/// let world = World::join()?;
/// let ddp = Ddp::from_varmap(&varmap, &world.collectives(), world.ddp_options(DdpOptions::default()))?;
/// let trainer = Trainer::new(recipe, loader, step, world.group().clone(), opts)?;
/// let summary = world.fit(trainer)?;
/// ```
pub struct World {
    group: ProcessGroup,
    live: Option<LiveTraining>,
}

impl World {
    /// Joins the job this process was started in: a live world under `tandem run
    /// --live-recovery`, the process group its launcher describes otherwise (`tandem run`,
    /// torchrun, Slurm, mpirun, or a world of one).
    pub fn join() -> Result<World> {
        match LiveOptions::from_env().context("reading the live launcher's settings")? {
            Some(opts) => World::live(opts),
            None => {
                Ok(World::from_group(tandem_comm::init().context("joining the process group")?))
            }
        }
    }

    /// A world without live recovery on `group`.
    pub fn from_group(group: ProcessGroup) -> World {
        World { group, live: None }
    }

    /// Connects to the live job `opts` describes. A replacement for a dead member trains on a
    /// placeholder world of one until [`World::fit`] joins it to the running job.
    pub fn live(opts: LiveOptions) -> Result<World> {
        let live = LiveTraining::connect_with(opts).context("joining the live job")?;
        let group = if live.is_replacement() {
            tandem_comm::init_from(&tandem_comm::InitMethod::Single)?
        } else {
            live.group()
        };
        Ok(World { group, live: Some(live) })
    }

    /// The group to build on now (a replacement's placeholder until it joins).
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Collectives for `Ddp` and SyncBatchNorm: in a live world they follow every regroup.
    pub fn collectives(&self) -> Arc<dyn Collectives> {
        match &self.live {
            Some(live) => live.collectives(),
            None => Arc::new(self.group.clone()),
        }
    }

    /// `opts` for this process's `Ddp`: a replacement skips the start-up broadcast (its
    /// parameters come with the training state when it joins).
    pub fn ddp_options(&self, opts: DdpOptions) -> DdpOptions {
        match &self.live {
            Some(live) => live.ddp_options(opts),
            None => opts,
        }
    }

    /// Whether this process replaces a member that died (it receives its state from the running
    /// ranks instead of resuming a checkpoint).
    pub fn is_replacement(&self) -> bool {
        self.live.as_ref().is_some_and(LiveTraining::is_replacement)
    }

    /// Trains `trainer` to the end in this world: resumes from its newest checkpoint when its
    /// options ask (an original member; a replacement receives the running job's state), joins
    /// the live world, and keeps going through regroups.
    pub fn fit<R: Recipe>(self, mut trainer: Trainer<R>) -> Result<RunSummary> {
        if trainer.options().resume && !self.is_replacement() {
            trainer.resume()?;
        }
        let Some(live) = self.live else { return trainer.fit() };
        let mut trainer = trainer.live(live);
        trainer.join_live()?;
        trainer.fit()
    }
}
