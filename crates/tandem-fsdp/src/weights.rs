//! Trained weights into a sharded model, each rank reading only its rows of each tensor from
//! safetensors files (tandem-ckpt's `RowReader`: positioned reads, no file mapped or read
//! whole): FSDP2's `set_model_state_dict` with a full state dict, without any rank holding the
//! whole model (PyTorch's answer, `broadcast_from_rank0`, has rank 0 read it all).
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use tandem_ckpt::keys::strip_wrappers;
use tandem_ckpt::safetensors::{save_streaming, RowReader, TensorSpec};
use tandem_ckpt::{ElemType, TensorData, Value};
use tandem_nn::is_buffer;
use tandem_nn::kernels::with_f32_slice;

use crate::engine::{Engine, Param};
use crate::error::{comm, tensor, FsdpError, Result};
use crate::fsdp::Fsdp;

/// The most bytes of rank 0's error the others receive after a save.
const STATUS_MAX: usize = 4096;

fn bad(file: &Path, why: impl Into<String>) -> FsdpError {
    FsdpError::Weights { file: file.to_path_buf(), why: why.into() }
}

fn read(e: tandem_ckpt::CkptError) -> FsdpError {
    FsdpError::Read(Box::new(e))
}

/// Names, a few of them.
fn some(names: &[String]) -> String {
    let shown: Vec<String> = names.iter().take(4).map(|n| format!("`{n}`")).collect();
    let more = names.len().saturating_sub(shown.len());
    let more = if more > 0 { format!(" and {more} more") } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// Where a load's rows come from: safetensors files read by position, or a state dict in
/// memory.
trait RowSource {
    /// Every key with the file it is in, sorted by key.
    fn keys(&self) -> Vec<(String, &Path)>;
    fn shape(&self, key: &str) -> Option<Vec<usize>>;
    /// Rows `rows` of `key`, a contiguous tensor of its stored dtype.
    fn read_rows(&self, key: &str, rows: Range<usize>) -> Result<TensorData>;
}

impl RowSource for RowReader {
    fn keys(&self) -> Vec<(String, &Path)> {
        RowReader::keys(self)
    }
    fn shape(&self, key: &str) -> Option<Vec<usize>> {
        RowReader::shape(self, key)
    }
    fn read_rows(&self, key: &str, rows: Range<usize>) -> Result<TensorData> {
        RowReader::read_rows(self, key, rows).map_err(read)
    }
}

/// A state dict's tensors by key (sorted), read from `path`.
struct DictRows<'a> {
    path: &'a Path,
    tensors: Vec<(String, &'a TensorData)>,
}

impl DictRows<'_> {
    fn find(&self, key: &str) -> Option<&TensorData> {
        let at = self.tensors.binary_search_by(|(k, _)| k.as_str().cmp(key)).ok()?;
        Some(self.tensors[at].1)
    }
}

impl RowSource for DictRows<'_> {
    fn keys(&self) -> Vec<(String, &Path)> {
        self.tensors.iter().map(|(k, _)| (k.clone(), self.path)).collect()
    }
    fn shape(&self, key: &str) -> Option<Vec<usize>> {
        self.find(key).map(|t| t.shape.clone())
    }
    fn read_rows(&self, key: &str, rows: Range<usize>) -> Result<TensorData> {
        let t = self.find(key).ok_or_else(|| bad(self.path, format!("no tensor `{key}`")))?;
        let total = t.shape.first().copied().unwrap_or(1);
        t.rows(rows.clone())
            .ok_or_else(|| bad(self.path, format!("`{key}` has {total} rows, not {rows:?}")))
    }
}

