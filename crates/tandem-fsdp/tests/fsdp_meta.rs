//! Building a sharded model without ever holding it whole (FSDP2's meta-device init) and
//! loading trained weights into it row by row: the values against a whole build, on 1, 2 and
//! 3 ranks, a model's own init given one parameter at a time, and the errors a weights file
//! that does not fit the model gets.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use tandem_fsdp::{Fsdp, FsdpOptions, FullyShard, MetaVarMap, Units};
use tandem_testutil::run_tcp_world;

const VOCAB: usize = 37; // uneven over 2 and 3 ranks
const DIM: usize = 12;

/// A small transformer-shaped model in stock candle-nn layers and their default inits.
struct Net<B> {
    wte: Embedding,
    wpe: Tensor,
    blocks: Vec<B>,
    norm: LayerNorm,
    head: Linear,
}

struct Block {
    fc1: Linear,
    fc2: Linear,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x + self.fc2.forward(&self.fc1.forward(x)?.gelu_erf()?)?
    }
}

fn build(vb: VarBuilder) -> Net<Block> {
    let block = |i: usize| {
        let vb = vb.pp(format!("blocks.{i}"));
        Block {
            fc1: candle_nn::linear(DIM, 4 * DIM + 1, vb.pp("fc1")).unwrap(),
            fc2: candle_nn::linear(4 * DIM + 1, DIM, vb.pp("fc2")).unwrap(),
        }
    };
    Net {
        wte: candle_nn::embedding(VOCAB, DIM, vb.pp("wte")).unwrap(),
        wpe: vb
            .get_with_hints(DIM, "wpe.weight", candle_nn::Init::Randn { mean: 0., stdev: 0.02 })
            .unwrap(),
        blocks: (0..2).map(block).collect(),
        norm: candle_nn::layer_norm(DIM, 1e-5, vb.pp("norm")).unwrap(),
        head: candle_nn::linear(DIM, VOCAB, vb.pp("head")).unwrap(),
    }
}

impl<B: Module> Net<B> {
    fn loss(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.wte.forward(tokens)?.broadcast_add(&self.wpe)?;
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        // The head plus the embedding read again (a tied weight: two gradients to add).
        let x = self.norm.forward(&x)?;
        let tied = x.broadcast_matmul(&self.wte.embeddings().t()?)?;
        let logits = (self.head.forward(&x)? + tied)?;
        candle_nn::ops::log_softmax(&logits, D::Minus1)?.mean_all()?.neg()
    }
}

fn shard(net: Net<Block>, fsdp: &Fsdp) -> Net<FullyShard<Block>> {
    let blocks = net.blocks.into_iter().enumerate();
    Net {
        wte: net.wte,
        wpe: net.wpe,
        blocks: blocks.map(|(i, b)| fsdp.fully_shard(&format!("blocks.{i}"), b).unwrap()).collect(),
        norm: net.norm,
        head: net.head,
    }
}

fn opts() -> FsdpOptions {
    FsdpOptions { units: Units::prefixes(["blocks.0", "blocks.1"]), ..FsdpOptions::default() }
}

fn tokens() -> Tensor {
    Tensor::from_vec((0..16u32).map(|i| i * 7 % VOCAB as u32).collect(), 16, &Device::Cpu).unwrap()
}

/// The model whole, as a sharded build from `seed` draws it, and its loss on `tokens()`.
fn whole(seed: u64) -> (HashMap<String, Vec<f32>>, f32) {
    let meta = MetaVarMap::new(seed);
    let net = build(meta.var_builder());
    let vars = meta.materialize().unwrap();
    let loss = net.loss(&tokens()).unwrap().to_scalar::<f32>().unwrap();
    let values = vars
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    (values, loss)
}

