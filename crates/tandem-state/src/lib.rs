//! tandem-state: the whole training state of a run, one model of it for every loop — tandem-train's
//! `Trainer` and a user's own.
//!
//! - [`TrainingState`]: a model, its optimizer (ZeRO-1's shards too), scheduler, scaler, loader
//!   and the state each rank holds alone, saved and loaded in one call each
//!   ([`save_state`]/[`load_state`], over tandem-checkpoint), resumable on any world size, with
//!   one resume path ([`Resumed`]);
//! - [`RankState`]: the one trait of state a rank holds alone — PartialFC's rows (the face
//!   recipe's), per-rank buffers ([`RankBuffers`]), an `Fsdp` model's shards ([`FsdpShards`],
//!   which also convert to and from PyTorch FSDP2's distributed checkpoints), ZeRO's entries
//!   (`live::LiveShards`): saved as shards, loaded from shards of any world size, mirrored and
//!   re-split under live recovery;
//! - [`live`]: keeping a loop running through a rank's death (`tandem run --live-recovery`): the
//!   generations, the state moved to a replacement, the parts' mirrors and re-splits.
//!
//! It knows no loop, no recipe and no logger (tandem-train's), and never prints.
// A public item of a private module must be re-exported: a user can name every type they get.
#![warn(unnameable_types)]

#[doc(hidden)]
pub mod fault;
pub mod live;
pub mod state;

mod error;
mod fsdp_state;
mod rank_state;

#[doc(hidden)]
pub use error::io;
pub use error::{Context, Result, TrainError};
pub use fsdp_state::{fsdp2_state_dict, fsdp_consolidated, load_fsdp2_dcp, FsdpShards};
pub use rank_state::{MirrorCost, PartLoaded, RankBuffers, RankState, RegroupCounts, Resplit};
pub use state::{load_state, load_state_from, save_state, LoaderPosition, Resumed, TrainingState};
