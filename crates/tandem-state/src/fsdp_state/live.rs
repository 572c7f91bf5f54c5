//! An `Fsdp` model's shards through a live regroup: the shards, with their optimizer state, as
//! ranges of one flat space of elements (every parameter's elements one after another; a
//! shard's rows are a run of them), mirrored to the next rank and re-split by
//! [`crate::live::Mirrored`] as the PartialFC rows are. After the re-split the model is
//! re-sharded over the new world ([`Fsdp::regroup`]) and the optimizer steps the new shards.
//!
//! An HSDP model's rows hold the same shards: a dead rank's come from its replica in another
//! row (as new as the step, nothing lost), and the mesh re-forms over the new world
//! ([`regroup_rows`]).
//!
//! What no rank holds (two neighbours lost at once) is read from the newest `Fsdp` checkpoint;
//! without one the regroup fails naming the parameter — a parameter never starts afresh.
//! The optimizer's per-parameter scalars (AdamW's `step`) are the same on every rank: they come
//! from the lowest rank that has them.
use std::collections::BTreeSet;
use std::ops::Range;
use std::time::Instant;

use candle_core::Tensor;
use tandem_checkpoint::Saved;
use tandem_ckpt::{TensorData, Value};
use tandem_comm::{DeviceMesh, ProcessGroup};
use tandem_fsdp::{shard_rows, Shard};
use tandem_optim::OptimizerState;

use super::{entry_shard, is_fsdp_checkpoint, model_shard, FsdpShards};
use crate::error::{bail, comm, Context, Result};
use crate::rank_state::elements::{Block, Elements};
use crate::rank_state::part::Mirrored;
use crate::rank_state::{PartLoaded, Resplit};

/// What a regroup calls the shards, and a key's lost step.
pub const FSDP_SHARDS: &str = "fsdp shards";
const LOST_UNIT: &str = "element-steps of training";
/// Bound on a rank's announced optimizer scalars.
const MAX_SCALARS: usize = 64 << 10;

/// Each parameter's first element in the flat space, and the space's size.
fn offsets(shards: &[Shard]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let offsets = shards
        .iter()
        .map(|s| {
            let start = at;
            at += s.total_rows() * row_len(s);
            start
        })
        .collect();
    (offsets, at)
}

fn row_len(s: &Shard) -> usize {
    s.dims.iter().skip(1).product()
}

/// The elements of rows `rows` of parameter `s`, which begins at `offset`.
fn elements(offset: usize, s: &Shard, rows: &Range<usize>) -> Range<usize> {
    offset + rows.start * row_len(s)..offset + rows.end * row_len(s)
}

/// The tensors of an optimizer entry shaped like `dims` (per-element state), by name.
fn per_element<'v>(entry: &'v Value, dims: &[usize]) -> Vec<(&'v str, &'v TensorData)> {
    let Value::Dict(items) = entry else { return Vec::new() };
    items
        .iter()
        .filter_map(|(k, v)| Some((k.as_str()?, v.as_tensor().filter(|t| t.shape == dims)?)))
        .collect()
}

/// An entry's other items (AdamW's `step`): what is the same for every element.
fn scalars_of(entry: &Value, dims: &[usize]) -> Option<Value> {
    let Value::Dict(items) = entry else { return None };
    let rowwise: Vec<&str> = per_element(entry, dims).into_iter().map(|(k, _)| k).collect();
    let rest = items.iter().filter(|(k, _)| k.as_str().is_some_and(|k| !rowwise.contains(&k)));
    Some(Value::Dict(rest.cloned().collect()))
}

