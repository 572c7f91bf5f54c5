//! A run's results as types, and the JSON-lines file a script reads them from: one object per
//! line, `{"kind":"epoch",...}` after every epoch, `{"kind":"regrouped",...}` when a live world
//! re-forms and `{"kind":"summary",...}` at the end (rank 0 writes it, as a [`Logger`](crate::Logger) of the
//! run's events; every line is flushed as written, so a file cut short by a crash still parses
//! line by line).
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::live::Regroup;
use crate::TrainError;
use tandem_state::io;
use tandem_state::MirrorCost;

/// One validation set's result, as a recipe's [`Recipe::validate`](crate::Recipe::validate)
/// scores it: the fraction it got right, that fraction's spread over the set's folds, and any
/// further figures the recipe names, which the metrics file keeps beside them: the face
/// recipe's `{"name":"lfw","accuracy":0.99,"std":0.01,"xnorm":22.5}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationMetrics {
    pub name: String,
    pub accuracy: f64,
    #[serde(default)]
    pub std: f64,
    #[serde(flatten)]
    pub figures: BTreeMap<String, f64>,
}

impl ValidationMetrics {
    /// Set `name`'s accuracy and its spread, with no further figures.
    pub fn new(name: impl Into<String>, accuracy: f64, std: f64) -> Self {
        ValidationMetrics { name: name.into(), accuracy, std, figures: BTreeMap::new() }
    }

    /// With figure `key` too.
    pub fn with(mut self, key: impl Into<String>, value: f64) -> Self {
        self.figures.insert(key.into(), value);
        self
    }

    /// Figure `key`, if the recipe gave it.
    pub fn figure(&self, key: &str) -> Option<f64> {
        self.figures.get(key).copied()
    }
}

/// What one epoch measured (the world's figures: losses are means over every rank's samples).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// 1-based, as printed.
    pub epoch: u64,
    /// Optimizer steps done at the epoch's end.
    pub step: u64,
    pub train_loss: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub verification: Vec<ValidationMetrics>,
    /// Samples per second of training time over the whole world.
    pub samples_per_s: f64,
    pub lr: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    pub skipped_steps: u64,
    /// Seconds since the Unix epoch when the epoch ended (after its evaluation): the time
    /// between two epochs' records is what an epoch took, faults and all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_unix_s: Option<f64>,
}

/// What a finished run reports (rank 0 prints it as the `final:` line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub rank: usize,
    pub epochs: u64,
    pub steps: u64,
    /// Samples per second of training time over the whole world.
    pub samples_per_s: f64,
    /// The last epoch's mean train loss (`None` when no epoch ended in this process).
    #[serde(default)]
    pub final_loss: Option<f64>,
    /// The classifiers' accuracy on the eval split.
    #[serde(default)]
    pub eval_accuracy: Option<f64>,
    /// The accuracy on the recipe's first validation set (the face recipe's first
    /// verification set; the field keeps the name scripts read).
    #[serde(default)]
    pub verification_accuracy: Option<f64>,
    /// The last checkpoint this run wrote (on rank 0).
    #[serde(default)]
    pub checkpoint: Option<PathBuf>,
    /// Optimizer steps the GradScaler skipped (inf/NaN gradients).
    #[serde(default)]
    pub skipped_steps: u64,
    /// Where rank's step time went (per-step means from [`StepTimes::line`](crate::StepTimes::line)).
    #[serde(default)]
    pub step_times: Option<crate::StepTimes>,
    /// The last validation of every set ([`Recipe::validate`](crate::Recipe::validate); the
    /// field keeps the name scripts read).
    #[serde(default)]
    pub verification: Vec<ValidationMetrics>,
    /// Every epoch this process saw end, in order.
    #[serde(default)]
    pub epochs_seen: Vec<EpochMetrics>,
    /// Each rank's peak resident memory in bytes (`VmHWM`), by rank; 0 where unknown.
    #[serde(default)]
    pub peak_rss_bytes: Vec<u64>,
    /// The same before the last checkpoint save (a background save's staging copy of the state
    /// would be a peak of its own): training's peak.
    #[serde(default)]
    pub training_peak_rss_bytes: Vec<u64>,
    /// Each rank's peak GPU memory in training (its device's memory pool high-water mark, as
    /// `torch.cuda.max_memory_allocated`), by rank; 0 on the CPU.
    #[serde(default)]
    pub device_peak_bytes: Vec<u64>,
}

/// One line of a metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum MetricsRecord {
    Epoch(EpochMetrics),
    Summary(RunSummary),
    /// A live world re-formed (`tandem run --live-recovery`).
    Regrouped(Regroup),
    /// What live recovery's mirrors cost over the run.
    MirrorCost(MirrorCost),
}

/// Appends records to a JSON-lines metrics file, whole lines only: a record that cannot be
/// written whole (the disk full) is cut off again, so the lines after it still read.
pub struct MetricsFile {
    path: PathBuf,
    file: File,
}

