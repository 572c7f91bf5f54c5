//! `tandem data synth-faces`: the files it writes are insightface's formats as Python reads
//! them (a stdlib-only reader of MXNet's indexed RecordIO, IRHeader and pickle, written apart
//! from tandem's), and bad flags fail with a message naming them.
use std::process::Command;
use std::time::Duration;

fn tandem(args: &[&str]) -> std::process::Output {
    tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem")).arg("data").args(args),
        Duration::from_secs(120),
    )
}

/// Reads DIR the way mxnet's MXIndexedRecordIO + recordio.unpack and pickle.load would, and
/// prints what it found as JSON.
const READER: &str = r#"
import json, pickle, struct, sys
d = sys.argv[1]
offsets = {}
for line in open(d + "/train.idx"):
    k, o = line.split("\t"); offsets[int(k)] = int(o)
rec = open(d + "/train.rec", "rb").read()
def read(off):
    out = b""
    while True:
        magic, word = struct.unpack("<II", rec[off:off + 8])
        assert magic == 0xCED7230A, hex(magic)
        flag, n = word >> 29, word & ((1 << 29) - 1)
        out += rec[off + 8:off + 8 + n]
        off += 8 + (n + 3) // 4 * 4
        if flag in (0, 3):
            return out
        out += struct.pack("<I", 0xCED7230A)
def unpack(s):
    flag, label, i, i2 = struct.unpack("<IfQQ", s[:24])
    if flag > 0:
        return list(struct.unpack("<%df" % flag, s[24:24 + 4 * flag])), s[24 + 4 * flag:]
    return label, s[24:]
h0, _ = unpack(read(offsets[0]))
labels, sizes = [], []
for k in range(1, int(h0[0])):
    label, img = unpack(read(offsets[k]))
    labels.append(label)
    assert img[:8] == b"\x89PNG\r\n\x1a\n"
    sizes.append(list(struct.unpack(">II", img[16:24])))
ids = [unpack(read(offsets[k]))[0] for k in range(int(h0[0]), int(h0[1]))]
bins, issame = pickle.load(open(d + "/pairs.bin", "rb"))
print(json.dumps({"header0": h0, "labels": labels, "sizes": sizes, "identities": ids,
                  "pairs": len(issame), "images": len(bins), "same": sum(issame)}))
"#;

