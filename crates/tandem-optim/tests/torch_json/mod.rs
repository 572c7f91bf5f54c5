//! The optimizer/scheduler fixtures of `tests/fixtures/optim/make_fixtures.py` (torch 2.15): loading
//! a JSON file and rebuilding checkpoint values from its encoding (`__dict__` with any keys,
//! `__tuple__`, `__tensor__`), shared by the optimizer and scheduler tests.
#![allow(dead_code)]
use serde_json::Value as Json;
use tandem_ckpt::Value;

/// `tests/fixtures/optim/<name>`, parsed.
pub fn fixture(name: &str) -> Json {
    let path = format!("{}/tests/fixtures/optim/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}")),
    )
    .unwrap_or_else(|e| panic!("parse {path}: {e}"))
}

/// Rebuilds a checkpoint value from make_fixtures.py's JSON encoding.
pub fn decode(j: &Json) -> Value {
    match j {
        Json::Null => Value::None,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) if n.is_i64() => Value::Int(n.as_i64().unwrap()),
        Json::Number(n) => Value::Float(n.as_f64().unwrap()),
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(a) => Value::List(a.iter().map(decode).collect()),
        Json::Object(o) => {
            if let Some(t) = o.get("__tensor__") {
                let shape: Vec<usize> = t["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as usize)
                    .collect();
                let data: Vec<f64> =
                    t["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                match t["dtype"].as_str().unwrap() {
                    "float32" => Value::Tensor(tandem_ckpt::TensorData::from_f32(
                        &shape,
                        &data.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                    )),
                    other => panic!("fixture dtype {other} not expected"),
                }
            } else if let Some(items) = o.get("__dict__") {
                Value::Dict(
                    items
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|kv| (decode(&kv[0]), decode(&kv[1])))
                        .collect(),
                )
            } else if let Some(items) = o.get("__tuple__") {
                Value::Tuple(items.as_array().unwrap().iter().map(decode).collect())
            } else {
                panic!("unknown encoded object {o:?}")
            }
        }
    }
}
