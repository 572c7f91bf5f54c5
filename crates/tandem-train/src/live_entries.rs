//! ZeRO-1's optimizer shards as a [`RankPart`]: each rank holds the optimizer state of the
//! parameters it owns, keyed by parameter index, and [`crate::live_part`] mirrors and re-splits
//! them. A parameter nobody holds (two neighbours lost at once) starts with fresh optimizer
//! state, counted; the parameters themselves are replicated and never lost.
//!
//! Entries travel as a `.pt` image of a torch optimizer state dict's `state` (integer keys).
use std::ops::Range;

use tandem_ckpt::Value;

use crate::live_part::{runs, PartHeader, RankPart};

/// Entries (parameter index → its optimizer state) held as of `step`, by ascending index.
#[derive(Clone, Debug, PartialEq)]
pub struct Entries {
    pub step: u64,
    pub entries: Vec<(usize, Value)>,
}

impl Entries {
    /// The `state` dict of a torch-layout optimizer state dict (integer keys) as of `step`.
    pub fn from_state(state: &Value, step: u64) -> Entries {
        let mut entries: Vec<(usize, Value)> = match state {
            Value::Dict(items) => items
                .iter()
                .filter_map(|(k, v)| Some((usize::try_from(k.as_int()?).ok()?, v.clone())))
                .collect(),
            _ => Vec::new(),
        };
        entries.sort_by_key(|(i, _)| *i);
        entries.dedup_by_key(|(i, _)| *i);
        Entries { step, entries }
    }

    /// The entries as a `state` dict (integer keys).
    pub fn into_state(self) -> Value {
        Value::Dict(self.entries.into_iter().map(|(i, v)| (Value::Int(i as i64), v)).collect())
    }

    fn within(&self, keys: &[Range<usize>]) -> Vec<(usize, Value)> {
        let inside = |i: &usize| keys.iter().any(|k| k.contains(i));
        self.entries.iter().filter(|(i, _)| inside(i)).cloned().collect()
    }
}

impl RankPart for Entries {
    const WHAT: &'static str = "the ZeRO optimizer shards";

    fn header(&self) -> PartHeader {
        let ranges = runs(self.entries.iter().map(|(i, _)| *i));
        PartHeader {
            ranges: ranges.iter().map(|r| (r.start, r.end)).collect(),
            step: self.step,
            labels: vec![],
        }
    }

    fn encode(&self, keys: &[Range<usize>]) -> Result<Vec<u8>, String> {
        let state = Entries { step: self.step, entries: self.within(keys) }.into_state();
        tandem_ckpt::to_pt_bytes(&state).map_err(|e| e.to_string())
    }

    fn decode(header: &PartHeader, bytes: Vec<u8>) -> Result<Self, String> {
        let v = tandem_ckpt::pt::load_from_bytes("optimizer entries", bytes, false)
            .map_err(|e| e.to_string())?;
        let got = Entries::from_state(&v, header.step);
        let held = got.header().ranges;
        if held != header.ranges {
            return Err(format!("entries for parameters {held:?}, announced {:?}", header.ranges));
        }
        Ok(got)
    }

    fn take(&self, keys: &Range<usize>) -> Result<Self, String> {
        Ok(Entries { step: self.step, entries: self.within(std::slice::from_ref(keys)) })
    }

    fn assemble(
        _want: &[Range<usize>],
        step: u64,
        _labels: &[String],
        pieces: Vec<Self>,
    ) -> Result<Self, String> {
        let mut entries: Vec<(usize, Value)> = pieces.into_iter().flat_map(|p| p.entries).collect();
        entries.sort_by_key(|(i, _)| *i);
        Ok(Entries { step, entries })
    }
}