/// Built on meta and sharded over 1, 2 and 3 ranks, every rank holds only its rows, the
/// gathered model is the whole build from the same seed bit for bit, and its loss is that
/// build's: a sharded init does not depend on the number of ranks.
#[test]
fn a_model_built_on_meta_is_the_same_bits_on_one_two_and_three_ranks() {
    let (want, want_loss) = whole(11);
    assert_eq!(want.len(), 14, "{:?}", want.keys());
    for world in 1..=3 {
        let out = run_tcp_world(world, |pg| {
            let meta = MetaVarMap::new(11);
            let net = build(meta.var_builder());
            let fsdp = Fsdp::from_meta(&meta, &pg, opts()).unwrap();
            let rows: Vec<(String, usize)> =
                fsdp.shards().iter().map(|s| (s.name.clone(), s.var.dims()[0])).collect();
            let state = fsdp.full_state_dict().unwrap();
            // The model's tensors are f32 while freed: backward's accumulators take their dtype
            // (the example's tied embedding failed to add a u8 zero to an f32 gradient).
            for t in [net.wte.embeddings(), &net.wpe, net.head.weight(), net.norm.weight()] {
                assert_eq!(t.dtype(), DType::F32);
            }
            let net = shard(net, &fsdp);
            let loss = fsdp.forward(|| net.loss(&tokens())).unwrap();
            fsdp.backward(&loss).unwrap(); // (a step ends with its backward)
            (rows, state, loss.to_scalar::<f32>().unwrap())
        });
        for (rank, (rows, state, loss)) in out.into_iter().enumerate() {
            let wte = rows.iter().find(|(n, _)| n == "wte.weight").unwrap().1;
            assert_eq!(wte, tandem_fsdp::shard_rows(&[VOCAB, DIM], rank, world).len());
            assert_eq!(state.len(), want.len());
            for (name, t) in state {
                let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(got == want[&name], "{world} rank(s), rank {rank}: `{name}` differs");
            }
            assert_eq!(loss, want_loss, "{world} rank(s), rank {rank}: the loss");
        }
    }
    // The draws follow the layers' inits: LayerNorm's ones and zeros, Linear's bounds.
    assert!(want["norm.weight"].iter().all(|&v| v == 1.0));
    assert!(want["norm.bias"].iter().all(|&v| v == 0.0));
    let bound = 1.0 / (DIM as f32).sqrt();
    assert!(want["blocks.0.fc1.bias"].iter().all(|v| v.abs() <= bound));
    assert_ne!(whole(12).0["head.weight"], want["head.weight"], "another seed, other values");
}