impl Fsdp {
    /// Loads trained weights into the shards, each rank reading only its rows of each tensor
    /// from `files` (a model saved whole as safetensors, in one file or several): FSDP2's
    /// `set_model_state_dict` with a full state dict, for a model built with
    /// [`Fsdp::from_meta`] too large for one rank. Keys may carry DDP's `module.` or
    /// `torch.compile`'s `_orig_mod.` (tandem-ckpt's `strip_wrappers`). Strict, as PyTorch's
    /// default: a parameter the files lack, a tensor of another shape, a key that is neither a
    /// parameter nor a buffer, or two keys for one name is an error naming them, and then no
    /// shard has changed. Not between a forward and its backward. Returns the buffers the files
    /// hold (BatchNorm's statistics: FSDP keeps none, they are the caller's), whole, in their
    /// stored dtype. Not a collective: every rank reads the files itself.
    pub fn load_safetensors(&self, files: &[impl AsRef<Path>]) -> Result<Vec<(String, Tensor)>> {
        self.load_safetensors_with(files, &[])
    }

    /// [`Fsdp::load_safetensors`], and the model's tensors the caller keeps whole outside the
    /// sharded parameters (`whole`: frozen parameters, as IResNet's `features.weight`) read
    /// whole and returned with the buffers — each of them required, as a parameter is.
    pub fn load_safetensors_with(
        &self,
        files: &[impl AsRef<Path>],
        whole: &[&str],
    ) -> Result<Vec<(String, Tensor)>> {
        let paths: Vec<PathBuf> = files.iter().map(|f| f.as_ref().to_path_buf()).collect();
        let Some(first) = paths.first().map(PathBuf::as_path) else {
            let why = "no file given".to_string();
            return Err(FsdpError::InvalidOption { what: "load_safetensors", why });
        };
        self.engine().outside_step("load_safetensors")?;
        let weights = RowReader::open(&paths).map_err(read)?;
        self.load_rows_from(&weights, first, whole)
    }

    /// [`Fsdp::load_safetensors_with`] from a state dict already read — a `.pt` file, which
    /// `tandem_ckpt::load` maps rather than reads —, each rank copying only its rows of each
    /// tensor (a mapping's other pages are never touched); `path` names the file in errors.
    /// FSDP2's `set_model_state_dict` with a full state dict (`mmap=True`), the same rules: any
    /// wrapping of the keys, strict, nothing set on an error found before the copy.
    pub fn load_state_dict_rows(
        &self,
        path: &Path,
        state: &Value,
        whole: &[&str],
    ) -> Result<Vec<(String, Tensor)>> {
        self.engine().outside_step("load_state_dict_rows")?;
        let Some(entries) = state.as_dict() else {
            return Err(bad(path, "not a dict of tensors (a state dict)"));
        };
        let mut tensors = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            let key = k.as_str().map(str::to_string).unwrap_or_else(|| format!("{k:?}"));
            let Some(t) = v.as_tensor() else {
                return Err(bad(path, format!("`{key}` is not a tensor")));
            };
            tensors.push((key, t));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        self.load_rows_from(&DictRows { path, tensors }, path, whole)
    }

