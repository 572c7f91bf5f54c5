//! [`MetaVarMap`]: building a model that does not fit on one rank — FSDP2's meta-device init
//! (`with torch.device("meta"): model = Net()`, `fully_shard`, `to_empty`, `init_weights`).
//!
//! The model is built from [`MetaVarMap::var_builder`] as from a `VarMap`, but its parameters
//! get no values: each is a `Var` of the right shape holding the freed placeholder of
//! `storage` (reading it is an error, never a read of absent memory). [`crate::Fsdp::from_meta`]
//! then draws each rank's rows of every parameter from the init the model asked for, so a rank
//! holds its shards, and one parameter's zeros for a moment while the model asks for it (a
//! large one is pages the kernel has not handed out), never the model.
//!
//! **Seeded, and the same bits on any number of ranks.** candle's CPU random numbers cannot be
//! seeded, and a sharded init must give every rank its own rows of one draw. Each parameter
//! draws from its own ChaCha8 stream (the map's seed, the stream chosen by the parameter's
//! name) with a fixed number of words per element, so a rank seeks straight to its first row:
//! a model built on 1, 2 or 3 ranks from one seed holds the same values, bit for bit
//! ([`MetaVarMap::materialize`] gives them whole). The distributions are candle-nn's `Init`:
//! constants, uniform, normal and Kaiming (fan and gain as candle-nn computes them); the draws
//! are ours, not candle's or PyTorch's.
//!
//! Buffers (BatchNorm's `running_mean`, `running_var`, `num_batches_tracked`) and parameters
//! of other dtypes are small and kept whole on every rank, as FSDP2 leaves buffers: they get
//! their values when the model asks for them.
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use tandem_nn::is_buffer;

use crate::storage;

/// A parameter created without values, and how to draw them.
#[derive(Clone)]
pub(crate) struct MetaParam {
    pub name: String,
    pub var: Var,
    pub init: Init,
}

/// Variables a model is built on without values (see the module docs). Cloning shares the map.
#[derive(Clone)]
pub struct MetaVarMap {
    seed: u64,
    params: Arc<Mutex<Vec<MetaParam>>>,
    /// Buffers and non-f32 variables, created with their values.
    whole: Arc<Mutex<Vec<(String, Var)>>>,
    /// Every variable's name in the order the model created them.
    created: Arc<Mutex<Vec<String>>>,
}

impl MetaVarMap {
    /// An empty map whose parameters will be drawn from `seed`.
    pub fn new(seed: u64) -> MetaVarMap {
        MetaVarMap { seed, params: Arc::default(), whole: Arc::default(), created: Arc::default() }
    }

    /// A float32 `VarBuilder` on the CPU creating variables in this map (the model's code as
    /// with `VarBuilder::from_varmap`).
    pub fn var_builder(&self) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), DType::F32, Device::Cpu)
    }

    /// The seed the parameters are drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    fn lock_params(&self) -> MutexGuard<'_, Vec<MetaParam>> {
        self.params.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The parameters without values, sorted by name (the order [`crate::Fsdp::from_varmap`]
    /// gives a `VarMap`'s).
    pub(crate) fn params(&self) -> Vec<MetaParam> {
        let mut params = self.lock_params().clone();
        params.sort_by(|a, b| a.name.cmp(&b.name));
        params
    }

    /// Every variable, parameters and buffers, in the order the model created them (PyTorch's
    /// `state_dict()` order); the parameters hold no values until sharded or materialized.
    pub fn named(&self) -> Vec<(String, Var)> {
        let created = self.created.lock().unwrap_or_else(|p| p.into_inner()).clone();
        created.into_iter().filter_map(|name| self.known(&name).map(|var| (name, var))).collect()
    }

    /// The variables kept whole (buffers, non-f32 variables), sorted by name: the state the
    /// caller keeps beside the sharded parameters, as with a `VarMap`'s buffers.
    pub fn buffers(&self) -> Vec<(String, Var)> {
        let mut whole = self.whole.lock().unwrap_or_else(|p| p.into_inner()).clone();
        whole.sort_by(|a, b| a.0.cmp(&b.0));
        whole
    }

    /// Every parameter whole, with the values a sharded build draws (for a model that fits on
    /// one rank, or to check a sharded one): fills the map's variables. Call it instead of
    /// [`crate::Fsdp::from_meta`], not after it.
    pub fn materialize(&self) -> candle_core::Result<Vec<(String, Var)>> {
        let names: Vec<String> = self.params().into_iter().map(|p| p.name).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        self.materialize_with(&names, &mut |_, _| None)
    }

    /// Gives the parameters named `names` their values whole — parameters a caller keeps
    /// beside the shards on every rank, as a frozen one kept with the buffers — from `values`
    /// (`None`: the map's draw). Returns them in `names`' order; a name that is no parameter of
    /// the map is an error naming it.
    pub fn materialize_with(
        &self,
        names: &[&str],
        values: &mut crate::InitialValues,
    ) -> candle_core::Result<Vec<(String, Var)>> {
        let params = self.params();
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let Some(p) = params.iter().find(|p| p.name == *name) else {
                candle_core::bail!("`{name}` is not a parameter built on the meta map")
            };
            let rows = p.var.dims().first().copied().unwrap_or(1);
            let values = match values(name, p.var.dims()) {
                Some(v) if v.len() == p.var.elem_count() => v,
                Some(v) => {
                    candle_core::bail!("{} initial values for `{name}` {:?}", v.len(), p.var.dims())
                }
                None => draw_rows(&p.name, p.var.shape(), &p.init, self.seed, 0..rows),
            };
            storage::fill(p.var.as_tensor(), values)?;
            out.push((p.name.clone(), p.var.clone()));
        }
        Ok(out)
    }

    /// The init parameter `name` was built with.
    pub(crate) fn init_of(&self, name: &str) -> Option<Init> {
        self.lock_params().iter().find(|p| p.name == name).map(|p| p.init)
    }

    fn known(&self, name: &str) -> Option<Var> {
        let params = self.lock_params();
        if let Some(p) = params.iter().find(|p| p.name == name) {
            return Some(p.var.clone());
        }
        let whole = self.whole.lock().unwrap_or_else(|p| p.into_inner());
        whole.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }
}

