//! `ZeroRedundancyOptimizer` (PyTorch's, ZeRO stage 1): every rank keeps the optimizer state
//! of only its 1/N of the parameters, updates that shard from the (already averaged) gradients,
//! and then every rank broadcasts its updated shard, so all replicas hold the same weights
//! again. Optimizer-state memory per rank falls to about 1/N; the update itself is the wrapped
//! optimizer's, so the weights equal those of the unsharded optimizer bit for bit.
//!
//! Partition (as torch's `_partition_parameters`): parameters sorted by size, largest first,
//! each to the rank with the fewest elements so far (ties: the lowest rank).
//!
//! State, as torch: [`ZeroRedundancyOptimizer::consolidate_state_dict`] (every rank calls it)
//! gathers the shards on one rank, whose `state_dict()` is then a plain torch optimizer state
//! dict over all parameters (`torch.optim.SGD(...).load_state_dict` takes it);
//! `load_state_dict` takes such a dict on every rank, whatever world size wrote it (entries of
//! parameters another rank owns may be absent). A sharded checkpoint, without gathering
//! anything, goes through tandem's one checkpoint API: [`TorchOptimizer::shard`] is this
//! rank's entries and the hyperparameters (`tandem::train::save_state` writes them as an
//! entry shard). The directories of the earlier ZeRO-only format (`tandem-zero1`: one file per
//! rank plus a manifest) still load ([`load_sharded`](ZeroRedundancyOptimizer::load_sharded))
//! and convert ([`consolidate_sharded`], `tandem ckpt convert DIR out.pt`).
//!
//! One parameter group (the wrapped optimizer is built over this rank's shard by a closure);
//! f32 parameters (the broadcast carries f32).
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::Var;
use serde::{Deserialize, Serialize};
use tandem_ckpt::Value;

use crate::{OptimError, TorchOptimizer};
use tandem_comm::Collectives;

/// The optimizer a rank runs over its shard.
pub type ShardOptimizer = Box<dyn TorchOptimizer + Send>;

/// Builds the optimizer over a rank's shard (kept: a repartition builds it again).
type ShardFactory = Arc<dyn Fn(Vec<Var>) -> Result<ShardOptimizer, OptimError> + Send + Sync>;

/// Which rank owns which parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    /// Owner rank of each parameter, by global index.
    pub owner: Vec<usize>,
}

impl Partition {
    /// torch's greedy split of parameters with `numels` elements over `world` ranks.
    pub fn new(numels: &[usize], world: usize) -> Partition {
        let mut order: Vec<usize> = (0..numels.len()).collect();
        order.sort_by(|&a, &b| numels[b].cmp(&numels[a]).then(a.cmp(&b)));
        let mut load = vec![0usize; world.max(1)];
        let mut owner = vec![0; numels.len()];
        for i in order {
            let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            owner[i] = r;
            load[r] += numels[i];
        }
        Partition { owner }
    }

    /// Global indices of rank `r`'s parameters, ascending.
    pub fn of(&self, r: usize) -> Vec<usize> {
        (0..self.owner.len()).filter(|&i| self.owner[i] == r).collect()
    }

    pub fn world(&self) -> usize {
        self.owner.iter().max().map_or(1, |m| m + 1)
    }
}

/// The manifest of a sharded optimizer checkpoint (`manifest.json` beside the rank files).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardManifest {
    /// `tandem-zero1`.
    pub format: String,
    pub world_size: usize,
    /// Shape of every parameter, by global index.
    pub shapes: Vec<Vec<usize>>,
    pub partition: Partition,
    /// The rank files, by rank (names relative to the directory).
    pub files: Vec<String>,
}

pub const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "tandem-zero1";

pub struct ZeroRedundancyOptimizer {
    comm: Arc<dyn Collectives>,
    params: Vec<Var>,
    partition: Partition,
    /// Global indices of each rank's parameters (computed once: the step broadcasts by them).
    owned: Vec<Vec<usize>>,
    /// `None` on a rank that owns no parameter (more ranks than parameters).
    local: Option<ShardOptimizer>,
    consolidated: Option<Value>,
    /// This rank's place when the partition was made (a live world's collectives may report a
    /// new rank before [`ZeroRedundancyOptimizer::repartition`] takes the new partition on).
    rank: usize,
    make: ShardFactory,
}