/// A model read before it is sharded: the read is an error naming the freed parameter, not a
/// read of memory that is not there.
/// A model's own init (`Fsdp::from_meta_with`): every parameter is asked for once, in the
/// order given (creation order here, not the map's sorted one), and kept as that order; each
/// rank holds its rows of the given values, a parameter given none is the map's draw, and a
/// frozen one left out is materialized whole afterwards. Wrong input is refused by name.
#[test]
fn a_models_own_init_is_asked_once_per_parameter_in_order_and_sharded() {
    let given = |name: &str, dims: &[usize]| -> Option<Vec<f32>> {
        let n: usize = dims.iter().product();
        let salt = name.len() as f32;
        (name != "norm.weight").then(|| (0..n).map(|i| salt + i as f32 / 1000.0).collect())
    };
    let out = run_tcp_world(2, move |pg| {
        let meta = MetaVarMap::new(3);
        let net = build(meta.var_builder());
        let named: Vec<_> =
            meta.named().into_iter().filter(|(n, _)| n != "blocks.1.fc2.bias").collect();
        let order: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        let mut asked = Vec::new();
        let mut values = |name: &str, dims: &[usize]| {
            asked.push(name.to_string());
            given(name, dims)
        };
        let fsdp = Fsdp::from_meta_with(named, &meta, (&pg, None), opts(), &mut values).unwrap();
        let kept = meta.materialize_with(&["blocks.1.fc2.bias"], &mut values).unwrap();
        let sharded: Vec<String> = fsdp.shards().iter().map(|s| s.name.clone()).collect();
        let rows: Vec<usize> = fsdp.shards().iter().map(|s| s.var.dims()[0]).collect();
        let state = fsdp.full_state_dict().unwrap();
        let kept = kept[0].1.as_tensor().to_vec1::<f32>().unwrap();
        // The frozen bias is read by the model: the forward works with it whole.
        let net = shard(net, &fsdp);
        fsdp.forward(|| net.loss(&tokens())).unwrap();
        (order, asked, sharded, rows, state, kept)
    });
    for (rank, (order, asked, sharded, rows, state, kept)) in out.into_iter().enumerate() {
        assert_ne!(
            order,
            {
                let mut o = order.clone();
                o.sort();
                o
            },
            "not the sorted order"
        );
        let mut want_asked = order.clone();
        want_asked.push("blocks.1.fc2.bias".into());
        assert_eq!(asked, want_asked, "rank {rank}: each parameter once, in order");
        assert_eq!(sharded, order, "rank {rank}: the shards keep the given order");
        let wte = sharded.iter().position(|n| n == "wte.weight").unwrap();
        assert_eq!(rows[wte], tandem_fsdp::shard_rows(&[VOCAB, DIM], rank, 2).len());
        for (name, t) in state {
            let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            match given(&name, t.dims()) {
                Some(want) => assert!(got == want, "rank {rank}: `{name}` is not the given values"),
                None => assert!(got.iter().all(|&v| v == 1.0), "`{name}`: the map's draw"),
            }
        }
        assert!(kept == given("blocks.1.fc2.bias", &[DIM]).unwrap(), "the frozen bias");
    }
    // A parameter the map did not build, and values of the wrong size: named errors, on every
    // rank before any collective.
    let errors = run_tcp_world(2, |pg| {
        let meta = MetaVarMap::new(3);
        let _net = build(meta.var_builder());
        let stranger = vec![(
            "nope.weight".to_string(),
            candle_core::Var::zeros(3, DType::F32, &Device::Cpu).unwrap(),
        )];
        let mut none = |_: &str, _: &[usize]| None;
        let e1 =
            Fsdp::from_meta_with(stranger, &meta, (&pg, None), opts(), &mut none).err().unwrap();
        let mut short = |_: &str, _: &[usize]| Some(vec![0.0; 2]);
        let e2 = Fsdp::from_meta_with(meta.named(), &meta, (&pg, None), opts(), &mut short)
            .err()
            .unwrap();
        (e1.to_string(), e2.to_string())
    });
    for (e1, e2) in errors {
        assert!(e1.contains("`nope.weight`") && e1.contains("meta"), "{e1}");
        assert!(e2.contains("2 initial values"), "{e2}");
    }
}

#[test]
fn reading_a_meta_parameter_is_an_error() {
    let meta = MetaVarMap::new(0);
    let net = build(meta.var_builder());
    let err = net.loss(&tokens()).unwrap_err().to_string().to_lowercase();
    assert!(err.contains("f8e8m0"), "{err}");
}

fn save(path: &Path, tensors: Vec<(String, Tensor)>) {
    let map: HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, path).unwrap();
}

/// "Trained" weights (another seed), written as DDP's wrapper names them (`module.`), split
/// over two files, the head's weight stored in f16, with a BatchNorm-style buffer beside them.
/// Returns the files and the values a load must give (the f16 one widened).
fn pretrained(dir: &Path) -> (Vec<PathBuf>, HashMap<String, Vec<f32>>) {
    let (mut values, _) = whole(99);
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (n, v) in values.iter_mut() {
        let mut t = Tensor::from_vec(v.clone(), shape_of(n), &Device::Cpu).unwrap();
        if n == "head.weight" {
            t = t.to_dtype(DType::F16).unwrap();
            *v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        }
        tensors.push((format!("module.{n}"), t));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let buffer = Tensor::from_vec(vec![0.5f32, 1.5, 2.5], 3, &Device::Cpu).unwrap();
    tensors.push(("module.bn.running_var".into(), buffer));
    let second = tensors.split_off(tensors.len() / 2);
    let paths = vec![dir.join("model-1.safetensors"), dir.join("model-2.safetensors")];
    save(&paths[0], tensors);
    save(&paths[1], second);
    (paths, values)
}

fn shape_of(name: &str) -> Vec<usize> {
    let meta = MetaVarMap::new(0);
    let _ = build(meta.var_builder());
    meta.materialize()
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.dims().to_vec())
        .unwrap()
}

