//! A model sharded by tandem-fsdp's `Fsdp` as a [`RankState`] part: every parameter's rows
//! this rank holds, and the optimizer's entries for them (all of them: the optimizer steps the
//! shards), saved as row shards `model/NAME` and `optimizer/state/I`. A resume on any world
//! size reads each parameter's rows of the new layout from whichever ranks wrote them, and
//! `tandem ckpt convert` stacks the rows back into the full state dict PyTorch loads (the model
//! under `model`, the entries under `optimizer`'s `state`). Under live recovery the shards
//! are mirrored and re-split over a new world (`live`).
mod live;

use std::sync::LazyLock;

use tandem_checkpoint::{slice_rows, Saved, ShardDict};
use tandem_ckpt::Value;
use tandem_fsdp::{Fsdp, Shard};
use tandem_nn::NamedVars;

use crate::error::{Context, Result, TrainError};
use crate::rank_state::{PartLoaded, RankState};

/// The replicated model of a sharded run: nothing (every parameter is in the part).
pub(crate) static NO_MODEL: LazyLock<NamedVars> = LazyLock::new(|| NamedVars::new(Vec::new()));

/// An `Fsdp` model's shards as a training state part (see the module docs). The optimizer
/// must step [`Fsdp::params`] in that order.
pub struct FsdpShards {
    fsdp: Fsdp,
    buffers: Option<String>,
    order: Vec<String>,
    /// Under live recovery: the mirror of the previous rank's shards.
    live: Option<crate::rank_state::part::Mirrored<crate::rank_state::elements::Elements>>,
    /// The mesh the model was built on, (rows, ranks a row): what a live regroup re-forms as
    /// far as the new world allows.
    built_on: (usize, usize),
}

impl FsdpShards {
    pub fn new(fsdp: &Fsdp) -> FsdpShards {
        let built_on = (fsdp.replicas(), fsdp.world_size());
        FsdpShards { fsdp: fsdp.clone(), buffers: None, order: Vec::new(), live: None, built_on }
    }

    /// Under live recovery (`tandem run --live-recovery`): every `every` steps this rank's
    /// shards and their optimizer state go to the next rank of the ring, and after a regroup
    /// the shards are re-split over the new world, each element from its newest holder (a
    /// dead rank's from its mirror), the model re-sharded ([`Fsdp::regroup`]) and the
    /// optimizer handed the new shards. `holds`: whether this rank holds shards of the running
    /// job (a replacement holds none until it joins). An HSDP model re-forms its mesh over the
    /// new world: as many of its rows as divide the world and keep each row as wide as it was
    /// built (no rank holds more of the model than before), else one row, plain FSDP over
    /// every rank; a dead rank's shards come from a replica in another row, as new as the
    /// step.
    pub fn live(mut self, every: u64, holds: bool) -> FsdpShards {
        self.live = Some(crate::rank_state::part::Mirrored::new(every, holds));
        self
    }

    /// The full state dict's key order (PyTorch's `state_dict()` order, buffers among the
    /// parameters; see [`crate::TrainingState::order`]); by default the parameters' order,
    /// then the buffers.
    pub fn with_order(mut self, order: Vec<String>) -> FsdpShards {
        self.order = order;
        self
    }

    /// The model's buffers (BatchNorm statistics, kept whole on every rank) are saved by
    /// another part as rank shard `shard` ([`crate::RankBuffers`]): the full state dict of the
    /// checkpoint ([`fsdp_consolidated`], `tandem ckpt convert`, FSDP2's layout) takes rank 0's.
    pub fn with_buffers_in(mut self, shard: impl Into<String>) -> FsdpShards {
        self.buffers = Some(shard.into());
        self
    }
}

/// The rank shard naming the parameters behind the optimizer's entries.
const LAYOUT_SHARD: &str = "fsdp";

/// Whether `saved` holds an `Fsdp` model's rows (its parameters are not in `model`).
pub(crate) fn is_fsdp_checkpoint(saved: &Saved) -> bool {
    saved.shard_names().contains(&LAYOUT_SHARD)
}

fn model_shard(name: &str) -> String {
    format!("model/{name}")
}

fn entry_shard(index: usize) -> String {
    format!("optimizer/state/{index}")
}

