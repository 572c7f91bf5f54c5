//! Ranges of float32 elements as a [`RankPart`]: the keys are every element of a model's
//! parameters, one parameter after another, and each key carries its value and one value per
//! label (the optimizer's per-element tensors: AdamW's `exp_avg`, `exp_avg_sq`; SGD's
//! `momentum_buffer`). An `Fsdp` shard is such a range (a parameter's rows are a run of its
//! elements), so a rank's shards are one block per parameter.
//!
//! A block travels as its values, then each label's values in label order, f32 in native byte
//! order (every rank runs the same build). A label a block lacks (a parameter the optimizer has
//! not stepped yet) is zeros, which is what SGD's and AdamW's first update assume.
use std::ops::Range;

use super::part::{PartHeader, RankPart};
use crate::error::bail;
use crate::Result;

/// Elements `start..start + values.len()`: their values and each label's.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub start: usize,
    pub values: Vec<f32>,
    /// One vector per label of the part, each as long as `values`.
    pub state: Vec<Vec<f32>>,
}

impl Block {
    fn keys(&self) -> Range<usize> {
        self.start..self.start + self.values.len()
    }

    /// `keys` (inside this block) as offsets into its vectors.
    fn at(&self, keys: &Range<usize>) -> Option<Range<usize>> {
        let mine = self.keys();
        (mine.start <= keys.start && keys.end <= mine.end)
            .then(|| keys.start - mine.start..keys.end - mine.start)
    }
}

/// Blocks of elements held as of `step` (ascending, disjoint, none empty), with the names of
/// the values every element carries beside its own (sorted).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Elements {
    pub step: u64,
    pub labels: Vec<String>,
    pub blocks: Vec<Block>,
}

impl Elements {
    fn block_of(&self, keys: &Range<usize>) -> Result<(&Block, Range<usize>)> {
        self.blocks
            .iter()
            .find_map(|b| b.at(keys).map(|at| (b, at)))
            .ok_or_else(|| crate::TrainError::Invalid(format!("elements {keys:?} are not held")))
    }
}

impl RankPart for Elements {
    const WHAT: &'static str = "the Fsdp shards";

    fn header(&self) -> PartHeader {
        PartHeader {
            ranges: self.blocks.iter().map(|b| (b.start, b.start + b.values.len())).collect(),
            step: self.step,
            labels: self.labels.clone(),
        }
    }

    fn encode(&self, keys: &[Range<usize>]) -> Result<Vec<u8>> {
        let floats: usize = keys.iter().map(|k| k.len() * (1 + self.labels.len())).sum();
        let mut out = Vec::with_capacity(4 * floats);
        for k in keys {
            let (block, at) = self.block_of(k)?;
            for v in std::iter::once(&block.values).chain(&block.state) {
                out.extend_from_slice(bytemuck::cast_slice(&v[at.clone()]));
            }
        }
        Ok(out)
    }

    fn decode(header: &PartHeader, bytes: Vec<u8>) -> Result<Self> {
        let per_key = 1 + header.labels.len();
        let keys: usize = header.ranges.iter().map(|(s, e)| e - s).sum();
        if bytes.len() != 4 * keys * per_key {
            bail!("{} bytes do not hold {keys} elements x {per_key} values", bytes.len());
        }
        let floats: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        let mut blocks = Vec::with_capacity(header.ranges.len());
        let mut at = 0;
        for &(start, end) in &header.ranges {
            let n = end - start;
            let mut vectors = (0..per_key).map(|i| floats[at + i * n..at + (i + 1) * n].to_vec());
            let values = vectors.next().unwrap_or_default();
            blocks.push(Block { start, values, state: vectors.collect() });
            at += n * per_key;
        }
        Ok(Elements { step: header.step, labels: header.labels.clone(), blocks })
    }

    fn take(&self, keys: &Range<usize>) -> Result<Self> {
        let (block, at) = self.block_of(keys)?;
        let block = Block {
            start: keys.start,
            values: block.values[at.clone()].to_vec(),
            state: block.state.iter().map(|v| v[at.clone()].to_vec()).collect(),
        };
        Ok(Elements { step: self.step, labels: self.labels.clone(), blocks: vec![block] })
    }

    fn assemble(
        want: &[Range<usize>],
        step: u64,
        labels: &[String],
        pieces: Vec<Self>,
    ) -> Result<Self> {
        let mut out = Elements {
            step,
            labels: labels.to_vec(),
            blocks: want
                .iter()
                .filter(|k| !k.is_empty())
                .map(|k| Block {
                    start: k.start,
                    values: vec![0.0; k.len()],
                    state: vec![vec![0.0; k.len()]; labels.len()],
                })
                .collect(),
        };
        for piece in pieces {
            for b in &piece.blocks {
                let keys = b.keys();
                let Some((slot, at)) =
                    out.blocks.iter_mut().find_map(|o| o.at(&keys).map(|at| (o, at)))
                else {
                    bail!("a piece of elements {keys:?} is not among those wanted");
                };
                slot.values[at.clone()].copy_from_slice(&b.values);
                for (label, v) in piece.labels.iter().zip(&b.state) {
                    if let Some(i) = labels.iter().position(|l| l == label) {
                        slot.state[i][at.clone()].copy_from_slice(v);
                    }
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(step: u64, blocks: &[(usize, usize)], labels: &[&str]) -> Elements {
        let blocks = blocks
            .iter()
            .map(|&(s, e)| Block {
                start: s,
                values: (s..e).map(|k| k as f32).collect(),
                state: (0..labels.len())
                    .map(|l| (s..e).map(|k| (k * 10 + l) as f32).collect())
                    .collect(),
            })
            .collect();
        Elements { step, labels: labels.iter().map(|l| l.to_string()).collect(), blocks }
    }

    /// Blocks survive the trip through bytes; a piece taken from one and pieces put together
    /// give each element its value and its labels' values, a label a piece lacks as zeros.
    #[test]
    fn blocks_travel_and_reassemble_by_element() {
        let p = part(7, &[(0, 3), (5, 9)], &["exp_avg", "exp_avg_sq"]);
        let h = p.header();
        assert_eq!(h.ranges, vec![(0, 3), (5, 9)]);
        let back = Elements::decode(
            &h,
            p.encode(&h.ranges.iter().map(|&(s, e)| s..e).collect::<Vec<_>>()).unwrap(),
        )
        .unwrap();
        assert_eq!(back, p);
        let short = PartHeader { ranges: vec![(0, 4)], ..h.clone() };
        assert!(Elements::decode(&short, p.encode(std::slice::from_ref(&(0..3))).unwrap()).is_err());
        assert!(p.encode(std::slice::from_ref(&(2..6))).is_err(), "across two blocks");

        let piece = p.take(&(6..8)).unwrap();
        assert_eq!(piece.blocks[0].values, [6.0, 7.0]);
        assert_eq!(piece.blocks[0].state[1], [61.0, 71.0]);
        let bare = part(3, &[(8, 9)], &[]);
        let labels = ["exp_avg".to_string(), "exp_avg_sq".to_string()];
        let got = Elements::assemble(std::slice::from_ref(&(6..9)), 7, &labels, vec![piece, bare])
            .unwrap();
        assert_eq!(got.blocks[0].values, [6.0, 7.0, 8.0]);
        assert_eq!(got.blocks[0].state[0], [60.0, 70.0, 0.0]);
        assert!(Elements::assemble(
            std::slice::from_ref(&(0..2)),
            7,
            &labels,
            vec![part(1, &[(3, 4)], &[])]
        )
        .is_err());
    }
}
