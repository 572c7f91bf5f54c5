//! `tandem ckpt ...` and `tandem bench ckpt` end to end, on files tandem-ckpt's fixtures and
//! tandem itself write.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use tandem::ckpt::{load, save, TensorData, Value};
use tandem_testutil::output_with_deadline;

fn tandem(args: &[&str]) -> Output {
    output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(args),
        Duration::from_secs(120),
    )
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tandem-ckpt/tests/fixtures").join(name)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A small model's state dict, with keys as `prefix` + name.
fn state_dict(prefix: &str, scale: f32) -> Value {
    Value::dict_from([
        (
            format!("{prefix}fc.weight"),
            Value::Tensor(TensorData::from_f32(
                &[2, 3],
                &[1., 2., 3., 4., 5., 6.].map(|x| x * scale),
            )),
        ),
        (format!("{prefix}fc.bias"), Value::Tensor(TensorData::from_f32(&[2], &[0.5, -0.5]))),
        (format!("{prefix}bn.num_batches_tracked"), Value::Tensor(TensorData::from_i64(&[], &[7]))),
    ])
}

#[test]
fn inspect_lists_containers_tensors_values_and_wrapping() {
    let o = tandem(&["ckpt", "inspect", "--json", s(&fixture("nested.pt"))]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let keys: Vec<&str> =
        j["container_keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
    assert_eq!(&keys[..3], ["epoch", "global_step", "model"]);
    let w = j["tensors"].as_array().unwrap().iter().find(|t| t["key"] == "model/0.weight").unwrap();
    assert_eq!(w["dtype"], "float32");
    assert_eq!(w["shape"], serde_json::json!([3, 4]));
    assert_eq!(w["bytes"], 48);
    assert!(j["values"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["key"] == "epoch" && v["value"] == "3"));
    assert_eq!(j["wrapping"], serde_json::json!([]));

    let dir = tempfile::tempdir().unwrap();
    let ddp = dir.path().join("ddp.pt");
    save(
        &ddp,
        &Value::dict_from([("model", state_dict("module.", 1.0)), ("epoch", Value::Int(1))]),
    )
    .unwrap();
    let o = tandem(&["ckpt", "inspect", s(&ddp)]);
    let text = stdout(&o);
    assert!(text.contains("wrapping detected: `module.` prefix"), "{text}");
    assert!(
        text.contains("model/module.fc.weight")
            && text.contains("float32")
            && text.contains("[2, 3]"),
        "{text}"
    );
}

#[test]
fn convert_between_pt_and_safetensors_with_renaming() {
    let dir = tempfile::tempdir().unwrap();
    let ddp = dir.path().join("ddp.pt");
    save(
        &ddp,
        &Value::dict_from([("model", state_dict("module.", 1.0)), ("epoch", Value::Int(1))]),
    )
    .unwrap();
    let st = dir.path().join("w.safetensors");
    let o = tandem(&[
        "ckpt",
        "convert",
        s(&ddp),
        s(&st),
        "--key",
        "model",
        "--strip-prefix",
        "module.",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // safetensors keeps no key order (the crate sorts entries), so compare sorted.
    let sorted = |v: Value| {
        let mut d = v.as_dict().unwrap().to_vec();
        d.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
        d
    };
    assert_eq!(sorted(load(&st).unwrap()), sorted(state_dict("", 1.0)));
    let back = dir.path().join("back.pt");
    let o = tandem(&["ckpt", "convert", s(&st), s(&back), "--add-prefix", "_orig_mod."]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(sorted(load(&back).unwrap()), sorted(state_dict("_orig_mod.", 1.0)));
    // A training dict cannot go to safetensors whole without saying which part.
    let mixed = dir.path().join("mixed.pt");
    save(&mixed, &Value::dict_from([("a", state_dict("", 1.0)), ("b", state_dict("", 2.0))]))
        .unwrap();
    let o = tandem(&["ckpt", "convert", s(&mixed), s(&dir.path().join("x.safetensors"))]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--key"));
}

#[test]
fn diff_reports_differences_and_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) =
        (dir.path().join("a.pt"), dir.path().join("b.pt"), dir.path().join("c.safetensors"));
    save(&a, &state_dict("", 1.0)).unwrap();
    save(&b, &state_dict("module.", 1.0)).unwrap();
    let o = tandem(&["ckpt", "diff", s(&a), s(&b)]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let mut other = state_dict("", 1.5);
    other.insert("extra.bias", Value::Tensor(TensorData::from_f32(&[1], &[0.0])));
    tandem::ckpt::safetensors::save(&c, &other).unwrap();
    let o = tandem(&["ckpt", "diff", s(&a), s(&c)]);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("extra.bias"), "{text}");
    // max |6*1.5 - 6| = 3
    assert!(text.contains("fc.weight: max abs difference 3e0"), "{text}");
}

#[test]
fn load_check_prints_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let (ddp, reference) = (dir.path().join("ddp.pt"), dir.path().join("ref.pt"));
    save(&ddp, &Value::dict_from([("state_dict", state_dict("module.", 1.0))])).unwrap();
    save(&reference, &state_dict("", 0.0)).unwrap();
    let o = tandem(&["ckpt", "load-check", s(&ddp), "--into", s(&reference)]);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(text.contains("3 matched, 0 missing, 0 unexpected"), "{text}");
    assert!(text.contains("state dict found at: state_dict"), "{text}");
    let mut bigger = state_dict("", 0.0);
    bigger.insert("head.weight", Value::Tensor(TensorData::from_f32(&[1], &[0.0])));
    bigger.insert("fc.bias", Value::Tensor(TensorData::from_f32(&[3], &[0.0; 3])));
    save(&reference, &bigger).unwrap();
    let o = tandem(&["ckpt", "load-check", s(&ddp), "--into", s(&reference)]);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("missing keys") && text.contains("head.weight"), "{text}");
    assert!(text.contains("fc.bias: checkpoint [2]"), "{text}");
}

#[test]
fn unreadable_input_is_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pt");
    std::fs::write(&garbage, b"this is not a checkpoint").unwrap();
    let truncated = dir.path().join("truncated.pt");
    let full = std::fs::read(fixture("nested.pt")).unwrap();
    std::fs::write(&truncated, &full[..full.len() / 2]).unwrap();
    let missing = dir.path().join("missing.pt");
    for f in [&garbage, &truncated, &missing] {
        for args in [
            vec!["ckpt", "inspect", s(f)],
            vec!["ckpt", "diff", s(f), s(f)],
            vec!["ckpt", "load-check", s(f), "--into", s(f)],
        ] {
            let o = tandem(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
            let lines: Vec<&str> = err.lines().collect();
            assert_eq!(lines.len(), 1, "{args:?}: {err}");
            assert!(
                lines[0].starts_with("error: ")
                    && lines[0].contains(f.file_name().unwrap().to_str().unwrap()),
                "{err}"
            );
        }
    }
}

#[test]
fn bench_ckpt_prints_throughputs_and_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let o = tandem(&["bench", "ckpt", "--size-mib", "2", "--repeat", "1", "--dir", s(dir.path())]);
    let text = stdout(&o);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for row in [
        "dd conv=fsync",
        "tandem save .pt",
        "tandem save .safetensors",
        "tandem load .pt (mmap)",
        "tandem load .safetensors",
    ] {
        assert!(text.contains(row), "{row} missing:\n{text}");
    }
    assert!(text.contains("tandem save .pt / dd conv=fsync (write)"), "{text}");
}

/// A training checkpoint of 3 ranks with a ZeroRedundancyOptimizer (SGD with momentum, 2
/// steps) under `dir`, saved by `tandem::save_state`: each rank's optimizer entries an entry
/// shard, nothing gathered. Returns the checkpoint's directory.
fn sharded_checkpoint(dir: &Path) -> PathBuf {
    use candle_core::{Device, Tensor as CTensor, Var};
    use tandem::optim::{SgdConfig, TorchOptimizer, TorchSgd, ZeroRedundancyOptimizer};
    let dir = dir.to_path_buf();
    let written = tandem_testutil::run_tcp_world(3, move |pg| {
        let ps: Vec<Var> = [&[4usize, 3][..], &[4], &[2, 4], &[2]]
            .iter()
            .map(|s| {
                Var::from_tensor(&CTensor::ones(*s, candle_core::DType::F32, &Device::Cpu).unwrap())
                    .unwrap()
            })
            .collect();
        let model = tandem::nn::NamedVars::new(
            ps.iter().enumerate().map(|(i, p)| (format!("p{i}"), p.clone())).collect(),
        );
        let mut opt =
            ZeroRedundancyOptimizer::new(ps.clone(), std::sync::Arc::new(pg.clone()), |shard| {
                let cfg = SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() };
                Ok(Box::new(TorchSgd::new(shard, cfg)?))
            })
            .unwrap();
        for _ in 0..2 {
            let loss = ps
                .iter()
                .map(|p| p.as_tensor().sqr().unwrap().sum_all().unwrap())
                .reduce(|a, b| (a + b).unwrap())
                .unwrap();
            opt.step(&loss.backward().unwrap()).unwrap();
        }
        let state = tandem::TrainingState::new(&model, &mut opt).step(2);
        tandem::save_state(&pg, &dir, &state).unwrap()
    });
    written[0].clone().expect("rank 0 names the checkpoint")
}