/// `shard`'s rows as shard `name`; an HSDP replica other than the first saves none (its copy
/// is the first's), so the saved rows still tile each parameter once.
fn rows(shard: &Shard, name: &str, value: Value, first_copy: bool) -> ShardDict {
    let (len, value) = if first_copy { (shard.rows.len(), value) } else { (0, Value::None) };
    ShardDict::rows(name, shard.rows.start, len, shard.total_rows(), value)
}

/// Puts saved rows `t` (this rank's of the parameter) into shard `s`; `what` names them.
fn set_shard(s: &Shard, t: &tandem_ckpt::TensorData, what: impl Fn() -> String) -> Result<()> {
    let t = tandem_nn::convert::from_ckpt(t, s.var.device()).with_context(&what)?;
    if t.dims() != s.var.dims() {
        return Err(TrainError::Invalid(format!(
            "{}: rows of shape {:?}, the shard is {:?}",
            what(),
            t.dims(),
            s.var.dims()
        )));
    }
    s.var.set(&t.to_dtype(s.var.dtype()).with_context(&what)?).with_context(&what)
}

impl RankState for FsdpShards {
    fn optimizer_entries(&self) -> Vec<usize> {
        (0..self.fsdp.params().len()).collect()
    }

    fn shards(&self, entries: Vec<Value>, _step: u64) -> Result<Vec<ShardDict>> {
        let shards = self.fsdp.shards();
        let first = self.fsdp.is_first_replica();
        let mut out = Vec::with_capacity(shards.len() + entries.len());
        for s in &shards {
            let t = tandem_nn::convert::to_ckpt(s.var.as_tensor())?;
            out.push(rows(s, &model_shard(&s.name), Value::Tensor(t), first));
        }
        let mut entries = entries.into_iter();
        let mut trainable = Vec::new();
        for (i, s) in shards.iter().filter(|s| s.trainable).enumerate() {
            out.push(rows(s, &entry_shard(i), entries.next().unwrap_or(Value::None), first));
            trainable.push(Value::Str(s.name.clone()));
        }
        // Which parameter each optimizer entry is (FSDP2's state dicts key entries by name).
        let mut layout = vec![("params", Value::List(trainable))];
        if let Some(shard) = &self.buffers {
            layout.push(("buffers", Value::Str(shard.clone())));
        }
        if !self.order.is_empty() {
            let order = self.order.iter().map(|n| Value::Str(n.clone())).collect();
            layout.push(("order", Value::List(order)));
        }
        out.push(ShardDict::rank(LAYOUT_SHARD, Value::dict_from(layout)));
        Ok(out)
    }

    fn load(&mut self, saved: &Saved) -> Result<PartLoaded> {
        if !is_fsdp_checkpoint(saved) {
            return self.load_replicated(saved);
        }
        let path = saved.path().display().to_string();
        let shards = self.fsdp.shards();
        let ours: Vec<String> = shards.iter().map(|s| model_shard(&s.name)).collect();
        if let Some(extra) = saved
            .shard_names()
            .into_iter()
            .find(|n| n.starts_with("model/") && !ours.iter().any(|o| o == n))
        {
            return Err(TrainError::Invalid(format!(
                "{path}: parameter `{}` is not in this model (a checkpoint of another model?)",
                &extra["model/".len()..]
            )));
        }
        let mut entries = Vec::new();
        let mut trainable = 0;
        for s in &shards {
            let name = model_shard(&s.name);
            let Some(total) = saved.rows_total(&name) else {
                return Err(TrainError::Invalid(format!(
                    "{path}: no parameter `{}` (a checkpoint of another model?)",
                    s.name
                )));
            };
            let what = || format!("{path}: parameter `{}`", s.name);
            if total != s.total_rows() {
                return Err(TrainError::Invalid(format!(
                    "{}: {total} rows saved, the model has {:?}",
                    what(),
                    s.dims
                )));
            }
            if !s.rows.is_empty() {
                let value = saved.read_rows(&name, s.rows.clone())?;
                let t = value.as_tensor().with_context(|| format!("{}: not a tensor", what()))?;
                set_shard(s, t, what)?;
            }
            if s.trainable {
                let name = entry_shard(trainable);
                trainable += 1;
                let entry = match saved.rows_total(&name) {
                    Some(_) if !s.rows.is_empty() => saved.read_rows(&name, s.rows.clone())?,
                    _ => Value::None,
                };
                entries.push(entry);
            }
        }
        let note = (saved.world_size() != self.fsdp.world_size()).then(|| {
            format!(
                "Fsdp shards of {} parameters re-split from {} ranks to {}",
                shards.len(),
                saved.world_size(),
                self.fsdp.world_size()
            )
        });
        Ok(PartLoaded { entries, note, resplit: None })
    }

