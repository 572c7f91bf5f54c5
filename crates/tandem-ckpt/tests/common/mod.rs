//! Shared helpers for tandem-ckpt's integration tests.
#![allow(dead_code)]
use std::path::PathBuf;

use serde_json::{json, Value as J};
use tandem_ckpt::Value;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The same description of a value tree that tests/fixtures/make_fixtures.py writes, with floats
/// normalised to Rust's `{:?}` text so the two sides compare exactly.
pub fn describe(v: &Value) -> J {
    match v {
        Value::None => J::Null,
        Value::Bool(b) => json!(b),
        Value::Int(i) => json!(i),
        Value::Float(f) => json!({ "float": format!("{f:?}") }),
        Value::Str(s) => json!(s),
        Value::Bytes(b) => json!({ "bytes": b }),
        Value::List(items) => json!({ "list": items.iter().map(describe).collect::<Vec<_>>() }),
        Value::Tuple(items) => json!({ "tuple": items.iter().map(describe).collect::<Vec<_>>() }),
        // Read by default as plain dicts; the test helpers compare them as such.
        Value::Dict(items) | Value::OrderedDict { items, .. } => {
            json!({ "dict": items.iter().map(|(k, v)| json!([describe(k), describe(v)])).collect::<Vec<_>>() })
        }
        Value::Tensor(t) => json!({
            "tensor": t.dtype.torch_name(),
            "shape": t.shape,
            "stride": t.stride,
            "offset": t.storage_offset,
            "values": t.to_f64_vec(),
        }),
    }
}

/// Rewrites python's `{"float": repr}` into Rust's `{:?}` form, and JSON numbers in `values`
/// into f64 so integer-valued floats compare equal.
pub fn normalise(j: &J) -> J {
    match j {
        J::Object(m) if m.contains_key("float") => {
            let s = m["float"].as_str().expect("float repr");
            let f: f64 = s.parse().expect("python float repr parses");
            json!({ "float": format!("{f:?}") })
        }
        J::Object(m) if m.contains_key("values") => {
            let mut m = m.clone();
            let vals: Vec<f64> = m["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|x| match x.as_str() {
                    Some(s) => s.parse().expect("float repr parses"),
                    None => x.as_f64().expect("number"),
                })
                .collect();
            m.insert("values".into(), json!(vals));
            J::Object(m)
        }
        J::Object(m) => J::Object(m.iter().map(|(k, v)| (k.clone(), normalise(v))).collect()),
        J::Array(a) => J::Array(a.iter().map(normalise).collect()),
        other => other.clone(),
    }
}

pub fn expected(name: &str) -> J {
    let text = std::fs::read_to_string(fixture("expected.json")).expect("expected.json");
    let all: J = serde_json::from_str(&text).expect("expected.json parses");
    normalise(&all[name])
}