impl FsdpShards {
    /// This rank's shards and their optimizer state (`optimizer`'s entries, the trainable
    /// shards' in order) as elements, as of `step`.
    fn own_part(&self, optimizer: &dyn OptimizerState, step: u64) -> Result<Elements> {
        let shards = self.fsdp.shards();
        let (offsets, _) = offsets(&shards);
        let mut entries = Vec::with_capacity(shards.len());
        let mut trainable = 0;
        for s in &shards {
            entries.push(match s.trainable {
                true => optimizer.param_entry(trainable)?,
                false => Value::None,
            });
            trainable += usize::from(s.trainable);
        }
        let mut labels = BTreeSet::new();
        for (s, e) in shards.iter().zip(&entries) {
            labels.extend(per_element(e, s.var.dims()).into_iter().map(|(k, _)| k.to_string()));
        }
        let labels: Vec<String> = labels.into_iter().collect();
        let mut blocks = Vec::new();
        for ((s, e), &offset) in shards.iter().zip(&entries).zip(&offsets) {
            if s.rows.is_empty() {
                continue;
            }
            let what = || format!("reading the shard of `{}`", s.name);
            let values = s.var.flatten_all().and_then(|t| t.to_vec1::<f32>()).with_context(what)?;
            let held = per_element(e, s.var.dims());
            let state = labels
                .iter()
                .map(|l| match held.iter().find(|(k, _)| k == l) {
                    Some((_, t)) => t.to_f32_vec(),
                    None => vec![0.0; values.len()],
                })
                .collect();
            blocks.push(Block { start: elements(offset, s, &s.rows).start, values, state });
        }
        Ok(Elements { step, labels, blocks })
    }

    /// After step `step`: the shards are newer; every `every` steps they go to the next rank
    /// (a collective).
    pub(super) fn mirror_after(
        &mut self,
        group: &ProcessGroup,
        optimizer: &dyn OptimizerState,
        step: u64,
    ) -> Result<()> {
        let Some(live) = self.live.as_mut() else { return Ok(()) };
        live.stepped(step);
        if !live.due(step) {
            return Ok(());
        }
        let clock = Instant::now();
        let own = self.own_part(optimizer, step)?;
        self.send_mirror(group, &own, clock)
    }

    fn send_mirror(&mut self, group: &ProcessGroup, own: &Elements, clock: Instant) -> Result<()> {
        let (_, keys) = offsets(&self.fsdp.shards());
        match self.live.as_mut() {
            Some(live) => live.exchange(group, own, keys, clock),
            None => Ok(()),
        }
    }

    /// Re-splits the shards over the new world `group` (a collective), re-shards the model and
    /// hands the optimizer the new shards; returns their optimizer entries.
    pub(super) fn regroup_live(
        &mut self,
        group: &ProcessGroup,
        step: u64,
        optimizer: &mut dyn OptimizerState,
        last: Option<&Saved>,
    ) -> Result<PartLoaded> {
        let Some(holds) = self.live.as_ref().map(|l| l.holds().is_some()) else {
            return Ok(PartLoaded::default());
        };
        self.built_on = self.world_built_on(group, holds)?;
        let (world, rows) = (group.size(), regroup_rows(self.built_on, group.size()));
        let mesh = (rows, world / rows);
        let Some(mut live) = self.live.take() else { return Ok(PartLoaded::default()) };
        // (Put back whatever happens: a peer lost during the re-split starts another.)
        let resplit = self.resplit(&mut live, group, step, mesh.1, optimizer, last);
        self.live = Some(live);
        let (part, counts) = resplit?;
        let scalars = self.world_scalars(group, optimizer)?;
        let shards = self.fsdp.shards();
        let (offsets, _) = offsets(&shards);
        // Row-major, as `DeviceMesh` lays ranks out: a rank's place in its row.
        let place = group.rank() % mesh.1;
        let mut rows = Vec::with_capacity(shards.len());
        let mut entries = Vec::new();
        for (s, &offset) in shards.iter().zip(&offsets) {
            let new_rows = shard_rows(&s.dims, place, mesh.1);
            let keys = elements(offset, s, &new_rows);
            let mut dims = vec![new_rows.len()];
            dims.extend(s.dims.iter().skip(1));
            let (values, state) = match part.blocks.iter().find(|b| b.start == keys.start) {
                Some(b) if !keys.is_empty() => (b.values.clone(), b.state.clone()),
                _ => (Vec::new(), vec![Vec::new(); part.labels.len()]),
            };
            let what = || format!("the new shard of `{}`", s.name);
            rows.push(Tensor::from_vec(values, dims.clone(), s.var.device()).with_context(what)?);
            if s.trainable {
                entries.push(match (&scalars, part.labels.is_empty()) {
                    (Some(Value::Dict(items)), false) => {
                        let mut entry = items.clone();
                        for (label, v) in part.labels.iter().zip(state) {
                            let t = TensorData::from_f32(&dims, &v);
                            entry.push((Value::Str(label.clone()), Value::Tensor(t)));
                        }
                        Value::Dict(entry)
                    }
                    _ => Value::None,
                });
            }
        }
        let resharded = match mesh.0 {
            1 => self.fsdp.regroup(group, rows),
            r => {
                let mesh = DeviceMesh::new(group, &[r, mesh.1], None)
                    .map_err(comm("live recovery: forming the HSDP mesh"))?;
                self.fsdp.regroup_on_mesh(&mesh, rows)
            }
        };
        resharded.context("re-sharding the model over the new world")?;
        for (i, var) in self.fsdp.params().into_iter().enumerate() {
            optimizer.replace_param(i, var)?;
        }
        // The new shards are this rank's own now: mirrored at once, so the next death is covered.
        self.send_mirror(group, &part, Instant::now())?;
        let layout = (self.built_on.0 > 1).then(|| {
            let (r, w) = self.built_on;
            format!("HSDP mesh now {}x{} (built {r}x{w})", mesh.0, mesh.1)
        });
        let (part_name, lost_unit) = (FSDP_SHARDS.into(), LOST_UNIT.into());
        let resplit = Resplit { part: part_name, lost_unit, counts, layout };
        Ok(PartLoaded { entries, note: None, resplit: Some(resplit) })
    }

