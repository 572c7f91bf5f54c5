//! The PartialFC head's rows as a [`RankPart`]: a rank's class centres (and their optimizer
//! state) live on that rank alone, so a dead rank would take them with it; [`crate::live_part`]
//! mirrors them to the next rank and re-splits them after a regroup. Classes no rank holds (two
//! neighbours lost at once) come from the recipe's fill: the last checkpoint, else the initial
//! centres.
//!
//! Rows travel as f32 (native byte order: every rank runs the same build): the centres, then each optimizer row tensor
//! (`momentum_buffer`; AdamW's `exp_avg`, `exp_avg_sq`) in name order. A block without
//! optimizer state (before the first step) gives zeros, which is what SGD's and AdamW's first
//! update assume.
use std::ops::Range;

use tandem_train::live::{PartHeader, RankPart};
use tandem_train::{bail, Result};

/// Rows `start..start + len` of the head as of `step`: centres and the optimizer's row tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct RowBlock {
    pub start: usize,
    pub len: usize,
    pub step: u64,
    /// `[len, embedding]`, row-major.
    pub weight: Vec<f32>,
    /// The optimizer's row tensors by name (sorted by name), each `[len, embedding]`.
    pub state: Vec<(String, Vec<f32>)>,
}

impl RowBlock {
    fn classes(&self) -> Range<usize> {
        self.start..self.start + self.len
    }

    fn embedding(&self) -> usize {
        self.weight.len().checked_div(self.len).unwrap_or(0)
    }

    /// The element range of `classes` (inside this block) in each tensor.
    fn elements(&self, classes: &Range<usize>) -> Result<Range<usize>> {
        if classes.start < self.start || classes.end > self.start + self.len {
            bail!("classes {classes:?} are not in rows {:?}", self.classes());
        }
        let e = self.embedding();
        Ok((classes.start - self.start) * e..(classes.end - self.start) * e)
    }
}

impl RankPart for RowBlock {
    const WHAT: &'static str = "the PartialFC head's rows";

    fn header(&self) -> PartHeader {
        PartHeader {
            ranges: if self.len == 0 { vec![] } else { vec![(self.start, self.start + self.len)] },
            step: self.step,
            labels: self.state.iter().map(|(k, _)| k.clone()).collect(),
        }
    }

    fn encode(&self, keys: &[Range<usize>]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for classes in keys {
            let at = self.elements(classes)?;
            out.reserve(4 * at.len() * (1 + self.state.len()));
            for t in std::iter::once(&self.weight).chain(self.state.iter().map(|(_, t)| t)) {
                out.extend_from_slice(bytemuck::cast_slice(&t[at.clone()]));
            }
        }
        Ok(out)
    }

    fn decode(header: &PartHeader, bytes: Vec<u8>) -> Result<Self> {
        let (start, end) = match header.ranges[..] {
            [] => (0, 0),
            [r] => r,
            _ => bail!("rows {:?} are not one block", header.ranges),
        };
        let (len, tensors) = (end - start, 1 + header.labels.len());
        let floats = bytes.len() / 4;
        if !bytes.len().is_multiple_of(4) || (len > 0 && !floats.is_multiple_of(len * tensors)) {
            bail!("{} bytes do not hold {tensors} tensors of {len} rows", bytes.len());
        }
        let n = 4 * floats.checked_div(tensors).unwrap_or(0);
        let tensor = |i: usize| bytemuck::pod_collect_to_vec::<u8, f32>(&bytes[i * n..(i + 1) * n]);
        let weight = tensor(0);
        let state =
            header.labels.iter().enumerate().map(|(i, k)| (k.clone(), tensor(i + 1))).collect();
        Ok(RowBlock { start, len, step: header.step, weight, state })
    }

    fn take(&self, keys: &Range<usize>) -> Result<Self> {
        let at = self.elements(keys)?;
        Ok(RowBlock {
            start: keys.start,
            len: keys.len(),
            step: self.step,
            weight: self.weight[at.clone()].to_vec(),
            state: self.state.iter().map(|(k, t)| (k.clone(), t[at.clone()].to_vec())).collect(),
        })
    }

    fn assemble(
        want: &[Range<usize>],
        step: u64,
        labels: &[String],
        pieces: Vec<Self>,
    ) -> Result<Self> {
        let [want] = want else { bail!("rows {want:?} are not one block") };
        let e = pieces.iter().map(RowBlock::embedding).find(|&e| e > 0).unwrap_or(0);
        let mut out = RowBlock {
            start: want.start,
            len: want.len(),
            step,
            weight: vec![0.0; want.len() * e],
            state: labels.iter().map(|k| (k.clone(), vec![0.0; want.len() * e])).collect(),
        };
        for p in &pieces {
            if p.len > 0 && p.embedding() != e {
                bail!("rows {:?} have {} columns, not {e}", p.classes(), p.embedding());
            }
            let at = out.elements(&p.classes())?;
            out.weight[at.clone()].copy_from_slice(&p.weight);
            for (k, t) in &p.state {
                if let Some((_, o)) = out.state.iter_mut().find(|(name, _)| name == k) {
                    o[at.clone()].copy_from_slice(t);
                }
            }
        }
        Ok(out)
    }
}