    fn after_step(
        &mut self,
        group: &tandem_comm::ProcessGroup,
        optimizer: &dyn tandem_optim::OptimizerState,
        step: u64,
    ) -> Result<()> {
        self.mirror_after(group, optimizer, step)
    }

    fn regroup(
        &mut self,
        group: &tandem_comm::ProcessGroup,
        step: u64,
        optimizer: &mut dyn tandem_optim::OptimizerState,
        _world_optimizer: &Value,
        last: Option<&Saved>,
    ) -> Result<PartLoaded> {
        self.regroup_live(group, step, optimizer, last)
    }

    fn mirror_cost(&self) -> Option<crate::rank_state::MirrorCost> {
        self.live.as_ref().map(|live| live.cost("fsdp shards"))
    }
}

impl FsdpShards {
    /// A replicated model's checkpoint (a Ddp run's) resumed sharded: each shard cut from its
    /// whole parameter, each optimizer entry's tensors cut to the shard's rows.
    fn load_replicated(&mut self, saved: &Saved) -> Result<PartLoaded> {
        let path = saved.path().display().to_string();
        let whole = saved.consolidated()?;
        let model = whole.get("model");
        let state = whole.get("optimizer").and_then(|o| o.get("state"));
        let (mut entries, mut trainable) = (Vec::new(), 0);
        for s in self.fsdp.shards() {
            let what = || format!("{path}: parameter `{}`", s.name);
            let Some(t) = model.and_then(|m| m.get(&s.name)).and_then(Value::as_tensor) else {
                let why = "not in its model (a checkpoint of another model?)";
                return Err(TrainError::Invalid(format!("{}: {why}", what())));
            };
            if t.shape != s.dims {
                let why = format!("{:?} saved, the model has {:?}", t.shape, s.dims);
                return Err(TrainError::Invalid(format!("{}: {why}", what())));
            }
            if !s.rows.is_empty() {
                set_shard(&s, &slice_rows(t, s.rows.clone()), what)?;
            }
            if s.trainable {
                let entry = state.and_then(|st| entry_of(st, trainable));
                let rows = s.rows.clone();
                let cut = |e: &Value| cut_rows(e, s.total_rows(), &rows);
                entries.push(entry.filter(|_| !rows.is_empty()).map_or(Value::None, cut));
                trainable += 1;
            }
        }
        let note = format!(
            "a replicated model's checkpoint, sharded over {} ranks",
            self.fsdp.world_size()
        );
        Ok(PartLoaded { entries, note: Some(note), resplit: None })
    }
}

/// Entry `index` of an optimizer's `state` dict.
fn entry_of(state: &Value, index: usize) -> Option<&Value> {
    let Value::Dict(items) = state else { return None };
    items.iter().find(|(k, _)| k.as_int() == Some(index as i64)).map(|(_, v)| v)
}

/// `entry` with every tensor of `total` rows cut to `rows` (a step count stays whole).
fn cut_rows(entry: &Value, total: usize, rows: &std::ops::Range<usize>) -> Value {
    match entry {
        Value::Tensor(t) if t.shape.first() == Some(&total) => {
            Value::Tensor(slice_rows(t, rows.clone()))
        }
        Value::Dict(items) => {
            Value::Dict(items.iter().map(|(k, v)| (k.clone(), cut_rows(v, total, rows))).collect())
        }
        other => other.clone(),
    }
}