/// Names the optimizer's collective that failed.
fn comm_error(op: &'static str) -> impl FnOnce(tandem_comm::CommSource) -> OptimError {
    move |source| OptimError::Collective { op, source }
}

impl ZeroRedundancyOptimizer {
    /// Wraps the optimizer `make` builds over this rank's shard of `params` (the model's
    /// parameters in `named_parameters()` order, identical on every rank). `make` is kept: a
    /// [`repartition`](ZeroRedundancyOptimizer::repartition) builds the new shard's optimizer
    /// with it.
    pub fn new(
        params: Vec<Var>,
        comm: Arc<dyn Collectives>,
        make: impl Fn(Vec<Var>) -> Result<ShardOptimizer, OptimError> + Send + Sync + 'static,
    ) -> Result<Self, OptimError> {
        if let Some(i) = params.iter().position(|p| p.dtype() != candle_core::DType::F32) {
            return Err(OptimError::InvalidParam {
                index: i,
                why: format!(
                    "ZeroRedundancyOptimizer shards f32 parameters; this one is {:?}",
                    params[i].dtype()
                ),
            });
        }
        let numels: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
        let partition = Partition::new(&numels, comm.size());
        let owned: Vec<Vec<usize>> = (0..comm.size()).map(|r| partition.of(r)).collect();
        let rank = comm.rank();
        let mine = &owned[rank];
        let local = if mine.is_empty() {
            None
        } else {
            Some(make(mine.iter().map(|&i| params[i].clone()).collect())?)
        };
        Ok(ZeroRedundancyOptimizer {
            comm,
            params,
            partition,
            owned,
            local,
            consolidated: None,
            rank,
            make: Arc::new(make),
        })
    }

    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    /// The partition of these parameters over a world of `world` ranks (what
    /// [`ZeroRedundancyOptimizer::repartition`] takes on).
    pub fn partition_for(&self, world: usize) -> Partition {
        let numels: Vec<usize> = self.params.iter().map(|p| p.elem_count()).collect();
        Partition::new(&numels, world)
    }

    /// After the collectives re-formed over another world (a live regroup): takes this rank's
    /// share of the new partition, builds its optimizer as [`ZeroRedundancyOptimizer::new`]'s
    /// `make` does and loads `state` (a state dict over all parameters; entries of other
    /// ranks' parameters may be absent, and a parameter without an entry starts with fresh
    /// state). Nothing is sent.
    pub fn repartition(&mut self, state: &Value) -> Result<(), OptimError> {
        let world = self.comm.size();
        self.partition = self.partition_for(world);
        self.owned = (0..world).map(|r| self.partition.of(r)).collect();
        self.rank = self.comm.rank();
        let mine = self.owned[self.rank].clone();
        self.local = if mine.is_empty() {
            None
        } else {
            Some((self.make)(mine.iter().map(|&i| self.params[i].clone()).collect())?)
        };
        self.consolidated = None;
        self.load_full(state)
    }

    /// Global indices of this rank's parameters (the local optimizer's order).
    fn mine(&self) -> &[usize] {
        &self.owned[self.rank]
    }

    /// Bytes of optimizer state tensors this rank holds (momentum buffers, Adam moments, ...).
    pub fn local_state_bytes(&self) -> Result<usize, OptimError> {
        match &self.local {
            Some(l) => Ok(state_bytes(&l.state_dict()?)),
            None => Ok(0),
        }
    }

