//! What a sharded checkpoint holds, file by file, as `tandem ckpt inspect` shows it (and as
//! JSON): its manifest, the replicated file, and every rank's file with the slice of each
//! shard it holds and its bytes.
use serde::Serialize;
use tandem_ckpt::tree::tensor_bytes;
use tandem_ckpt::Value;

use crate::{invalid, Result, Saved};

/// A sharded checkpoint, inspected ([`Saved::inspect`]).
#[derive(Clone, Debug, Serialize)]
pub struct Inspection {
    pub dir: String,
    pub format: &'static str,
    pub world_size: usize,
    pub global_step: u64,
    pub epoch: u64,
    /// The replicated file's name and the bytes of its tensors.
    pub replicated: String,
    pub replicated_bytes: usize,
    /// The replicated dict's `scheduler` and `scaler` kinds (`absent` when missing).
    pub scheduler: &'static str,
    pub scaler: &'static str,
    pub ranks: Vec<RankInspection>,
}

/// One rank's file: its bytes on disk and each shard's slice and tensor bytes.
#[derive(Clone, Debug, Serialize)]
pub struct RankInspection {
    pub rank: usize,
    pub file: String,
    pub file_bytes: u64,
    pub shards: Vec<ShardInspection>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ShardInspection {
    pub name: String,
    pub slice: String,
    pub bytes: usize,
}

impl Saved {
    /// Reads every file of this sharded checkpoint and says what each holds.
    pub fn inspect(&self) -> Result<Inspection> {
        let m = self.manifest().ok_or_else(|| invalid(self.path(), "not a sharded checkpoint"))?;
        let rep = self.replicated()?;
        let kind = |k: &str| rep.get(k).map_or("absent", Value::type_name);
        let mut ranks = Vec::new();
        for (rank, file) in m.ranks.iter().enumerate() {
            let v = self.read_rank_file(rank)?;
            let on_disk = std::fs::metadata(self.path().join(&file.file));
            let shards = file
                .shards
                .iter()
                .map(|s| ShardInspection {
                    name: s.name.clone(),
                    slice: s.slice.to_string(),
                    bytes: v.get(&s.name).map_or_else(|| tensor_bytes(&v), tensor_bytes),
                })
                .collect();
            let file_bytes = on_disk.map(|m| m.len()).unwrap_or(0);
            ranks.push(RankInspection { rank, file: file.file.clone(), file_bytes, shards });
        }
        Ok(Inspection {
            dir: self.path().display().to_string(),
            format: self.format(),
            world_size: m.world_size,
            global_step: m.global_step,
            epoch: m.epoch,
            replicated: m.replicated.clone(),
            replicated_bytes: tensor_bytes(&rep),
            scheduler: kind("scheduler"),
            scaler: kind("scaler"),
            ranks,
        })
    }
}

impl std::fmt::Display for Inspection {
    /// `DIR: sharded checkpoint, FORMAT, step S (epoch E), W ranks`, the replicated file, then a
    /// line per rank.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: sharded checkpoint, {}, step {} (epoch {}), {} ranks",
            self.dir, self.format, self.global_step, self.epoch, self.world_size
        )?;
        writeln!(
            f,
            "  {}: replicated (the model, its optimizer state but the sharded parts, scheduler: {}, scaler: {}), {} bytes of tensors",
            self.replicated, self.scheduler, self.scaler, self.replicated_bytes
        )?;
        for r in &self.ranks {
            // Many shards under one prefix (a sharded model's `model/NAME` rows) as one summary.
            let mut groups: Vec<(&str, Vec<&ShardInspection>)> = Vec::new();
            for s in &r.shards {
                let prefix = s.name.rsplit_once('/').map_or(s.name.as_str(), |(p, _)| p);
                match groups.iter_mut().find(|(p, _)| *p == prefix) {
                    Some((_, members)) => members.push(s),
                    None => groups.push((prefix, vec![s])),
                }
            }
            let mut parts = Vec::new();
            for (prefix, members) in groups {
                if members.len() < 4 {
                    parts.extend(
                        members
                            .iter()
                            .map(|s| format!("{}: {} ({} bytes)", s.name, s.slice, s.bytes)),
                    );
                } else {
                    let bytes: usize = members.iter().map(|s| s.bytes).sum();
                    parts.push(format!("{prefix}/*: {} shards ({bytes} bytes)", members.len()));
                }
            }
            writeln!(
                f,
                "  rank {}: {} ({} bytes)  {}",
                r.rank,
                r.file,
                r.file_bytes,
                parts.join("; ")
            )?;
        }
        Ok(())
    }
}
