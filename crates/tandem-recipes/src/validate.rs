//! What makes a [`TrainOptions`] unable to train, found before anything starts. Each error
//! names the option at fault by its key ([`TrainError::Option`]: `batch_size`, `sample_rate`,
//! the `--config` keys), which `tandem train` shows as its flag; other options a message
//! mentions are named by key in backticks.
use tandem_models::ModelKind;
use tandem_train::{bail_option, Result};

use crate::options::{Backend, DeviceKind, TrainOptions};

impl TrainOptions {
    /// Refuses options that cannot train. The built-in recipes call it first; a binary calls it
    /// before it starts any rank.
    pub fn validate(&self) -> Result<()> {
        let (run, data, model, optim) = (&self.run, &self.data, &self.model, &self.optim);
        if data.batch_size == 0 {
            bail_option!("batch_size", None, "must be at least 1");
        }
        if run.epochs == 0 && run.max_steps.is_none() {
            bail_option!("epochs", None, "must be at least 1 (or give a step limit, `steps`)");
        }
        if !(optim.lr.is_finite() && optim.lr > 0.0) {
            bail_option!("lr", Some(optim.lr.to_string()), "must be a positive number");
        }
        if model.hidden == 0 {
            bail_option!("hidden", None, "must be at least 1");
        }
        if model.width == 0 {
            bail_option!("width", None, "must be at least 1");
        }
        if model.sync_batchnorm && model.kind != ModelKind::ResNet18 {
            bail_option!(
                "sync_batchnorm",
                None,
                "needs the `resnet18` model (the model whose BatchNorm layers can synchronise)"
            );
        }
        if let Some(c) = optim.clip_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                bail_option!("clip_grad_norm", Some(c.to_string()), "must be a positive number");
            }
        }
        if optim.grad_scaler_growth_interval.is_some_and(|g| g < 1) {
            bail_option!("grad_scaler_growth_interval", None, "must be at least 1");
        }
        if self.face.gradient_acc == 0 {
            bail_option!("gradient_acc", None, "must be at least 1 (1: a step per batch)");
        }
        let face_data = data.source.is_face();
        if model.kind.is_face() {
            self.validate_face(face_data)?;
        } else {
            self.validate_classifier(face_data)?;
        }
        if self.optim.zero && !cfg!(feature = "zero") {
            bail_option!(
                "zero",
                None,
                "this build has no ZeRO (built without tandem-recipes' zero cargo feature)"
            );
        }
        if self.comm.mirror_every == 0 {
            bail_option!("mirror_every", None, "must be at least 1");
        }
        if self.checkpoint.keep_last == 0 {
            bail_option!("keep_last", None, "must be at least 1");
        }
        if let Some(path) = &self.checkpoint.export_onnx {
            // Found out before training, not after it.
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            if dir.is_some_and(|d| !d.is_dir()) {
                let path = path.display().to_string();
                bail_option!("export_onnx", Some(path), "its directory does not exist");
            }
        }
        if self.comm.backend == Backend::Nccl && model.device != DeviceKind::Cuda {
            bail_option!(
                "backend",
                Some("nccl".into()),
                "reduces GPU buffers: set `device` to cuda (CPU backends: auto, tcp, shm, mpi)"
            );
        }
        #[cfg(not(feature = "cuda"))]
        if model.device == DeviceKind::Cuda {
            bail_option!(
                "device",
                Some("cuda".into()),
                "this build has no CUDA support; rebuild with `cargo build --release --features \
                 cuda` (needs the CUDA toolkit's nvcc; NCCL is loaded at run time)"
            );
        }
        if self.comm.live_recovery {
            crate::recipes::refuse_live(self)?;
        }
        if model.fsdp.is_some() {
            self.validate_fsdp()?;
        }
        Ok(())
    }

    /// What a sharded model (`fsdp`) does not combine with, each refusal naming the other
    /// setting.
    fn validate_fsdp(&self) -> Result<()> {
        let refuse = [
            (self.optim.zero, "zero", "`fsdp` shards the optimizer state already (ZeRO-3)"),
            (
                self.comm.comm_hook != crate::options::CommHook::Off,
                "comm_hook",
                "a hook on Ddp's gradient buckets; `fsdp` reduce-scatters each unit's gradients",
            ),
            (
                self.model.sync_batchnorm,
                "sync_batchnorm",
                "not with `fsdp` (its BatchNorm statistics stay per rank, as FSDP2 leaves them)",
            ),
            (
                self.model.device == DeviceKind::Cuda,
                "device",
                "`fsdp` shards CPU tensors for now (train on cuda under Ddp)",
            ),
        ];
        match refuse.into_iter().find(|(refused, ..)| *refused) {
            Some((_, key, why)) => Err(tandem_train::TrainError::option(key, None, why)),
            None => Ok(()),
        }
    }

    /// The face recipe's own checks (a face backbone + PartialFC on an identity set).
    fn validate_face(&self, face_data: bool) -> Result<()> {
        let (face, model) = (&self.face, self.model.kind.name());
        if !face_data {
            bail_option!(
                "data",
                Some(self.data.source.to_string()),
                "the `{model}` model trains on a face identity set: `rec:DIR` (train.rec + \
                 train.idx; `tandem data synth-faces DIR` writes a synthetic one) or \
                 `folder:DIR` (one sub-folder of images per identity)"
            );
        }
        if !(face.margin_scale.is_finite() && face.margin_scale > 0.0) {
            let value = Some(face.margin_scale.to_string());
            bail_option!("margin_scale", value, "must be a positive number");
        }
        if !(0.0..=1.0).contains(&face.sample_rate) {
            let why = "must be in [0, 1] (0: a batch's positive classes only, as arcface_torch)";
            bail_option!("sample_rate", Some(face.sample_rate.to_string()), "{why}");
        }
        if face.embedding_size == 0 {
            bail_option!("embedding_size", None, "must be at least 1");
        }
        if face.num_classes == Some(0) {
            bail_option!("num_classes", None, "must be at least 1");
        }
        let refused = [
            (
                self.optim.zero,
                "zero",
                "ZeRO shards one parameter group; the PartialFC head is already split over the \
                 ranks",
            ),
            (
                self.model.sync_batchnorm,
                "sync_batchnorm",
                "arcface_torch keeps per-rank statistics",
            ),
            (
                self.data.normalize,
                "normalize",
                "face images are scaled to [-1, 1] as arcface_torch does",
            ),
        ];
        if let Some((_, key, why)) = refused.iter().find(|(on, _, _)| *on) {
            let text = format!("not supported with the `{model}` model ({why})");
            return Err(tandem_train::TrainError::option(key, None, text));
        }
        Ok(())
    }

    /// The classifiers' checks: no face data, verification sets or gradient accumulation.
    fn validate_classifier(&self, face_data: bool) -> Result<()> {
        let model = self.model.kind.name();
        if face_data {
            bail_option!(
                "data",
                Some(self.data.source.to_string()),
                "a face identity set trains a face backbone; set `model` to iresnet18 (or r50, \
                 mbf, ...)"
            );
        }
        if !self.face.val.is_empty() {
            bail_option!("val", None, "verification sets are for the face models (iresnet18 ...)");
        }
        if self.face.gradient_acc > 1 {
            bail_option!(
                "gradient_acc",
                Some(self.face.gradient_acc.to_string()),
                "applies to the face recipe (models r50, mbf, vit_t, ...), not the `{model}` model"
            );
        }
        Ok(())
    }
}
