//! arcface_torch's per-rank checkpoint layout, both ways (`tandem ckpt convert`):
//! `checkpoint_gpu_{rank}.pt` = `{epoch, global_step, state_dict_backbone,
//! state_dict_softmax_fc: {weight}, state_optimizer, state_lr_scheduler}` per rank, with the
//! whole backbone and its optimizer state in every file.
//!
//! The optimizer state is torch's over two groups, `backbone.parameters()` then the head's
//! weight. arcface_torch's group 0 lists every backbone parameter, the frozen
//! `features.weight` included (it has no state); tandem's leaves the frozen one out, so the
//! indices are renumbered on the way. `epoch` there is the next epoch to run: arcface_torch
//! resumes at epoch boundaries only, so a checkpoint from the middle of an epoch is refused.
use std::path::{Path, PathBuf};

use tandem_ckpt::Value;
use tandem_models::IResNet;
use tandem_nn::is_buffer;
use tandem_train::checkpoint::{self, Saved, ShardDict};
use tandem_train::state::{put_entry, take_entry};
use tandem_train::{bail, Context, Result, TrainError};

use crate::face::{overlay, BUFFERS_SHARD, HEAD_SHARD};

pub fn file_name(rank: usize) -> String {
    format!("checkpoint_gpu_{rank}.pt")
}

/// Whether `dir` holds arcface_torch's per-rank checkpoints.
pub fn is_arcface_dir(dir: &Path) -> bool {
    dir.join(file_name(0)).is_file()
}

/// Whether `dir` is a tandem face checkpoint (a sharded checkpoint with a `head` row shard).
pub fn is_face_dir(dir: &Path) -> bool {
    dir.is_dir() && Saved::open(dir).is_ok_and(|s| s.rows_total(HEAD_SHARD).is_some())
}

/// The torch parameter names of a backbone state dict in torch's order (its keys without
/// the buffers), and where tandem's parameter list (no frozen ones) sits in it.
fn torch_params(backbone: &Value) -> Result<(Vec<String>, Vec<usize>)> {
    let Value::Dict(items) = backbone else { bail!("the backbone is not a state dict") };
    let names: Vec<String> = items
        .iter()
        .filter_map(|(k, _)| k.as_str().map(str::to_string))
        .filter(|k| !is_buffer(k))
        .collect();
    let ours =
        (0..names.len()).filter(|&i| !IResNet::FROZEN.contains(&names[i].as_str())).collect();
    Ok((names, ours))
}

