//! A small row-sharded object for checkpoint tests: a 5 x 2 matrix with an optimizer-like entry
//! of the same rows, split evenly over the ranks (what PartialFC's head looks like in a save).
use tandem_ckpt::{TensorData, Value};

pub const CLASSES: usize = 5;

/// Rows `start..start+len` of a 5 x 2 object whose row i holds (10 i + fill, 10 i + fill + 1),
/// with an optimizer-like entry of the same rows and a step count.
pub fn rows(start: usize, len: usize, fill: f32) -> Value {
    let data: Vec<f32> = (start..start + len)
        .flat_map(|i| [10.0 * i as f32 + fill, 10.0 * i as f32 + fill + 1.0])
        .collect();
    let moment: Vec<f32> = data.iter().map(|x| -x).collect();
    Value::dict_from([
        ("weight", Value::Tensor(TensorData::from_f32(&[len, 2], &data))),
        (
            "state",
            Value::dict_from([
                ("exp_avg", Value::Tensor(TensorData::from_f32(&[len, 2], &moment))),
                ("step", Value::Tensor(TensorData::from_f32(&[], &[7.0]))),
            ]),
        ),
    ])
}

/// Rank `rank` of `world`'s even share of the 5 rows.
pub fn share(rank: usize, world: usize) -> (usize, usize) {
    let (base, extra) = (CLASSES / world, CLASSES % world);
    (base * rank + rank.min(extra), base + usize::from(rank < extra))
}

/// The `weight` tensor of a [`rows`] value, flattened.
pub fn weights(v: &Value) -> Vec<f32> {
    v.get("weight").unwrap().as_tensor().unwrap().to_f32_vec()
}