/// Each rank reads its rows of the files into its shards: the gathered model is the files'
/// values exactly, on 2 and 3 ranks, through the wrapper's `module.` prefix; the buffer comes
/// back whole for the caller. The same state dict as one `.pt`, read by tandem-ckpt, loads
/// the same rows (`load_state_dict_rows`); a value that is not a dict of tensors is refused.
#[test]
fn trained_weights_load_row_by_row_on_any_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (files, want) = pretrained(dir.path());
    let mut merged = Vec::new();
    for f in &files {
        let v = tandem_ckpt::load(f).unwrap();
        merged.extend(v.as_dict().unwrap().iter().cloned());
    }
    let pt = dir.path().join("model.pt");
    tandem_ckpt::save(&pt, &tandem_ckpt::Value::Dict(merged)).unwrap();
    for (world, via_pt) in [(2, false), (3, false), (2, true), (3, true)] {
        let (files, pt) = (files.clone(), pt.clone());
        let out = run_tcp_world(world, move |pg| {
            let meta = MetaVarMap::new(5);
            let _net = build(meta.var_builder());
            let fsdp = Fsdp::from_meta(&meta, &pg, opts()).unwrap();
            let buffers = match via_pt {
                false => fsdp.load_safetensors(&files).unwrap(),
                true => {
                    let state = tandem_ckpt::load(&pt).unwrap();
                    let list = tandem_ckpt::Value::List(vec![]);
                    let err = fsdp.load_state_dict_rows(&pt, &list, &[]).unwrap_err();
                    assert!(err.to_string().contains("not a dict of tensors"), "{err}");
                    fsdp.load_state_dict_rows(&pt, &state, &[]).unwrap()
                }
            };
            (fsdp.full_state_dict().unwrap(), buffers)
        });
        for (rank, (state, buffers)) in out.into_iter().enumerate() {
            for (name, t) in state {
                let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(got == want[&name], "{world} rank(s), rank {rank}: `{name}` not loaded");
            }
            assert_eq!(buffers.len(), 1);
            assert_eq!(buffers[0].0, "bn.running_var");
            assert_eq!(buffers[0].1.to_vec1::<f32>().unwrap(), [0.5, 1.5, 2.5]);
        }
    }
}