/// Renumbers an optimizer state dict's parameter indices with `map` (old index -> new).
fn renumber(opt: &Value, map: &dyn Fn(i64) -> Option<i64>, what: &str) -> Result<Value> {
    let mut out = opt.clone();
    if let Some(Value::Dict(items)) = out.get_mut("state") {
        for (k, _) in items.iter_mut() {
            let i = k.as_int().with_context(|| format!("{what}: a state key is not an index"))?;
            *k = Value::Int(map(i).with_context(|| {
                format!("{what}: state of parameter {i}, which has no counterpart")
            })?);
        }
    }
    if let Some(Value::List(groups)) = out.get_mut("param_groups") {
        for g in groups.iter_mut() {
            if let Some(Value::List(ids)) = g.get_mut("params") {
                let old = std::mem::take(ids);
                for id in old {
                    let i = id
                        .as_int()
                        .with_context(|| format!("{what}: a group lists a non-index"))?;
                    if let Some(j) = map(i) {
                        ids.push(Value::Int(j));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The parameter indices of a two-group torch optimizer state: group 0's and group 1's.
fn group_params(opt: &Value, what: &str) -> Result<(Vec<i64>, Vec<i64>)> {
    let groups = opt
        .get("param_groups")
        .and_then(Value::as_list)
        .with_context(|| format!("{what}: no param_groups"))?;
    let ids = |g: &Value| -> Vec<i64> {
        g.get("params")
            .and_then(Value::as_list)
            .map_or(Vec::new(), |l| l.iter().filter_map(Value::as_int).collect())
    };
    match groups {
        [a, b] => Ok((ids(a), ids(b))),
        _ => bail!("{what}: {} parameter groups, the recipe has 2 (backbone, head)", groups.len()),
    }
}

/// Writes `checkpoint_gpu_{rank}.pt` for every rank of tandem face checkpoint `dir` (and
/// `model.pt`, rank 0's backbone, as arcface_torch's output holds) into `out`.
pub fn to_arcface(dir: &Path, out: &Path) -> Result<Vec<PathBuf>> {
    let saved = Saved::open(dir)?;
    let rep_path = dir.join(checkpoint::REPLICATED);
    // A sharded backbone's (`--fsdp`) rows and optimizer entries, stacked whole.
    let rep = match tandem_train::fsdp_consolidated(&saved)? {
        Some(whole) => whole,
        None => saved.replicated()?,
    };
    let get = |k: &str| rep.get(k).with_context(|| format!("{}: no `{k}`", rep_path.display()));
    if let Some(s) = rep.get("sampler").filter(|s| !matches!(s, Value::None)) {
        let consumed = s.get("consumed").and_then(Value::as_int).unwrap_or(0);
        if consumed > 0 {
            let (step, epoch) = (saved.global_step(), saved.epoch());
            return Err(TrainError::Field {
                path: rep_path,
                field: "sampler",
                problem: format!(
                    "step {step} is in the middle of epoch {epoch} (arcface_torch resumes at \
                     epoch boundaries only); convert a checkpoint written at an epoch's end"
                ),
            });
        }
    }
    // (Checkpoints of earlier builds name the backbone `backbone`.)
    let backbone = match rep.get("model") {
        Some(model) => model,
        None => get("backbone")?,
    };
    let (names, ours) = torch_params(backbone)?;
    let head_torch = names.len() as i64;
    let head_ours = ours.len() as i64;
    let map = |i: i64| -> Option<i64> {
        if i == head_ours {
            Some(head_torch)
        } else {
            ours.get(usize::try_from(i).ok()?).map(|&t| t as i64)
        }
    };
    let rest = renumber(get("optimizer")?, &map, &rep_path.display().to_string())?;
    // Group 0 lists every backbone parameter in arcface_torch, the frozen ones included.
    let mut rest = rest;
    if let Some(Value::List(groups)) = rest.get_mut("param_groups") {
        if let Some(Value::List(ids)) = groups.get_mut(0).and_then(|g| g.get_mut("params")) {
            *ids = (0..head_torch).map(Value::Int).collect();
        }
    }
    let scheduler = match get("scheduler")? {
        Value::None => Value::new_dict(),
        s => s.clone(),
    };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    let slices = saved.slices(HEAD_SHARD).context("no head shard")?;
    for (r, slice) in slices.into_iter().enumerate() {
        let checkpoint::ShardSlice::Rows { start, len, .. } = *slice else {
            let why = format!("the `{HEAD_SHARD}` shard is not a row shard");
            return Err(checkpoint::CheckpointError::Corrupt { path: dir.into(), why }.into());
        };
        let head = saved.read_rows(HEAD_SHARD, start..start + len)?;
        let what = format!("{} rank {r}", dir.display());
        let hget = |k: &str| head.get(k).with_context(|| format!("{what}: no `{k}`"));
        let mut backbone = backbone.clone();
        overlay(&mut backbone, &saved.read_rank(BUFFERS_SHARD, r)?.unwrap_or(Value::None));
        let mut optimizer = rest.clone();
        put_entry(&mut optimizer, head_torch as usize, hget("state")?.clone());
        let ck = Value::dict_from([
            ("epoch", Value::Int(saved.epoch() as i64)),
            ("global_step", Value::Int(saved.global_step() as i64)),
            ("state_dict_backbone", backbone.clone()),
            ("state_dict_softmax_fc", Value::dict_from([("weight", hget("weight")?.clone())])),
            ("state_optimizer", optimizer),
            ("state_lr_scheduler", scheduler.clone()),
        ]);
        let target = out.join(file_name(r));
        tandem_ckpt::save(&target, &ck).with_context(|| format!("writing {}", target.display()))?;
        written.push(target);
        if r == 0 {
            let model = out.join("model.pt");
            tandem_ckpt::save(&model, &backbone)
                .with_context(|| format!("writing {}", model.display()))?;
            written.push(model);
        }
    }
    Ok(written)
}

/// Reads arcface_torch's `checkpoint_gpu_{0..W-1}.pt` from `dir` and writes them as a tandem
/// face checkpoint in `run_dir/checkpoints/step-NNNNNNNN/`, which `tandem train --out RUN_DIR
/// --resume` continues, on any world size. Returns that directory.
pub fn from_arcface(dir: &Path, run_dir: &Path) -> Result<PathBuf> {
    let mut files = Vec::new();
    while dir.join(file_name(files.len())).is_file() {
        let path = dir.join(file_name(files.len()));
        let v = tandem_ckpt::load(&path).with_context(|| format!("reading {}", path.display()))?;
        files.push((path, v));
    }
    let world = files.len();
    let (path0, first) =
        files.first().with_context(|| format!("{}: no {}", dir.display(), file_name(0)))?;
    let get = |v: &'_ Value, p: &Path, k: &str| -> Result<Value> {
        v.get(k).cloned().with_context(|| {
            format!("{}: no `{k}` (not an arcface_torch checkpoint_gpu file)", p.display())
        })
    };
    let int = |v: &Value, p: &Path, k: &str| -> Result<i64> {
        get(v, p, k)?.as_int().with_context(|| format!("{}: `{k}` is not an integer", p.display()))
    };
    let (epoch, step) = (int(first, path0, "epoch")?, int(first, path0, "global_step")?);
    let backbone0 = get(first, path0, "state_dict_backbone")?;
    let (names, ours) = torch_params(&backbone0)?;
    let head_torch = names.len() as i64;
    let head_ours = ours.len() as i64;
    let inverse = |i: i64| -> Option<i64> {
        if i == head_torch {
            return Some(head_ours);
        }
        ours.iter().position(|&t| t as i64 == i).map(|p| p as i64)
    };
    let target = run_dir.join("checkpoints").join(format!("step-{step:08}"));
    if target.exists() {
        bail!("{} exists already; convert into another run directory", target.display());
    }
    let mut heads = Vec::new();
    let mut start = 0usize;
    let mut rest0 = Value::None;
    for (r, (path, v)) in files.iter().enumerate() {
        let what = path.display().to_string();
        if int(v, path, "epoch")? != epoch || int(v, path, "global_step")? != step {
            let problem = format!("epoch/global_step differ from {}'s", path0.display());
            return Err(TrainError::Field { path: path.clone(), field: "global_step", problem });
        }
        let opt = get(v, path, "state_optimizer")?;
        let (g0, g1) = group_params(&opt, &what)?;
        if g0.len() as i64 != head_torch || g1 != [head_torch] {
            let problem = format!(
                "parameter groups of {} and {g1:?} parameters; the backbone has {head_torch}, \
                 then the head",
                g0.len()
            );
            return Err(TrainError::Field {
                path: path.clone(),
                field: "state_optimizer",
                problem,
            });
        }
        let mut rest = opt;
        let head_state = take_entry(&mut rest, head_torch as usize);
        let rest = renumber(&rest, &inverse, &what)?;
        if r == 0 {
            rest0 = rest;
        }
        let weight = get(v, path, "state_dict_softmax_fc")?
            .get("weight")
            .and_then(Value::as_tensor)
            .cloned()
            .with_context(|| format!("{what}: `state_dict_softmax_fc` has no `weight` tensor"))?;
        let [rows, _] = weight.shape[..] else {
            let problem = format!("the head's weight has shape {:?}", weight.shape);
            return Err(TrainError::Field {
                path: path.clone(),
                field: "state_dict_softmax_fc",
                problem,
            });
        };
        let buffers = buffers_of(&get(v, path, "state_dict_backbone")?);
        let head = Value::dict_from([("weight", Value::Tensor(weight)), ("state", head_state)]);
        heads.push((start, rows, head, buffers));
        start += rows;
    }
    let ranks = heads
        .into_iter()
        .map(|(first, rows, head, buffers)| {
            vec![
                ShardDict::rows(HEAD_SHARD, first, rows, start, head),
                ShardDict::rank(BUFFERS_SHARD, buffers),
            ]
        })
        .collect();
    let scheduler = match get(first, path0, "state_lr_scheduler")? {
        Value::Dict(d) if d.is_empty() => Value::None,
        s => s,
    };
    let replicated = Value::dict_from([
        ("epoch", Value::Int(epoch)),
        ("global_step", Value::Int(step)),
        ("world_size", Value::Int(world as i64)),
        ("model", backbone0),
        ("optimizer", rest0),
        ("scheduler", scheduler),
        ("scaler", Value::None),
        // arcface_torch resumes at the start of `epoch`, in this run's sampler order.
        ("sampler", Value::None),
        ("rng", Value::None),
        ("config", Value::None),
    ]);
    std::fs::create_dir_all(&target).with_context(|| format!("creating {}", target.display()))?;
    checkpoint::write_sharded(&target, step as u64, epoch as u64, replicated, ranks)?;
    Ok(target)
}

/// A rank's BatchNorm statistics (and frozen parameters) from its backbone state dict.
fn buffers_of(backbone: &Value) -> Value {
    let Value::Dict(items) = backbone else { return Value::new_dict() };
    Value::Dict(
        items
            .iter()
            .filter(|(k, _)| {
                k.as_str().is_some_and(|k| is_buffer(k) || IResNet::FROZEN.contains(&k))
            })
            .cloned()
            .collect(),
    )
}