    /// Every rank's updated shard to every rank: one broadcast per rank of its parameters,
    /// flattened.
    fn sync_params(&self) -> Result<(), OptimError> {
        for (r, owned) in self.owned.iter().enumerate() {
            let len: usize = owned.iter().map(|&i| self.params[i].elem_count()).sum();
            let mut flat = Vec::with_capacity(len);
            if r == self.comm.rank() {
                for &i in owned {
                    flat.extend(self.params[i].flatten_all()?.to_vec1::<f32>()?);
                }
            } else {
                flat.resize(len, 0.0);
            }
            self.comm.broadcast(&mut flat, r).map_err(comm_error("parameter broadcast"))?;
            if r != self.comm.rank() {
                let mut at = 0;
                for &i in owned {
                    let p = &self.params[i];
                    let n = p.elem_count();
                    let t =
                        candle_core::Tensor::from_slice(&flat[at..at + n], p.shape(), p.device())?;
                    p.set(&t)?;
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// This rank's state in torch's layout with global parameter indices (its group's `params`
    /// lists its own parameters only).
    pub fn shard_state_dict(&self) -> Result<Value, OptimError> {
        let Some(local) = &self.local else {
            return Ok(Value::dict_from([
                ("state", Value::Dict(vec![])),
                ("param_groups", Value::List(vec![])),
            ]));
        };
        relabel(&local.state_dict()?, self.mine())
    }

    /// Gathers every rank's shard on rank `to`, whose [`TorchOptimizer::state_dict`] then
    /// returns the whole state (torch's `consolidate_state_dict`). Every rank must call it.
    pub fn consolidate_state_dict(&mut self, to: usize) -> Result<(), OptimError> {
        let mine = tandem_ckpt::to_pt_bytes(&self.shard_state_dict()?)
            .map_err(|e| OptimError::state("(shard)", e.to_string()))?;
        let all =
            self.comm.all_gather_bytes(&mine).map_err(comm_error("consolidate_state_dict"))?;
        if self.comm.rank() != to {
            self.consolidated = None;
            return Ok(());
        }
        let mut shards = Vec::with_capacity(all.len());
        for (r, bytes) in all.into_iter().enumerate() {
            let v = tandem_ckpt::pt::load_from_bytes(&format!("rank {r}'s shard"), bytes, false)
                .map_err(|e| OptimError::state(format!("(rank {r})"), e.to_string()))?;
            shards.push(v);
        }
        self.consolidated = Some(merge_shards(&shards, self.params.len())?);
        Ok(())
    }

    /// The hyperparameters in torch's layout over every parameter, with an empty `state`
    /// (this rank's groups; a rank that owns no parameter has none).
    pub fn hyperparameters(&self) -> Result<Value, OptimError> {
        let shard = self.shard_state_dict()?;
        let n = self.params.len() as i64;
        let mut groups = shard
            .get("param_groups")
            .and_then(Value::as_list)
            .map_or_else(Vec::new, <[Value]>::to_vec);
        for g in &mut groups {
            g.insert("params", Value::List((0..n).map(Value::Int).collect()));
        }
        Ok(Value::dict_from([
            ("state", Value::Dict(vec![])),
            ("param_groups", Value::List(groups)),
        ]))
    }

    /// Loads a checkpoint of the earlier ZeRO-only format (`tandem-zero1`) written by any
    /// world size: this rank reads the files that hold its parameters. Shapes must match.
    pub fn load_sharded(&mut self, dir: &Path) -> Result<(), OptimError> {
        let manifest = read_manifest(dir)?;
        check_shapes(&manifest, &self.params)?;
        let needed: std::collections::BTreeSet<usize> =
            self.mine().iter().map(|&i| manifest.partition.owner[i]).collect();
        let mut shards = Vec::new();
        for r in needed {
            shards.push(read_shard(dir, &manifest, r)?);
        }
        // Rank 0's file carries the hyperparameters even where it holds none of ours.
        if shards.is_empty() || !self.mine().iter().any(|&i| manifest.partition.owner[i] == 0) {
            shards.push(read_shard(dir, &manifest, 0)?);
        }
        let full = merge_shards(&shards, self.params.len())?;
        self.load_full(&full)
    }

    /// Loads this rank's part of a state dict over all parameters (entries of other ranks'
    /// parameters may be absent).
    fn load_full(&mut self, full: &Value) -> Result<(), OptimError> {
        if self.local.is_none() {
            return Ok(());
        }
        let groups = full
            .get("param_groups")
            .and_then(Value::as_list)
            .ok_or_else(|| OptimError::state("param_groups", "missing or not a list"))?;
        if groups.len() != 1 {
            return Err(OptimError::state(
                "param_groups",
                format!("has {} groups; ZeroRedundancyOptimizer keeps one", groups.len()),
            ));
        }
        let n = self.params.len();
        let listed = groups[0].get("params").and_then(Value::as_list).map_or(0, <[Value]>::len);
        if listed != n {
            return Err(OptimError::state(
                "param_groups.0.params",
                format!("lists {listed} parameters, the model has {n}"),
            ));
        }
        let state = full
            .get("state")
            .and_then(Value::as_dict)
            .ok_or_else(|| OptimError::state("state", "missing or not a dict"))?;
        let mut local_state = Vec::new();
        for (j, &g) in self.mine().iter().enumerate() {
            if let Some((_, v)) = state.iter().find(|(k, _)| k.as_int() == Some(g as i64)) {
                local_state.push((Value::Int(j as i64), v.clone()));
            }
        }
        let mut group = groups[0].clone();
        group
            .insert("params", Value::List((0..self.mine().len() as i64).map(Value::Int).collect()));
        let sd = Value::dict_from([
            ("state", Value::Dict(local_state)),
            ("param_groups", Value::List(vec![group])),
        ]);
        match &mut self.local {
            Some(local) => local.load_state_dict(&sd),
            None => Ok(()),
        }
    }
}

impl TorchOptimizer for ZeroRedundancyOptimizer {
    /// The shard's update, then every rank's shard to every rank.
    fn step(&mut self, grads: &GradStore) -> Result<(), OptimError> {
        if let Some(l) = &mut self.local {
            l.step(grads)?;
        }
        self.consolidated = None;
        self.sync_params()
    }
    fn lr(&self) -> f64 {
        self.local.as_ref().map_or(0.0, |l| l.lr())
    }
    fn set_lr(&mut self, lr: f64) {
        if let Some(l) = &mut self.local {
            l.set_lr(lr);
        }
    }
    fn group_lrs(&self) -> Vec<f64> {
        self.local.as_ref().map_or(vec![], |l| l.group_lrs())
    }
    fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<(), OptimError> {
        match &mut self.local {
            Some(l) => l.set_group_lrs(lrs),
            None => Ok(()),
        }
    }
    fn params(&self) -> Vec<Var> {
        self.params.clone()
    }
    /// The whole state after [`ZeroRedundancyOptimizer::consolidate_state_dict`] on this rank;
    /// an error otherwise (as torch raises).
    fn state_dict(&self) -> Result<Value, OptimError> {
        self.consolidated.clone().ok_or_else(|| {
            OptimError::state(
                "(ZeroRedundancyOptimizer)",
                "call consolidate_state_dict(to) on every rank first; then this rank's \
                 state_dict is the whole state if it is `to`",
            )
        })
    }
    /// A whole-model state dict (consolidated, or a plain optimizer's over the same
    /// parameters), on every rank; each keeps its shard.
    fn load_state_dict(&mut self, state_dict: &Value) -> Result<(), OptimError> {
        self.load_full(state_dict)
    }
    fn owned_params(&self) -> Option<Vec<usize>> {
        Some(self.mine().to_vec())
    }
    fn owners_for(&self, world: usize) -> Option<Vec<usize>> {
        Some(self.partition_for(world).owner)
    }
    fn repartition(&mut self, state: &Value) -> Result<(), OptimError> {
        ZeroRedundancyOptimizer::repartition(self, state)
    }
    fn shard(&self) -> Result<Option<crate::OptimizerShard>, OptimError> {
        let entries = self.shard_state_dict()?.get("state").cloned().unwrap_or(Value::new_dict());
        Ok(Some(crate::OptimizerShard {
            groups: self.hyperparameters()?,
            indices: self.mine().to_vec(),
            entries,
        }))
    }
}

/// Bytes of the tensors under `state` of an optimizer state dict.
pub fn state_bytes(sd: &Value) -> usize {
    fn walk(v: &Value) -> usize {
        match v {
            Value::Tensor(t) => t.nbytes(),
            Value::Dict(items) => items.iter().map(|(_, v)| walk(v)).sum(),
            Value::List(items) => items.iter().map(walk).sum(),
            _ => 0,
        }
    }
    sd.get("state").map_or(0, walk)
}

/// `sd` (local indices 0..) with every index replaced by `global[index]`.
fn relabel(sd: &Value, global: &[usize]) -> Result<Value, OptimError> {
    let map = |v: &Value, key: &str| -> Result<Value, OptimError> {
        let i = v.as_int().ok_or_else(|| OptimError::state(key, "non-integer index"))? as usize;
        let g = global
            .get(i)
            .ok_or_else(|| OptimError::state(key, format!("index {i} out of range")))?;
        Ok(Value::Int(*g as i64))
    };
    let state = sd.get("state").and_then(Value::as_dict).unwrap_or(&[]);
    let state = state
        .iter()
        .map(|(k, v)| Ok((map(k, "state")?, v.clone())))
        .collect::<Result<Vec<_>, OptimError>>()?;
    let mut groups = Vec::new();
    for g in sd.get("param_groups").and_then(Value::as_list).unwrap_or(&[]) {
        let ids = g.get("params").and_then(Value::as_list).unwrap_or(&[]);
        let ids = ids.iter().map(|v| map(v, "params")).collect::<Result<Vec<_>, _>>()?;
        let mut g = g.clone();
        g.insert("params", Value::List(ids));
        groups.push(g);
    }
    Ok(Value::dict_from([("state", Value::Dict(state)), ("param_groups", Value::List(groups))]))
}

/// One state dict over all `n` parameters from rank shards (global indices): every shard's
/// state entries, ordered by index, and the first non-empty shard's hyperparameters with
/// `params` = 0..n.
pub fn merge_shards(shards: &[Value], n: usize) -> Result<Value, OptimError> {
    let mut state: Vec<(i64, Value)> = Vec::new();
    let mut group: Option<Value> = None;
    for (r, s) in shards.iter().enumerate() {
        for (k, v) in s.get("state").and_then(Value::as_dict).unwrap_or(&[]) {
            let i = k
                .as_int()
                .ok_or_else(|| OptimError::state(format!("shard {r}: state"), "non-integer key"))?;
            if state.iter().any(|(j, _)| *j == i) {
                return Err(OptimError::state(
                    format!("shard {r}: state.{i}"),
                    "held by two shards",
                ));
            }
            state.push((i, v.clone()));
        }
        if group.is_none() {
            group = s.get("param_groups").and_then(Value::as_list).and_then(|g| g.first()).cloned();
        }
    }
    state.sort_by_key(|(i, _)| *i);
    let mut group = group.ok_or_else(|| OptimError::state("param_groups", "no shard has one"))?;
    group.insert("params", Value::List((0..n as i64).map(Value::Int).collect()));
    Ok(Value::dict_from([
        ("state", Value::Dict(state.into_iter().map(|(i, v)| (Value::Int(i), v)).collect())),
        ("param_groups", Value::List(vec![group])),
    ]))
}

/// Whether `dir/manifest.json` says it is this format's (however the rest of it reads: a
/// reader then names what is wrong with it).
pub fn is_zero1_checkpoint(dir: &Path) -> bool {
    #[derive(Deserialize)]
    struct Format {
        format: String,
    }
    std::fs::read(dir.join(MANIFEST))
        .is_ok_and(|b| serde_json::from_slice::<Format>(&b).is_ok_and(|f| f.format == FORMAT))
}

/// Reads `dir/manifest.json`, naming the file at fault.
pub fn read_manifest(dir: &Path) -> Result<ShardManifest, OptimError> {
    let path = dir.join(MANIFEST);
    let key = path.display().to_string();
    let bytes = std::fs::read(&path).map_err(|e| {
        OptimError::state(&key, format!("{e} (an incomplete save has rank files but no manifest)"))
    })?;
    let m: ShardManifest =
        serde_json::from_slice(&bytes).map_err(|e| OptimError::state(&key, e.to_string()))?;
    if m.format != FORMAT
        || m.files.len() != m.world_size
        || m.partition.owner.len() != m.shapes.len()
    {
        return Err(OptimError::state(
            &key,
            "not a tandem-zero1 manifest (format, files or partition)",
        ));
    }
    Ok(m)
}

fn read_shard(dir: &Path, m: &ShardManifest, r: usize) -> Result<Value, OptimError> {
    let path: PathBuf = dir.join(&m.files[r]);
    tandem_ckpt::load(&path)
        .map_err(|e| OptimError::state(path.display().to_string(), e.to_string()))
}

fn check_shapes(m: &ShardManifest, params: &[Var]) -> Result<(), OptimError> {
    if m.shapes.len() != params.len() {
        return Err(OptimError::state(
            MANIFEST,
            format!("the checkpoint has {} parameters, the model {}", m.shapes.len(), params.len()),
        ));
    }
    for (i, (s, p)) in m.shapes.iter().zip(params).enumerate() {
        if s.as_slice() != p.dims() {
            return Err(OptimError::state(
                format!("{MANIFEST}: parameter {i}"),
                format!("shape {s:?} in the checkpoint, {:?} in the model", p.dims()),
            ));
        }
    }
    Ok(())
}

/// A sharded checkpoint of this format, inspected ([`inspect_sharded`]): what `tandem ckpt
/// inspect DIR` shows (and as JSON).
#[derive(Clone, Debug, Serialize)]
pub struct ZeroInspection {
    pub dir: String,
    pub format: String,
    pub world_size: usize,
    pub parameters: usize,
    pub ranks: Vec<ShardFile>,
    pub total_state_bytes: usize,
}

/// A rank's file, the parameters whose state it holds, and its bytes of state.
#[derive(Clone, Debug, Serialize)]
pub struct ShardFile {
    pub rank: usize,
    pub file: String,
    pub params: Vec<usize>,
    pub state_bytes: usize,
}

/// Reads every rank file of the sharded checkpoint in `dir` and says what each holds.
pub fn inspect_sharded(dir: &Path) -> Result<ZeroInspection, OptimError> {
    let m = read_manifest(dir)?;
    let mut ranks = Vec::new();
    for (r, f) in m.files.iter().enumerate() {
        let state_bytes = state_bytes(&read_shard(dir, &m, r)?);
        ranks.push(ShardFile { rank: r, file: f.clone(), params: m.partition.of(r), state_bytes });
    }
    Ok(ZeroInspection {
        dir: dir.display().to_string(),
        parameters: m.shapes.len(),
        total_state_bytes: ranks.iter().map(|r| r.state_bytes).sum(),
        format: m.format,
        world_size: m.world_size,
        ranks,
    })
}

impl std::fmt::Display for ZeroInspection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: sharded optimizer state ({}), {} ranks, {} parameters, {} bytes of state",
            self.dir, self.format, self.world_size, self.parameters, self.total_state_bytes
        )?;
        for r in &self.ranks {
            let (rank, file, params, bytes) = (r.rank, &r.file, &r.params, r.state_bytes);
            writeln!(f, "  rank {rank}: {file}  parameters {params:?}  {bytes} bytes")?;
        }
        Ok(())
    }
}

/// The whole optimizer state dict of a sharded checkpoint (every rank file read), as
/// `consolidate_state_dict` gives it: what `tandem ckpt convert DIR out.pt` writes.
pub fn consolidate_sharded(dir: &Path) -> Result<Value, OptimError> {
    let m = read_manifest(dir)?;
    let shards =
        (0..m.world_size).map(|r| read_shard(dir, &m, r)).collect::<Result<Vec<_>, _>>()?;
    merge_shards(&shards, m.shapes.len())
}