/// Weights that do not fit: a missing parameter, another shape, a key of no parameter, a
/// truncated file, two keys for one parameter — each an error naming the key or file, and the
/// shards as they were.
#[test]
fn weights_that_do_not_fit_are_refused_by_name_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (files, want) = pretrained(dir.path());
    let mut all = Vec::new();
    for f in &files {
        all.extend(candle_core::safetensors::load(f, &Device::Cpu).unwrap());
    }
    type Tensors = Vec<(String, Tensor)>;
    let variant = |name: &str, edit: &dyn Fn(&mut Tensors)| -> PathBuf {
        let mut t = all.clone();
        edit(&mut t);
        let path = dir.path().join(name);
        save(&path, t);
        path
    };
    let missing = variant("missing.safetensors", &|t| t.retain(|(k, _)| k != "module.head.bias"));
    let reshaped = variant("reshaped.safetensors", &|t| {
        let at = t.iter().position(|(k, _)| k == "module.head.bias").unwrap();
        t[at].1 = Tensor::zeros(VOCAB + 1, DType::F32, &Device::Cpu).unwrap();
    });
    let extra = variant("extra.safetensors", &|t| {
        t.push((
            "module.lm_head.weight".into(),
            Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
        ))
    });
    let twice = variant("twice.safetensors", &|t| {
        t.push(("head.bias".into(), Tensor::zeros(VOCAB, DType::F32, &Device::Cpu).unwrap()))
    });
    let truncated = dir.path().join("truncated.safetensors");
    let bytes = std::fs::read(&files[0]).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    let cases: Vec<(PathBuf, Vec<&str>)> = vec![
        (missing.clone(), vec!["missing.safetensors", "`head.bias`"]),
        (reshaped.clone(), vec!["reshaped.safetensors", "`module.head.bias`", "[38]", "[37]"]),
        (extra.clone(), vec!["extra.safetensors", "`module.lm_head.weight`", "no parameter"]),
        (truncated.clone(), vec!["truncated.safetensors", "truncated"]),
        (twice.clone(), vec!["twice.safetensors", "`module.head.bias`", "are both `head.bias`"]),
    ];
    run_tcp_world(2, move |pg| {
        let meta = MetaVarMap::new(5);
        let _net = build(meta.var_builder());
        let fsdp = Fsdp::from_meta(&meta, &pg, opts()).unwrap();
        let before = fsdp.full_state_dict().unwrap();
        for (file, words) in &cases {
            let err = fsdp.load_safetensors(&[file]).unwrap_err().to_string();
            for w in words {
                assert!(err.contains(w), "{}: `{w}` not in: {err}", file.display());
            }
            for ((name, a), (_, b)) in before.iter().zip(fsdp.full_state_dict().unwrap()) {
                let (a, b) = (a.flatten_all().unwrap(), b.flatten_all().unwrap());
                let same = a.to_vec1::<f32>().unwrap() == b.to_vec1::<f32>().unwrap();
                assert!(same, "{}: `{name}` changed by a refused load", file.display());
            }
        }
        // A tensor the caller keeps whole (a frozen parameter) is required as a parameter is,
        // and comes back whole with the buffers.
        let err = fsdp.load_safetensors_with(&files, &["frozen.weight"]).unwrap_err().to_string();
        assert!(err.contains("`frozen.weight`"), "{err}");
        for ((name, a), (_, b)) in before.iter().zip(fsdp.full_state_dict().unwrap()) {
            let same = a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                == b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(same, "`{name}` changed by a load missing a whole tensor");
        }
        let got = fsdp.load_safetensors_with(&[&extra], &["lm_head.weight"]).unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["bn.running_var", "lm_head.weight"]);
        assert_eq!(got[1].1.to_vec1::<f32>().unwrap(), [0.0; 3]);
    });
    assert!(want.contains_key("head.bias"));
}