    /// The mesh the model was built on, as the ranks that hold shards know it (the lowest one's;
    /// a replacement built on a world of its own knows none): every rank agrees (a collective).
    fn world_built_on(&self, group: &ProcessGroup, holds: bool) -> Result<(usize, usize)> {
        let (rows, width) = self.built_on;
        // (0, 0): a rank that knows none.
        let mine = match holds {
            true => [rows, width].map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
            false => [0, 0],
        };
        let mut all = vec![0i64; 2 * group.size()];
        group
            .all_gather(&mine, &mut all)
            .map_err(comm("live recovery: agreeing on the HSDP mesh"))?;
        let count = |n: i64| usize::try_from(n).unwrap_or(0).max(1);
        let first = all.chunks_exact(2).find(|m| m[0] > 0);
        Ok(first.map_or((1, group.size()), |m| (count(m[0]), count(m[1]))))
    }

    fn resplit(
        &self,
        live: &mut Mirrored<Elements>,
        group: &ProcessGroup,
        step: u64,
        width: usize,
        optimizer: &dyn OptimizerState,
        last: Option<&Saved>,
    ) -> Result<(Elements, crate::rank_state::RegroupCounts)> {
        let own = live.holds().map(|at| self.own_part(optimizer, at)).transpose()?;
        let shards = self.fsdp.shards();
        let (offsets, keys) = offsets(&shards);
        // Every row of an HSDP mesh wants the same elements: its own copy of each shard.
        let want = |rank: usize| -> Vec<Range<usize>> {
            let rows = |s: &Shard| shard_rows(&s.dims, rank % width, width);
            let of = |(s, &o): (&Shard, &usize)| elements(o, s, &rows(s));
            shards.iter().zip(&offsets).map(of).filter(|k| !k.is_empty()).collect()
        };
        let mut fill = |keys: Range<usize>| reload(last, &shards, &offsets, keys).map(Some);
        live.regroup(group, step, keys, own.as_ref(), &want, &mut fill)
    }

    /// The optimizer's per-parameter scalars (AdamW's `step`) of the lowest rank that has any
    /// (a replacement has none), the same on every rank; `None` before the first step (a
    /// collective).
    fn world_scalars(
        &self,
        group: &ProcessGroup,
        optimizer: &dyn OptimizerState,
    ) -> Result<Option<Value>> {
        let mut mine = None;
        let trainable = self.fsdp.shards().into_iter().filter(|s| s.trainable);
        for (i, s) in trainable.enumerate() {
            mine = scalars_of(&optimizer.param_entry(i)?, s.var.dims());
            if mine.is_some() {
                break;
            }
        }
        let bytes = match &mine {
            Some(v) => tandem_ckpt::to_pt_bytes(v).context("encoding the optimizer's scalars")?,
            None => Vec::new(),
        };
        let all = group
            .all_gather_bytes_at_most(&bytes, MAX_SCALARS)
            .map_err(comm("live recovery: agreeing on the optimizer's scalars"))?;
        let Some((rank, first)) = all.into_iter().enumerate().find(|(_, b)| !b.is_empty()) else {
            return Ok(None);
        };
        let v = tandem_ckpt::pt::load_from_bytes("optimizer scalars", first, false)
            .with_context(|| format!("rank {rank}'s optimizer scalars"))?;
        Ok(Some(v))
    }
}