impl MetricsFile {
    /// Opens `path` for appending (a resumed run continues the file), creating its directory.
    pub fn append(path: &Path) -> crate::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io("opening", path))?;
        Ok(MetricsFile { path: path.to_path_buf(), file })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one record as a line, in one write; if it fails part way, the part written is
    /// cut off again (the file ends with the last whole record) and the error returned.
    pub fn write(&mut self, record: &MetricsRecord) -> crate::Result<()> {
        let mut line = serde_json::to_vec(record)
            .map_err(|e| io("writing", &self.path)(std::io::Error::other(e)))?;
        line.push(b'\n');
        let end = self.file.metadata().map_err(io("writing", &self.path))?.len();
        if let Err(e) = self.file.write_all(&line) {
            // (Appends go to the end, so the next record follows the last whole one.)
            let _ = self.file.set_len(end);
            return Err(io("writing", &self.path)(e));
        }
        Ok(())
    }
}

/// Every record of a metrics file, in order.
pub fn read_metrics(path: &Path) -> crate::Result<Vec<MetricsRecord>> {
    let file = File::open(path).map_err(io("reading", path))?;
    let mut records = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io("reading", path))?;
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(&line).map_err(|source| TrainError::Record {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })?;
        records.push(record);
    }
    Ok(records)
}

/// The last summary of a metrics file (a resumed run's file holds one per run).
pub fn last_summary(path: &Path) -> crate::Result<Option<RunSummary>> {
    Ok(read_metrics(path)?.into_iter().rev().find_map(|r| match r {
        MetricsRecord::Summary(s) => Some(s),
        _ => None,
    }))
}

/// A rate with three significant figures (`1.23`, `45.6`, `789`, `12300`).
pub fn three_figures(v: f64) -> String {
    if !v.is_finite() || v == 0.0 {
        return format!("{v}");
    }
    let digits = v.abs().log10().floor() as i32 + 1;
    if digits >= 3 {
        // Whole numbers: keep the three leading digits (12345 -> 12300).
        let scale = 10f64.powi(digits - 3);
        return format!("{:.0}", (v / scale).round() * scale);
    }
    format!("{:.*}", (3 - digits) as usize, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(n: u64) -> EpochMetrics {
        EpochMetrics {
            epoch: n,
            step: 10 * n,
            train_loss: 1.0 / n as f64,
            eval_loss: None,
            eval_accuracy: Some(0.5),
            verification: vec![ValidationMetrics::new("lfw", 0.9, 0.01).with("xnorm", 20.0)],
            samples_per_s: 123.456,
            lr: 0.1,
            loss_scale: None,
            at_unix_s: Some(1.7e9 + n as f64),
            skipped_steps: 0,
        }
    }

    /// A recipe's own figures sit beside name, accuracy and std in the file, as the face
    /// recipe's `xnorm` always has: records written before the figures were a map read back.
    #[test]
    fn validation_figures_are_fields_of_their_own() {
        let v = ValidationMetrics::new("lfw", 0.9, 0.01).with("xnorm", 20.5);
        let text = serde_json::to_string(&v).unwrap();
        assert_eq!(text, r#"{"name":"lfw","accuracy":0.9,"std":0.01,"xnorm":20.5}"#);
        let read: ValidationMetrics = serde_json::from_str(&text).unwrap();
        assert_eq!((read.figure("xnorm"), read.figure("other")), (Some(20.5), None));
        assert_eq!(read, v);
    }

    #[test]
    fn rates_print_with_three_significant_figures() {
        let cases =
            [(1.2345, "1.23"), (45.678, "45.7"), (789.4, "789"), (12345.0, "12300"), (0.0, "0")];
        for (v, want) in cases {
            assert_eq!(three_figures(v), want, "{v}");
        }
    }

    #[test]
    fn records_round_trip_and_a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/metrics.jsonl");
        let summary = RunSummary {
            rank: 0,
            epochs: 2,
            steps: 20,
            samples_per_s: 99.5,
            final_loss: Some(0.5),
            eval_accuracy: Some(0.75),
            verification_accuracy: None,
            checkpoint: Some("ck/step-20".into()),
            skipped_steps: 1,
            step_times: None,
            verification: Vec::new(),
            epochs_seen: vec![epoch(1), epoch(2)],
            peak_rss_bytes: vec![1 << 30, 3 << 29],
            training_peak_rss_bytes: vec![1 << 29, 3 << 28],
            device_peak_bytes: vec![0, 0],
        };
        let mut f = MetricsFile::append(&path).unwrap();
        f.write(&MetricsRecord::Epoch(epoch(1))).unwrap();
        f.write(&MetricsRecord::Summary(summary.clone())).unwrap();
        drop(f);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.lines().next().unwrap().starts_with(r#"{"kind":"epoch","epoch":1,"#),
            "{text}"
        );
        assert_eq!(read_metrics(&path).unwrap()[0], MetricsRecord::Epoch(epoch(1)));
        assert_eq!(last_summary(&path).unwrap(), Some(summary));
        std::fs::write(&path, format!("{text}{{\"kind\":\"epoch\"}}\n")).unwrap();
        let err = read_metrics(&path).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl:3: not a metrics record"), "{err}");
    }
}
