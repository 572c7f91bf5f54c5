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