/// The rows of the mesh an HSDP model built on `rows` rows of `width` ranks re-forms on over
/// `world` ranks: the most rows up to `rows` that divide `world` and keep each row at least
/// `width` wide (no rank holds more of the model than it was built to), else 1 — plain FSDP
/// over every rank. A world that grows back gets the rows back.
fn regroup_rows((rows, width): (usize, usize), world: usize) -> usize {
    // (`rows` came from a peer: never more candidates than ranks.)
    let most = rows.min(world).max(1);
    (1..=most).rev().find(|&r| world.is_multiple_of(r) && world / r >= width).unwrap_or(1)
}

/// Elements `keys` (rows of one parameter) no rank holds, from the newest `Fsdp` checkpoint.
fn reload(
    last: Option<&Saved>,
    shards: &[Shard],
    offsets: &[usize],
    keys: Range<usize>,
) -> Result<Elements> {
    let p = offsets.partition_point(|&o| o <= keys.start).saturating_sub(1);
    let s = &shards[p];
    let (start, n) = (keys.start - offsets[p], row_len(s).max(1));
    let rows = start / n..(keys.end - offsets[p]).div_ceil(n);
    if elements(offsets[p], s, &rows) != keys {
        bail!("elements {keys:?} are not whole rows of `{}`", s.name);
    }
    let Some(saved) = last.filter(|s| is_fsdp_checkpoint(s)) else {
        bail!(
            "rows {rows:?} of `{}`: no rank holds them (two neighbours lost at once) and there \
             is no Fsdp checkpoint to read them from",
            s.name
        );
    };
    let at = saved.path().display();
    let mut dims = vec![rows.len()];
    dims.extend(s.dims.iter().skip(1));
    let value = saved.read_rows(&model_shard(&s.name), rows.clone())?;
    let values = match value.as_tensor() {
        Some(t) if t.shape == dims => t.to_f32_vec(),
        _ => bail!("{at}: `{}` rows {rows:?} are not of shape {dims:?}", s.name),
    };
    let trainable = shards[..p].iter().filter(|s| s.trainable).count();
    let entry = match s.trainable && saved.rows_total(&entry_shard(trainable)).is_some() {
        true => saved.read_rows(&entry_shard(trainable), rows.clone())?,
        false => Value::None,
    };
    let mut held = per_element(&entry, &dims);
    held.sort_by_key(|(k, _)| *k);
    let block = Block {
        start: keys.start,
        values,
        state: held.iter().map(|(_, t)| t.to_f32_vec()).collect(),
    };
    let labels = held.iter().map(|(k, _)| k.to_string()).collect();
    Ok(Elements { step: saved.global_step(), labels, blocks: vec![block] })
}

#[cfg(test)]
mod tests {
    use super::regroup_rows;

    #[test]
    fn an_hsdp_mesh_keeps_as_many_rows_as_divide_the_world_without_narrowing_them() {
        // 2 rows of 2: 3 survivors make no rows of 2, so one row of 3; back to 4, 2 rows again.
        assert_eq!(regroup_rows((2, 2), 3), 1);
        assert_eq!(regroup_rows((2, 2), 4), 2);
        // Two lost: 2 rows of 1 would double each rank's shards; one row of 2 keeps them.
        assert_eq!(regroup_rows((2, 2), 2), 1);
        // 4 rows of 2 down to 6 ranks: 3 rows of 2; down to 4: 2 rows of 2, not 4 rows of 1.
        assert_eq!(regroup_rows((4, 2), 6), 3);
        assert_eq!(regroup_rows((4, 2), 4), 2);
        // More ranks than it was built on: never more rows than asked.
        assert_eq!(regroup_rows((2, 2), 8), 2);
        // Plain FSDP stays plain; a peer's absurd announcement does not loop for long.
        assert_eq!(regroup_rows((1, 4), 3), 1);
        assert_eq!(regroup_rows((usize::MAX, 1), 6), 6);
    }
}