#[test]
fn sharded_checkpoints_inspect_and_convert_to_one_dict() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sharded_checkpoint(&tmp.path().join("run"));
    let out = tandem(&["ckpt", "inspect", s(&dir)]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("sharded checkpoint, tandem-state-1, step 2") && text.contains("3 ranks"),
        "{text}"
    );
    for r in 0..3 {
        let row = format!("rank {r}: rank-0000{r}-of-00003.pt");
        assert!(
            text.contains(&row) && text.contains("optimizer/state: entries ["),
            "{row}: {text}"
        );
    }
    // The run's `latest` file stands for the checkpoint it names.
    let latest = dir.parent().unwrap().join("latest");
    assert_eq!(stdout(&tandem(&["ckpt", "inspect", s(&latest)])), text);
    let j: serde_json::Value =
        serde_json::from_str(&stdout(&tandem(&["ckpt", "inspect", "--json", s(&dir)]))).unwrap();
    // Momentum buffers of 12 + 4 + 8 + 2 f32 elements, split over the ranks.
    let per_rank: Vec<u64> = j["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["shards"][0]["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(per_rank.iter().sum::<u64>(), 26 * 4, "{per_rank:?}");
    assert!(per_rank.iter().all(|&b| b > 0 && b < 26 * 4), "{per_rank:?}");

    // Converted: one dict with the optimizer state in torch's layout over every parameter.
    let merged = tmp.path().join("whole.pt");
    let out = tandem(&["ckpt", "convert", s(&dir), s(&merged)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = load(&merged).unwrap();
    let opt = v.get("optimizer").unwrap();
    let ids = opt.get("param_groups").unwrap().as_list().unwrap()[0].get("params").unwrap().clone();
    assert_eq!(ids, Value::List((0..4).map(Value::Int).collect()));
    let state = opt.get("state").unwrap().as_dict().unwrap();
    let keys: Vec<i64> = state.iter().map(|(k, _)| k.as_int().unwrap()).collect();
    assert_eq!(keys, [0, 1, 2, 3]);
    assert_eq!(v.get("model").unwrap().as_dict().unwrap().len(), 4);

    // A save that did not finish (no manifest) is named, not read.
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    let out = tandem(&["ckpt", "inspect", s(&dir)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("manifest.json"));
}

/// ZeRO's own sharded format of earlier versions (`tandem-zero1`, a committed fixture written
/// by `write_legacy_zero1_fixture` in tandem-optim's tests) still inspects and converts.
#[test]
fn earlier_zero_checkpoints_still_inspect_and_convert() {
    let dir = fixture("legacy-zero1");
    let out = tandem(&["ckpt", "inspect", s(&dir)]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("3 ranks, 4 parameters"), "{text}");
    for r in 0..3 {
        assert!(text.contains(&format!("rank {r}: optim-rank-0000{r}-of-00003.pt")), "{text}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let merged = tmp.path().join("optim.pt");
    let out = tandem(&["ckpt", "convert", s(&dir), s(&merged)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = load(&merged).unwrap();
    assert_eq!(v, tandem::optim::zero::consolidate_sharded(&dir).unwrap());
    assert_eq!(v.get("state").unwrap().as_dict().unwrap().len(), 4);
}

/// Hostile files at `tandem ckpt inspect` under an 8 GiB address-space limit: each ends with an
/// error (exit code below 128, never a signal or an abort) within 30 s. The expansion bombs
/// here are small files that once expanded to terabytes.
#[test]
fn hostile_files_end_in_an_error_under_an_8_gib_limit() {
    let dir = tempfile::tempdir().unwrap();
    // Legacy-format wrapper: magic, protocol 1001, sys_info, the pickle, no storages.
    let legacy = |pickle: &[u8]| {
        let mut f = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.".to_vec();
        f.extend_from_slice(b"\x80\x02M\xe9\x03.");
        f.extend_from_slice(b"\x80\x02}q\x00.");
        f.extend_from_slice(pickle);
        f.extend_from_slice(b"\x80\x02].");
        f
    };
    // 16 MiB of bytes memoized once and referenced a million times: 16 TB if expanded.
    let mut memo = b"\x80\x02B".to_vec();
    memo.extend_from_slice(&(16u32 << 20).to_le_bytes());
    memo.extend(std::iter::repeat_n(0x5Au8, 16 << 20));
    memo.extend_from_slice(b"q\x00](");
    for _ in 0..1_000_000 {
        memo.extend_from_slice(b"h\x00");
    }
    memo.extend_from_slice(b"e.");
    // x = []; 64 times x = (x, x): 2^64 values if expanded.
    let mut doubling = b"\x80\x02]".to_vec();
    for _ in 0..64 {
        doubling.extend_from_slice(b"2\x86");
    }
    doubling.push(b'.');
    // A string claiming 2^62 bytes.
    let huge_claim = b"\x80\x02\x8d\x00\x00\x00\x00\x00\x00\x00\x40.".to_vec();
    for (name, bytes) in [
        ("memo.pt", legacy(&memo)),
        ("doubling.pt", legacy(&doubling)),
        ("claim.pt", legacy(&huge_claim)),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let started = std::time::Instant::now();
        let out = output_with_deadline(
            Command::new("sh").args([
                "-c",
                "ulimit -v 8388608 && exec \"$0\" ckpt inspect \"$1\"",
                env!("CARGO_BIN_EXE_tandem"),
                s(&path),
            ]),
            Duration::from_secs(60),
        );
        let elapsed = started.elapsed();
        let code = out.status.code();
        assert!(
            code.is_some_and(|c| (1..128).contains(&c)) && elapsed < Duration::from_secs(30),
            "{name}: {:?} after {elapsed:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains(name), "{name}: names the file");
    }
}

/// `tandem ckpt convert` of torch's own state dicts keeps what `load_state_dict` reads besides
/// the tensors: the OrderedDict type and its `_metadata` (module versions), also when the
/// wrapper prefix is stripped (`module.`, as torch's consume_prefix_in_state_dict_if_present
/// renames the metadata) or added. Checked by real torch.
#[test]
fn convert_keeps_ordered_dicts_and_their_metadata_for_torch() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import collections, sys, torch
d = sys.argv[1]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
wrapped = torch.nn.DataParallel(net)
if sys.argv[2] == "write":
    torch.save(net.state_dict(), f"{d}/plain.pt")
    torch.save(wrapped.state_dict(), f"{d}/wrapped.pt")
else:
    # Adding a prefix moves every module under it (the wrapper's own root entry is not known).
    meta = net.state_dict()._metadata
    prefixed = {("module" if k == "" else "module." + k): v for k, v in meta.items()}
    for name, keys, reference in [("plain2", net.state_dict().keys(), meta),
                                  ("stripped", net.state_dict().keys(), meta),
                                  ("added", wrapped.state_dict().keys(), prefixed)]:
        sd = torch.load(f"{d}/{name}.pt", weights_only=True)
        assert type(sd) is collections.OrderedDict, (name, type(sd))
        assert dict(sd._metadata) == dict(reference), (name, sd._metadata, reference)
        assert list(sd.keys()) == list(keys), name
    net.load_state_dict(torch.load(f"{d}/stripped.pt", weights_only=True))
    wrapped.load_state_dict(torch.load(f"{d}/added.pt", weights_only=True))
    print("ok")
"#;
    let py = |stage: &str| {
        let out = output_with_deadline(
            Command::new(&python).args(["-c", script, s(dir.path()), stage]),
            Duration::from_secs(120),
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        stdout(&out)
    };
    py("write");
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    for args in [
        vec!["ckpt", "convert", &p("plain.pt"), &p("plain2.pt")],
        vec!["ckpt", "convert", &p("wrapped.pt"), &p("stripped.pt"), "--strip-prefix", "module."],
        vec!["ckpt", "convert", &p("plain.pt"), &p("added.pt"), "--add-prefix", "module."],
    ] {
        let o = tandem(&args);
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(py("check").contains("ok"));
}

/// The acceptance of PyTorch's distributed checkpoints as a user runs it: `tandem ckpt inspect`
/// and `convert` on a directory `dcp.save` wrote on 2 gloo ranks (`{"model": state_dict}` plus a
/// row-sharded DTensor) give a .pt holding every tensor bit for bit; `convert --to dcp` gives a
/// directory `dcp.load` in one torch process reads back bit for bit.
#[test]
fn dcp_directories_inspect_and_convert_both_ways() {
    let Some(python) = tandem_testutil::torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (ck, reference) = (dir.path().join("ck"), dir.path().join("ref.pt"));
    let peer = |args: &[&str]| {
        let out = output_with_deadline(
            Command::new(&python).arg(fixture("dcp_peer.py")).args(args),
            Duration::from_secs(180),
        );
        assert!(
            stdout(&out).contains("OK"),
            "dcp_peer.py {args:?}: {}{}",
            stdout(&out),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    peer(&["save", s(&ck), s(&reference), "2"]);
    let out = tandem(&["ckpt", "inspect", s(&ck)]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("dcp.save") && text.contains("model/0.weight"), "{text}");
    assert!(text.contains("sharded.w: 2 chunks in __0_0.distcp, __1_0.distcp"), "{text}");
    let pt = dir.path().join("out.pt");
    let out = tandem(&["ckpt", "convert", s(&ck), s(&pt)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (got, want) = (load(&pt).unwrap(), load(&reference).unwrap());
    let out = tandem(&["ckpt", "diff", s(&pt), s(&reference)]);
    assert!(out.status.success(), "convert of the DCP directory differs: {}", stdout(&out));
    assert_eq!(
        got.get("model")
            .and_then(|m| m.get("0.weight"))
            .and_then(Value::as_tensor)
            .map(|t| t.contiguous_bytes().into_owned()),
        want.get("model")
            .and_then(|m| m.get("0.weight"))
            .and_then(Value::as_tensor)
            .map(|t| t.contiguous_bytes().into_owned()),
    );
    let back = dir.path().join("back");
    let out = tandem(&["ckpt", "convert", s(&reference), s(&back), "--to", "dcp"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    peer(&["load", s(&back), s(&reference)]);
}

/// An `Fsdp` run's checkpoint (every parameter saved as rows by 2 ranks): `inspect` lists its
/// row shards, `convert --to dcp` writes PyTorch FSDP2's layout (`model.NAME`,
/// `optim.state.NAME.FIELD`, the param groups by name), `convert` to `.pt` the full state dict.
#[test]
fn an_fsdp_checkpoint_inspects_and_converts() {
    use candle_core::{DType, Device, Module, Tensor};
    use tandem::fsdp::{Fsdp, FsdpOptions, Units};
    use tandem::optim::{SgdConfig, TorchSgd};
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let written = tandem_testutil::run_tcp_world(2, move |pg| {
        let varmap = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let l1 = candle_nn::linear(4, 5, vb.pp("l1")).unwrap();
        let opts = FsdpOptions { units: Units::prefixes(["l1"]), ..FsdpOptions::default() };
        let fsdp = Fsdp::from_varmap(&varmap, &pg, opts).unwrap();
        let l1 = fsdp.fully_shard("l1", l1).unwrap();
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let mut opt = TorchSgd::new(fsdp.params(), cfg).unwrap();
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
        let loss = fsdp.forward(|| l1.forward(&x)?.sqr()?.mean_all()).unwrap();
        opt.step(&fsdp.backward(&loss).unwrap()).unwrap();
        let mut shards = tandem::train::FsdpShards::new(&fsdp);
        let state = tandem::TrainingState::fsdp(&mut shards, &mut opt).step(1);
        tandem::save_state(&pg, &run, &state).unwrap()
    });
    let ckpt = written[0].clone().expect("rank 0 returns the checkpoint");

    let out = tandem(&["ckpt", "inspect", s(&ckpt)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout(&out).contains("model/l1.weight"), "{}", stdout(&out));

    let dcp_dir = dir.path().join("dcp");
    let out = tandem(&["ckpt", "convert", s(&ckpt), s(&dcp_dir), "--to", "dcp"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = tandem::ckpt::dcp::load(&dcp_dir).unwrap();
    let weight = v.get("model").and_then(|m| m.get("l1.weight")).and_then(Value::as_tensor);
    assert_eq!(weight.map(|t| t.shape.clone()), Some(vec![5, 4]));
    let optim = v.get("optim").unwrap();
    let momentum =
        optim.get("state").and_then(|s| s.get("l1.weight")).and_then(|e| e.get("momentum_buffer"));
    assert_eq!(momentum.and_then(Value::as_tensor).map(|t| t.shape.clone()), Some(vec![5, 4]));
    let names = optim.get("param_groups").and_then(|g| match g {
        Value::List(groups) => groups[0].get("params").cloned(),
        _ => None,
    });
    assert_eq!(
        names,
        Some(Value::List(vec![Value::Str("l1.bias".into()), Value::Str("l1.weight".into())]))
    );

    let pt = dir.path().join("whole.pt");
    let out = tandem(&["ckpt", "convert", s(&ckpt), s(&pt)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let whole = load(&pt).unwrap();
    let bias = whole.get("model").and_then(|m| m.get("l1.bias")).and_then(Value::as_tensor);
    assert_eq!(bias.map(|t| t.shape.clone()), Some(vec![5]));
}