/// An `Fsdp` model's checkpoint as PyTorch FSDP2 names its state: `{"model":
/// get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}` with full
/// tensors, the optimizer's entries and param groups keyed by parameter name — what `dcp.save`
/// would have written, for `dcp.load` into an FSDP2 model on any number of ranks followed by
/// `set_model_state_dict` / `set_optimizer_state_dict`. `None` when `saved` is not of an
/// `Fsdp` model.
pub fn fsdp2_state_dict(saved: &Saved) -> Result<Option<Value>> {
    let Some(whole) = fsdp_consolidated(saved)? else { return Ok(None) };
    let path = saved.path().display().to_string();
    let bad = |what: &str| TrainError::Invalid(format!("{path}: {what}"));
    let names: Vec<String> = layout(&whole, "params")
        .and_then(|p| match p {
            Value::List(items) => items.iter().map(|i| i.as_str().map(String::from)).collect(),
            _ => None,
        })
        .ok_or_else(|| bad("`fsdp` does not list the parameters"))?;
    let name_of = |index: &Value| {
        let i = index.as_int().ok_or_else(|| bad("an optimizer entry not keyed by an index"))?;
        names
            .get(i as usize)
            .cloned()
            .ok_or_else(|| bad(&format!("optimizer entry {i} of {}", names.len())))
    };
    let model = whole.get("model").cloned().ok_or_else(|| bad("no model"))?;
    let optimizer = whole.get("optimizer").ok_or_else(|| bad("no optimizer"))?;
    let mut state = Vec::new();
    if let Some(Value::Dict(entries)) = optimizer.get("state") {
        for (index, entry) in entries {
            state.push((Value::Str(name_of(index)?), entry.clone()));
        }
    }
    let mut groups = Vec::new();
    if let Some(Value::List(saved_groups)) = optimizer.get("param_groups") {
        for group in saved_groups {
            let mut group = group.clone();
            let params = match group.get("params") {
                Some(Value::List(ids)) => {
                    ids.iter().map(|i| name_of(i).map(Value::Str)).collect::<Result<Vec<_>>>()?
                }
                _ => return Err(bad("a param group without `params`")),
            };
            group.insert("params", Value::List(params));
            groups.push(group);
        }
    }
    let optim =
        Value::dict_from([("state", Value::Dict(state)), ("param_groups", Value::List(groups))]);
    Ok(Some(Value::dict_from([("model", model), ("optim", optim)])))
}

/// Entry `key` of the layout rank shard of a consolidated `Fsdp` checkpoint.
fn layout<'v>(whole: &'v Value, key: &str) -> Option<&'v Value> {
    match whole.get(LAYOUT_SHARD) {
        Some(Value::List(ranks)) => ranks.first().and_then(|r| r.get(key)),
        _ => None,
    }
}

/// An `Fsdp` checkpoint as one dict ([`Saved::consolidated`]: every parameter's rows stacked
/// under `model`, the optimizer's entries under `optimizer`) with rank 0's buffers in `model`
/// too, so `model` is the full state dict; `None` when `saved` is not of an `Fsdp` model.
pub fn fsdp_consolidated(saved: &Saved) -> Result<Option<Value>> {
    if !is_fsdp_checkpoint(saved) {
        return Ok(None);
    }
    let mut whole = saved.consolidated()?;
    let shard = layout(&whole, "buffers").and_then(Value::as_str).map(String::from);
    let buffers = match (&shard, &shard.as_ref().and_then(|s| whole.get(s))) {
        (Some(_), Some(Value::List(ranks))) => ranks.first().cloned(),
        (Some(s), _) => {
            let path = saved.path().display();
            return Err(TrainError::Invalid(format!(
                "{path}: the buffers' rank shard `{s}` is missing"
            )));
        }
        _ => None,
    };
    let order: Vec<String> = match layout(&whole, "order") {
        Some(Value::List(names)) => {
            names.iter().filter_map(Value::as_str).map(String::from).collect()
        }
        _ => Vec::new(),
    };
    if let Some(Value::Dict(model)) = whole.get_mut("model") {
        if let Some(Value::Dict(items)) = buffers {
            model.extend(items);
        }
        let rank = |k: &Value| {
            k.as_str().and_then(|k| order.iter().position(|o| o == k)).unwrap_or(usize::MAX)
        };
        model.sort_by_key(|(k, _)| rank(k)); // stable: without an order, as saved
    }
    Ok(Some(whole))
}

