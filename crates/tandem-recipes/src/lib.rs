//! tandem-recipes: the recipes `tandem train` runs, built on the training library
//! (`tandem-train`) as any user's recipe is.
//!
//! - [`train`]: the recipe [`TrainOptions`] names, trained on this rank (every rank calls it):
//!   the image classifier (mlp, cnn, resnet18 on digits, MNIST, CIFAR-10, synthetic data) or
//!   insightface's arcface_torch (IResNet, MobileFaceNet, ViT + PartialFC on RecordIO or a
//!   folder of images), under a launcher, torchrun, Slurm or mpirun, with live recovery;
//! - [`options`]: every setting of those recipes as a person writes it ([`TrainConfig`]: its
//!   doc, default and check; `tandem train`'s flags are its `clap` derive, feature `clap`) and
//!   the typed [`TrainOptions`] the recipes read from it;
//! - [`face`]: the face recipe, in one home: its state (backbone + PartialFC head) as a
//!   [`TrainingStateDict`](tandem_train::TrainingStateDict) and back, on any world size,
//!   arcface_torch's config files and checkpoint layout, its own earlier checkpoints;
//! - [`face_eval`]: face evaluation — verification sets (`.bin` pairs) scored by every rank
//!   together, IJB-B/C 1:1 verification with its table and ROC plot.
//!
//! Like the library below it, it never prints: its runs report
//! [`Event`](tandem_train::Event)s to the loggers they are given.
// A public item of a private module must be re-exported: a user can name every type they get.
#![warn(unnameable_types)]

pub mod face_eval;
pub mod options;

mod recipes;
mod train_config;
mod validate;

pub use options::{TrainConfig, TrainOptions};
pub use recipes::{face, train};