    /// The body of both loads: `source`'s keys matched to the parameters (wrappers stripped),
    /// checked, every shard's rows read, then set; the buffers and `whole` returned whole.
    fn load_rows_from(
        &self,
        weights: &dyn RowSource,
        first: &Path,
        whole: &[&str],
    ) -> Result<Vec<(String, Tensor)>> {
        let engine = self.engine();
        // Each stored key under the name it has without wrappers' prefixes.
        let mut stored: HashMap<String, (String, &Path)> = HashMap::new();
        for (key, file) in weights.keys() {
            let name = strip_wrappers(&key);
            if let Some((other, _)) = stored.get(&name) {
                return Err(bad(file, format!("`{other}` and `{key}` are both `{name}`")));
            }
            stored.insert(name, (key, file));
        }
        let mut keys = Vec::with_capacity(engine.params.len());
        let mut missing = Vec::new();
        for p in &engine.params {
            let Some((key, file)) = stored.remove(&p.name) else {
                missing.push(p.name.clone());
                continue;
            };
            let shape = weights.shape(&key).unwrap_or_default();
            if shape != p.layout.dims {
                let why = format!(
                    "`{key}` has shape {shape:?}; the model's `{}` is {:?}",
                    p.name, p.layout.dims
                );
                return Err(bad(file, why));
            }
            keys.push(key);
        }
        missing.extend(whole.iter().filter(|n| !stored.contains_key(**n)).map(|n| n.to_string()));
        if !missing.is_empty() {
            let why = format!("no tensor for the parameter(s) {} in these files", some(&missing));
            return Err(bad(first, why));
        }
        // What is left: the buffers and what the caller keeps whole, or keys of nothing in
        // the model.
        let (buffers, mut unknown): (Vec<_>, Vec<_>) = stored
            .into_iter()
            .partition(|(name, _)| is_buffer(name) || whole.contains(&name.as_str()));
        if !unknown.is_empty() {
            unknown.sort();
            let unknown: Vec<String> = unknown.into_iter().map(|(_, (key, _))| key).collect();
            let why = format!("{} in no parameter or buffer of the model", some(&unknown));
            return Err(bad(first, why));
        }
        // Every shard read before any is set: a failed read leaves the model as it was.
        let mut rows = Vec::with_capacity(engine.params.len());
        for (p, key) in engine.params.iter().zip(&keys) {
            let values = weights.read_rows(key, p.layout.my_rows())?.to_f32_vec();
            let t = Tensor::from_vec(values, p.layout.shard_dims(), &Device::Cpu)
                .map_err(tensor(format!("the rows of `{key}`")))?;
            rows.push(t);
        }
        for (p, t) in engine.params.iter().zip(rows) {
            p.shard.set(&t).map_err(tensor(format!("setting the shard of `{}`", p.name)))?;
        }
        let mut out = Vec::with_capacity(buffers.len());
        for (name, (key, _)) in buffers {
            let shape = weights.shape(&key).unwrap_or_default();
            let whole = weights.read_rows(&key, 0..shape.first().copied().unwrap_or(1));
            let whole = tandem_nn::convert::from_ckpt(&whole?, &Device::Cpu)
                .and_then(|t| Ok(t.reshape(shape)?))
                .map_err(|e| bad(first, format!("`{key}`: {e}")))?;
            out.push((name, whole));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Writes the model whole as one safetensors file (readable by candle, PyTorch's
    /// `safetensors.torch.load_file` and [`Fsdp::load_safetensors`] on any number of ranks),
    /// gathered one parameter at a time to rank 0, which writes it atomically: FSDP2's
    /// `get_model_state_dict(full_state_dict=True, cpu_offload=True)` and `save_file`, without
    /// a rank ever holding the whole model (PyTorch's gathers it all on rank 0). `buffers` (the
    /// caller's whole tensors, BatchNorm's statistics) are written from rank 0's values. Every
    /// rank returns the same result: an error naming the file when rank 0 could not write it. A
    /// collective on every rank.
    pub fn save_safetensors(
        &self,
        path: impl AsRef<Path>,
        buffers: &[(String, Tensor)],
    ) -> Result<()> {
        let path = path.as_ref();
        let e = self.engine();
        e.outside_step("save_safetensors")?;
        // The parameters in file order: all float32, so by name (safetensors' writer orders
        // by dtype, then name); every rank gathers them in this order.
        let mut order: Vec<usize> = (0..e.params.len()).collect();
        order.sort_by(|&a, &b| e.params[a].name.cmp(&e.params[b].name));
        let writes = e.group.rank() == 0 && self.is_first_replica();
        let mut gathered = 0;
        let mut status = Vec::new();
        if writes {
            let written = write_file(&e, path, buffers, &order, &mut gathered);
            if let Err(err) = written {
                status = err.to_string().into_bytes();
            }
        }
        // A rank that did not write, or a writer that stopped early, gathers the rest: the
        // collectives stay in step whatever rank 0's disk did.
        for &p in &order[gathered..] {
            gather_to_first(&e, &e.params[p])?;
        }
        // (An error's text, bounded.)
        status.truncate(STATUS_MAX);
        e.group.broadcast_bytes_at_most(&mut status, 0, STATUS_MAX).map_err(comm("broadcast"))?;
        if status.is_empty() {
            return Ok(());
        }
        let why = String::from_utf8_lossy(&status).into_owned();
        match writes {
            true => Err(bad(path, why)),
            false => Err(bad(path, format!("rank 0 could not write it: {why}"))),
        }
    }
}

impl Fsdp {
    /// The parameters whole, by name in the model's order, on rank 0 (the first row's under
    /// HSDP) and `None` on every other rank: FSDP2's `get_model_state_dict(full_state_dict=True,
    /// cpu_offload=True)`. Each parameter is gathered to rank 0 alone, one at a time, so the
    /// other ranks never hold more than their shards (where [`Fsdp::full_state_dict`] gathers
    /// the whole model on every rank). Float32 on the CPU: the master weights, whatever the
    /// mixed-precision policy. Not between a forward and its backward. A collective.
    pub fn full_state_dict_rank0(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        let e = self.engine();
        e.outside_step("full_state_dict_rank0")?;
        let keeps = self.is_first_replica();
        let mut whole = Vec::new();
        for p in &e.params {
            let Some(full) = gather_to_first(&e, p)? else { continue };
            if keeps {
                let t = Tensor::from_vec(full, p.layout.dims.clone(), &Device::Cpu)
                    .map_err(tensor(format!("`{}` gathered whole", p.name)))?;
                whole.push((p.name.clone(), t));
            }
        }
        Ok((keeps && e.group.rank() == 0).then_some(whole))
    }
}

/// Parameter `p` whole on the group's rank 0 (`None` elsewhere).
fn gather_to_first(e: &Engine, p: &Param) -> Result<Option<Vec<f32>>> {
    let mut input = Vec::with_capacity(p.layout.padded_len());
    with_f32_slice(p.shard.as_tensor(), |shard| p.layout.pack_shard(shard, &mut input))
        .map_err(tensor(format!("reading the shard of `{}`", p.name)))?;
    if e.group.rank() != 0 {
        e.group.gather(&input, None, 0).map_err(comm("gather"))?;
        return Ok(None);
    }
    let mut full = vec![0f32; input.len() * e.group.size()];
    e.group.gather(&input, Some(&mut full), 0).map_err(comm("gather"))?;
    full.truncate(p.layout.full_len());
    Ok(Some(full))
}

/// Rank 0's side of [`Fsdp::save_safetensors`]: the file, each parameter gathered as the
/// writer reaches it (`gathered` counts those of `order` taken).
fn write_file(
    e: &Engine,
    path: &Path,
    buffers: &[(String, Tensor)],
    order: &[usize],
    gathered: &mut usize,
) -> Result<()> {
    let mut whole = Vec::with_capacity(buffers.len());
    for (name, t) in buffers {
        let data = tandem_nn::convert::to_ckpt(t)
            .map_err(|err| bad(path, format!("buffer `{name}`: {err}")))?;
        whole.push(data);
    }
    let params = e.params.iter().map(|p| TensorSpec {
        name: p.name.clone(),
        dtype: ElemType::F32,
        shape: p.layout.dims.clone(),
    });
    let kept = buffers.iter().zip(&whole).map(|((name, _), t)| TensorSpec {
        name: name.clone(),
        dtype: t.dtype,
        shape: t.shape.clone(),
    });
    let specs: Vec<TensorSpec> = params.chain(kept).collect();
    let mut failed = None;
    let written = save_streaming(path, &specs, |i, out| {
        let Some(p) = e.params.get(i) else {
            return out.write_all(&whole[i - e.params.len()].contiguous_bytes());
        };
        if order.get(*gathered) != Some(&i) {
            let why = format!("`{}` out of the gathering order", p.name);
            return Err(std::io::Error::other(why));
        }
        *gathered += 1;
        match gather_to_first(e, p) {
            Ok(full) => out.write_all(bytemuck::cast_slice(&full.unwrap_or_default())),
            Err(err) => {
                let why = err.to_string();
                failed = Some(err);
                Err(std::io::Error::other(why))
            }
        }
    });
    match (failed, written) {
        (Some(err), _) => Err(err),
        (None, Err(err)) => Err(read(err)),
        (None, Ok(())) => Ok(()),
    }
}