/// Restores an `Fsdp` model and its optimizer (stepping [`Fsdp::params`]) from a PyTorch FSDP2
/// distributed checkpoint — `dcp.save({"model": get_model_state_dict(model), "optim":
/// get_optimizer_state_dict(model, optimizer)}, checkpoint_id=dir)` — written on any number of
/// ranks: each rank reads only the chunks that hold its rows. The optimizer's hyperparameters
/// come from the checkpoint's param groups, as `set_optimizer_state_dict` sets them.
pub fn load_fsdp2_dcp(
    dir: &std::path::Path,
    fsdp: &Fsdp,
    optimizer: &mut dyn tandem_optim::OptimizerState,
) -> Result<()> {
    use tandem_ckpt::dcp;
    let md = dcp::read_metadata(dir)?;
    let at = dir.display();
    // A tensor shaped like the parameter: this rank's rows (none on a rank without rows);
    // anything else (a step count): whole.
    let rows_of = |key: &str, s: &Shard| -> Result<Option<Value>> {
        let Some(dcp::Item::Tensor { size, .. }) = md.item(key) else {
            return Err(TrainError::Invalid(format!("{at}: `{key}` is not a tensor")));
        };
        let rows = match size.first() {
            Some(_) if size[..] == s.dims[..] => s.rows.clone(),
            first => 0..first.copied().unwrap_or(1),
        };
        if size[..] == s.dims[..] && rows.is_empty() {
            return Ok(None);
        }
        Ok(Some(Value::Tensor(dcp::load_rows(dir, &md, key, rows)?)))
    };
    let shards = fsdp.shards();
    let mut state = Vec::new();
    for s in &shards {
        let key = dcp::key_at(&md, &["model", &s.name]).ok_or_else(|| {
            TrainError::Invalid(format!(
                "{at}: no `model` entry `{}` (a checkpoint of another model?)",
                s.name
            ))
        })?;
        match md.item(key) {
            Some(dcp::Item::Tensor { size, .. }) if size[..] == s.dims[..] => {}
            _ => {
                return Err(TrainError::Invalid(format!(
                    "{at}: `{key}` is not of shape {:?}",
                    s.dims
                )))
            }
        }
        if let Some(Value::Tensor(t)) = rows_of(key, s)? {
            set_shard(s, &t, || format!("{at}: `{key}`"))?;
        }
    }
    for (i, s) in shards.iter().filter(|s| s.trainable).enumerate() {
        let mut entry = Vec::new();
        for (key, parts) in &md.paths {
            let field = match &parts[..] {
                [dcp::PathPart::Key(o), dcp::PathPart::Key(st), dcp::PathPart::Key(n), dcp::PathPart::Key(f)]
                    if o == "optim" && st == "state" && *n == s.name =>
                {
                    f
                }
                _ => continue,
            };
            let value = match md.item(key) {
                Some(dcp::Item::Tensor { .. }) => rows_of(key, s)?,
                _ => Some(dcp::load_object(dir, &md, key)?),
            };
            entry.extend(value.map(|v| (field.clone(), v)));
        }
        if !entry.is_empty() {
            state.push((Value::Int(i as i64), Value::dict_from(entry)));
        }
    }
    let names: Vec<&str> = shards.iter().filter(|s| s.trainable).map(|s| s.name.as_str()).collect();
    // `dcp.save` flattens the param groups: `optim.param_groups.G.FIELD`, one object each.
    let mut groups: Vec<Vec<(String, Value)>> = Vec::new();
    for (key, parts) in &md.paths {
        let (g, field) = match &parts[..] {
            [dcp::PathPart::Key(o), dcp::PathPart::Key(pg), dcp::PathPart::Index(g), dcp::PathPart::Key(f)]
                if o == "optim" && pg == "param_groups" && *g >= 0 =>
            {
                (*g as usize, f)
            }
            _ => continue,
        };
        if groups.len() <= g {
            groups.resize_with(g + 1, Vec::new);
        }
        let mut value = dcp::load_object(dir, &md, key)?;
        if field == "params" {
            let Value::List(saved) = value else {
                return Err(TrainError::Invalid(format!("{at}: `{key}` is not a list of names")));
            };
            let index = |n: &Value| {
                let n = n.as_str().unwrap_or_default();
                let i = names.iter().position(|m| *m == n).ok_or_else(|| {
                    TrainError::Invalid(format!(
                        "{at}: `{key}` names `{n}`, not a trainable parameter here"
                    ))
                })?;
                Ok(Value::Int(i as i64))
            };
            // By position in this optimizer's parameters, as torch's `load_state_dict` pairs
            // a group's saved ids with its parameters (FSDP2 lists them in module order).
            let mut ids: Vec<Value> = saved.iter().map(index).collect::<Result<_>>()?;
            ids.sort_by_key(|v| v.as_int());
            value = Value::List(ids);
        }
        groups[g].push((field.clone(), value));
    }
    if groups.is_empty() {
        return Err(TrainError::Invalid(format!("{at}: no `optim` param groups")));
    }
    let groups: Vec<Value> = groups.into_iter().map(Value::dict_from).collect();
    let value =
        Value::dict_from([("state", Value::Dict(state)), ("param_groups", Value::List(groups))]);
    optimizer.load_optimizer_state(&value).with_context(|| format!("{at}: the optimizer state"))
}