#[test]
fn synthetic_faces_read_back_in_python_as_insightface_sets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("faces");
    let p = path.to_str().unwrap();
    let out = tandem(&[
        "synth-faces",
        p,
        "--classes",
        "3",
        "--per-class",
        "2",
        "--format",
        "png",
        "--pairs",
        "6",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.contains("6 images of 3 identities (112x112, png), 6 verification pairs"),
        "{line}"
    );
    let Some(python) = tandem_testutil::torch_python() else { return };
    let out = tandem_testutil::output_with_deadline(
        Command::new(python).args(["-c", READER, p]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["header0"], serde_json::json!([7.0, 10.0]), "images 1..7, identities 7..10");
    assert_eq!(v["labels"], serde_json::json!([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]));
    assert_eq!(v["sizes"], serde_json::json!(vec![[112, 112]; 6]));
    assert_eq!(v["identities"], serde_json::json!([[1.0, 3.0], [3.0, 5.0], [5.0, 7.0]]));
    assert_eq!(
        (v["pairs"].as_u64(), v["images"].as_u64(), v["same"].as_u64()),
        (Some(6), Some(12), Some(3))
    );
}

#[test]
fn bad_flags_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().to_str().unwrap();
    for (args, needle) in [
        (vec!["synth-faces", p, "--classes", "1", "--per-class", "2"], "--classes 1"),
        (vec!["synth-faces", p, "--classes", "3", "--per-class", "0"], "--per-class 0"),
        (vec!["synth-faces", p, "--classes", "3", "--per-class", "2", "--format", "gif"], "'gif'"),
    ] {
        let out = tandem(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Reads DIR with real mxnet as arcface_torch's `MXFaceDataset` does (MXIndexedRecordIO; the
/// image range from record 0's header when it has one, else every key of the index, as for
/// im2rec's output; `recordio.unpack`, `mx.image.imdecode`) and prints, per image, its label,
/// shape and pixel sum as JSON.
const MXNET_READER: &str = r#"
import json, sys, numbers
import numpy as np, mxnet as mx
d = sys.argv[1]
rec = mx.recordio.MXIndexedRecordIO(d + "/train.idx", d + "/train.rec", "r")
header, _ = mx.recordio.unpack(rec.read_idx(0))
if header.flag > 0:
    header0 = [float(header.label[0]), float(header.label[1])]
    keys = list(range(1, int(header.label[0])))
else:
    header0, keys = None, list(rec.keys)
out = {"header0": header0, "keys": keys, "images": []}
for i in keys:
    h, img = mx.recordio.unpack(rec.read_idx(i))
    label = h.label if isinstance(h.label, numbers.Number) else h.label[0]
    a = mx.image.imdecode(img).asnumpy()
    out["images"].append([float(label), list(a.shape), int(a.astype(np.int64).sum())])
print(json.dumps(out))
"#;

/// A Python with mxnet: `TANDEM_MXNET_PYTHON` (CI makes one: mxnet 1.9 needs Python <= 3.10).
/// Without it the test says it was skipped, or fails under `TANDEM_REQUIRE_MXNET=1`.
fn mxnet_python() -> Option<std::path::PathBuf> {
    let python = std::env::var_os("TANDEM_MXNET_PYTHON").map(std::path::PathBuf::from);
    let works = python.as_ref().is_some_and(|p| {
        Command::new(p).args(["-c", "import mxnet"]).output().is_ok_and(|o| o.status.success())
    });
    if works {
        return python;
    }
    let why = format!("no Python with mxnet (TANDEM_MXNET_PYTHON={python:?})");
    assert!(std::env::var("TANDEM_REQUIRE_MXNET").as_deref() != Ok("1"), "{why}");
    eprintln!("SKIPPED a_packed_folder_reads_in_real_mxnet: {why}");
    None
}

/// `tandem data pack DIR OUT` writes what mxnet itself reads as arcface_torch reads it: im2rec's
/// layout (no header record, keys 0..N from train.lst), every image's label (one per identity
/// folder, in name order) and its pixels, equal to tandem's own decode (PNG: lossless, so
/// exactly).
#[test]
fn a_packed_folder_reads_in_real_mxnet_as_arcface_torch_reads_it() {
    use tandem::data::recordio::{IndexedRecordReader, IrHeader};
    let dir = tempfile::tempdir().unwrap();
    let synth = dir.path().join("synth");
    let s = synth.to_str().unwrap();
    let args = ["synth-faces", s, "--classes", "3", "--per-class", "2", "--format", "png"];
    let out = tandem(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let open = |d: &std::path::Path| {
        IndexedRecordReader::open(&d.join("train.idx"), &d.join("train.rec")).unwrap()
    };
    let folder = dir.path().join("folder");
    let reader = open(&synth);
    for key in 1..=6u64 {
        let record = reader.read(key).unwrap();
        let (h, payload) = IrHeader::unpack(&record).unwrap();
        let id = folder.join(format!("person_{}", h.label as usize));
        std::fs::create_dir_all(&id).unwrap();
        std::fs::write(id.join(format!("{key}.png")), payload).unwrap();
    }
    let packed = dir.path().join("packed");
    let out = tandem(&["pack", folder.to_str().unwrap(), packed.to_str().unwrap(), "--quiet"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // tandem's own view of the packed records: label and pixel sum.
    let reader = open(&packed);
    let expected: Vec<serde_json::Value> = (0..6u64)
        .map(|key| {
            let record = reader.read(key).unwrap();
            let (h, payload) = IrHeader::unpack(&record).unwrap();
            let pixels = tandem::data::datasets::faces::decode_face(payload, 112, false).unwrap();
            let sum: i64 = pixels.iter().map(|v| ((v * 0.5 + 0.5) * 255.0).round() as i64).sum();
            serde_json::json!([h.label as f64, [112, 112, 3], sum])
        })
        .collect();
    let Some(python) = mxnet_python() else { return };
    let out = tandem_testutil::output_with_deadline(
        Command::new(python).args(["-c", MXNET_READER, packed.to_str().unwrap()]),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["header0"], serde_json::Value::Null, "im2rec writes no header record");
    assert_eq!(v["keys"], serde_json::json!([0, 1, 2, 3, 4, 5]));
    assert_eq!(v["images"], serde_json::Value::Array(expected));
    let labels: Vec<f64> =
        v["images"].as_array().unwrap().iter().map(|i| i[0].as_f64().unwrap()).collect();
    assert_eq!(labels, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
}