impl SimpleBackend for MetaVarMap {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(var) = self.known(name) {
            if var.shape() != &shape {
                candle_core::bail!(
                    "meta variable `{name}`: asked for shape {shape:?}, created with {:?}",
                    var.shape()
                )
            }
            return Ok(var.as_tensor().clone());
        }
        if !matches!(device, Device::Cpu) {
            candle_core::bail!("meta variable `{name}`: FSDP shards CPU parameters for now")
        }
        self.created.lock().unwrap_or_else(|p| p.into_inner()).push(name.to_string());
        if dtype != DType::F32 || is_buffer(name) {
            // Kept whole on every rank: its values now, drawn as a parameter's would be.
            let rows = shape.dims().first().copied().unwrap_or(1);
            let values = draw_rows(name, &shape, &init, self.seed, 0..rows);
            let var = Var::from_tensor(&Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?)?;
            let t = var.as_tensor().clone();
            self.whole.lock().unwrap_or_else(|p| p.into_inner()).push((name.to_string(), var));
            return Ok(t);
        }
        // Zeros for a moment (a large block is pages the kernel has not handed out yet), then
        // the freed placeholder: the model holds the `Var` its unit will fill. (Made as f32:
        // a tensor keeps the dtype it was made with, and backward's accumulators take it.)
        let var = Var::zeros(shape, DType::F32, device)?;
        storage::free(var.as_tensor())?;
        let t = var.as_tensor().clone();
        self.lock_params().push(MetaParam { name: name.to_string(), var, init });
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.known(name) {
            Some(var) => Ok(var.as_tensor().clone()),
            None => candle_core::bail!(
                "meta variable `{name}` was never created: a MetaVarMap holds no values to load"
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.known(name).is_some()
    }
}

/// FNV-1a of a parameter's name: its stream number.
fn stream_of(name: &str) -> u64 {
    name.bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// A uniform value in [0, 1) from one 32-bit word (24 bits: every f32 step of [0.5, 1)).
fn unit_f32(rng: &mut ChaCha8Rng) -> f64 {
    f64::from(rng.next_u32() >> 8) * (1.0 / (1u32 << 24) as f64)
}

/// A uniform value in [0, 1) from one 64-bit word (53 bits).
fn unit_f64(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The distribution an `Init` draws from, for a parameter of `shape`.
enum Draw {
    Const(f64),
    Uniform { lo: f64, up: f64 },
    Normal { mean: f64, std: f64 },
}

impl Draw {
    fn of(init: &Init, shape: &Shape) -> Draw {
        match *init {
            Init::Const(v) => Draw::Const(v),
            Init::Uniform { lo, up } => Draw::Uniform { lo, up },
            Init::Randn { mean, stdev } => Draw::Normal { mean, std: stdev },
            Init::Kaiming { dist, fan, non_linearity } => {
                let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        Draw::Uniform { lo: -bound, up: bound }
                    }
                    NormalOrUniform::Normal => Draw::Normal { mean: 0.0, std },
                }
            }
        }
    }

    /// Stream words one element takes: every element the same, so a rank seeks to its rows.
    fn words(&self) -> u128 {
        match self {
            Draw::Const(_) => 0,
            Draw::Uniform { .. } => 1,
            Draw::Normal { .. } => 4,
        }
    }
}

/// Rows `rows` of the parameter `name` of `shape` (row-major, a scalar as one row), drawn
/// from `seed` as `init` asks.
pub(crate) fn draw_rows(
    name: &str,
    shape: &Shape,
    init: &Init,
    seed: u64,
    rows: Range<usize>,
) -> Vec<f32> {
    let row_len: usize = shape.dims().iter().skip(1).product();
    let (first, n) = (rows.start * row_len, rows.len() * row_len);
    let draw = Draw::of(init, shape);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream_of(name));
    rng.set_word_pos(first as u128 * draw.words());
    match draw {
        Draw::Const(v) => vec![v as f32; n],
        Draw::Uniform { lo, up } => {
            (0..n).map(|_| (lo + (up - lo) * unit_f32(&mut rng)) as f32).collect()
        }
        Draw::Normal { mean, std } => (0..n)
            .map(|_| {
                // Box-Muller with u1 in (0, 1]: two 64-bit words an element.
                let u1 = 1.0 - unit_f64(&mut rng);
                let u2 = unit_f64(&mut rng);
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (mean + std * z) as f32
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(name: &str, dims: &[usize], init: Init, seed: u64, rows: Range<usize>) -> Vec<f32> {
        draw_rows(name, &Shape::from_dims(dims), &init, seed, rows)
    }

    /// Any run of rows is the same values as those rows of the whole draw; names draw apart.
    #[test]
    fn rows_seek_into_one_stream_per_parameter() {
        for init in [
            Init::Uniform { lo: -0.5, up: 0.25 },
            Init::Randn { mean: 1.0, stdev: 0.02 },
            candle_nn::init::DEFAULT_KAIMING_NORMAL,
        ] {
            let name = "blocks.0.fc1.weight";
            let whole = draw(name, &[7, 5], init, 42, 0..7);
            for rows in [0..3, 3..7, 2..5, 6..7] {
                let part = draw(name, &[7, 5], init, 42, rows.clone());
                assert_eq!(part, whole[rows.start * 5..rows.end * 5], "{rows:?}");
            }
            assert_ne!(draw("blocks.1.fc1.weight", &[7, 5], init, 42, 0..7), whole);
            assert_ne!(draw(name, &[7, 5], init, 43, 0..7), whole, "another seed");
        }
    }

    /// The draws have the distribution asked for: bounds, mean and spread over 200k values,
    /// Kaiming's spread from the fan in and the gain as candle-nn computes it.
    #[test]
    fn draws_follow_the_init() {
        let stats = |v: &[f32]| {
            let n = v.len() as f64;
            let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
            let var = v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n;
            (mean, var.sqrt())
        };
        let v = draw("u", &[400, 500], Init::Uniform { lo: -2.0, up: 1.0 }, 1, 0..400);
        assert!(v.iter().all(|&x| (-2.0..1.0).contains(&x)));
        let (mean, std) = stats(&v);
        assert!(
            (mean + 0.5).abs() < 0.01 && (std - 3.0 / 12f64.sqrt()).abs() < 0.01,
            "{mean} {std}"
        );
        let v = draw("n", &[400, 500], Init::Randn { mean: 3.0, stdev: 0.5 }, 1, 0..400);
        let (mean, std) = stats(&v);
        assert!((mean - 3.0).abs() < 0.005 && (std - 0.5).abs() < 0.005, "{mean} {std}");
        // candle-nn's default Kaiming normal (fan in, ReLU gain) on a [400, 500] weight.
        let kaiming = candle_nn::init::DEFAULT_KAIMING_NORMAL;
        let (mean, std) = stats(&draw("k", &[400, 500], kaiming, 1, 0..400));
        let want = 2f64.sqrt() / 500f64.sqrt();
        assert!(mean.abs() < 0.001 && (std / want - 1.0).abs() < 0.01, "{mean} {std} {want}");
        let c = draw("c", &[3], Init::Const(0.25), 1, 0..3);
        assert_eq!(c, [0.25; 3]);
    }
}