/// The model saved whole from 3 ranks, one parameter gathered at a time: the file holds the
/// loaded values exactly (read by candle, and by PyTorch's `safetensors.torch.load_file` when a
/// Python with torch is there), with the caller's buffer, and loads on 2 ranks to the same
/// bits; the state dict gathered to rank 0 alone holds them too. A file rank 0 cannot write
/// is an error on every rank, naming it, and no rank hangs.
#[test]
fn a_sharded_model_saves_one_file_that_loads_on_another_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (files, want) = pretrained(dir.path());
    let out = dir.path().join("finetuned.safetensors");
    let (target, bad) = (out.clone(), dir.path().join("no-such-dir/model.safetensors"));
    let errors = run_tcp_world(3, move |pg| {
        let meta = MetaVarMap::new(5);
        let _net = build(meta.var_builder());
        let fsdp = Fsdp::from_meta(&meta, &pg, opts()).unwrap();
        let buffers = fsdp.load_safetensors(&files).unwrap();
        fsdp.save_safetensors(&target, &buffers).unwrap();
        // The same parameters as tensors, on rank 0 alone: no unit gathered on any rank.
        fsdp.take_comm_stats();
        let on_rank0 = fsdp.full_state_dict_rank0().unwrap();
        assert_eq!(fsdp.take_comm_stats().all_gathers, 0, "rank {}", pg.rank());
        match (pg.rank(), on_rank0) {
            (0, Some(state)) => {
                let everywhere = fsdp.full_state_dict().unwrap();
                let names = |s: &[(String, Tensor)]| -> Vec<String> {
                    s.iter().map(|(n, _)| n.clone()).collect()
                };
                assert_eq!(names(&state), names(&everywhere), "the model's order");
                for ((name, a), (_, b)) in state.iter().zip(&everywhere) {
                    assert_eq!(a.dims(), b.dims(), "`{name}`");
                    let (a, b) = (a.flatten_all().unwrap(), b.flatten_all().unwrap());
                    let same = a.to_vec1::<f32>().unwrap() == b.to_vec1::<f32>().unwrap();
                    assert!(same, "`{name}` gathered to rank 0");
                }
            }
            (rank, got) => {
                assert_eq!(got.is_some(), rank == 0, "rank {rank}: a state dict only on rank 0");
                fsdp.full_state_dict().unwrap();
            }
        }
        fsdp.save_safetensors(&bad, &buffers).unwrap_err().to_string()
    });
    for (rank, err) in errors.iter().enumerate() {
        assert!(err.contains("no-such-dir/model.safetensors"), "rank {rank}: {err}");
        if rank > 0 {
            assert!(err.contains("rank 0 could not write it"), "rank {rank}: {err}");
        }
    }
    let saved = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    assert_eq!(saved.len(), want.len() + 1);
    for (name, values) in &want {
        let got = saved[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(&got == values, "`{name}` in the saved file");
    }
    assert_eq!(saved["bn.running_var"].to_vec1::<f32>().unwrap(), [0.5, 1.5, 2.5]);
    let reload = out.clone();
    let again = run_tcp_world(2, move |pg| {
        let meta = MetaVarMap::new(8);
        let _net = build(meta.var_builder());
        let fsdp = Fsdp::from_meta(&meta, &pg, opts()).unwrap();
        fsdp.load_safetensors(&[&reload]).unwrap();
        fsdp.full_state_dict().unwrap()
    });
    for (rank, state) in again.into_iter().enumerate() {
        for (name, t) in state {
            let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(got == want[&name], "2 ranks, rank {rank}: `{name}` after the round trip");
        }
    }
    // PyTorch reads the file: every tensor's shape, and its values summed in float64.
    let Some(python) = tandem_testutil::torch_python() else { return };
    let script = "import sys, torch\nfrom safetensors.torch import load_file\n\
                  for k, v in sorted(load_file(sys.argv[1]).items()):\n    \
                  print(k, 'x'.join(map(str, v.shape)), repr(v.double().sum().item()))";
    let run = std::process::Command::new(python).args(["-c", script]).arg(&out).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8(run.stdout).unwrap();
    assert_eq!(text.lines().count(), want.len() + 1, "{text}");
    for line in text.lines() {
        let [name, shape, sum] = line.split(' ').collect::<Vec<_>>()[..] else { panic!("{line}") };
        let dims: Vec<String> = saved[name].dims().iter().map(|d| d.to_string()).collect();
        assert_eq!(shape, dims.join("x"), "{name}: the shape torch reads");
        let sum: f64 = sum.parse().unwrap();
        let ours: f64 = match want.get(name) {
            Some(v) => v.iter().map(|&x| f64::from(x)).sum(),
            None => 4.5, // the buffer
        };
        let close = (sum - ours).abs() <= 1e-9 * ours.abs().max(1.0);
        assert!(close, "{name}: torch sums {sum}, the values saved {ours}");
    }
}
