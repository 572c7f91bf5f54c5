//! The head's entry of the face recipe's optimizer state: the backbone's state is replicated,
//! the head's (momentum or Adam moments of its class rows) is sharded with the rows, so a
//! torch-layout state dict over both parameter groups is split in two for a save and merged
//! back on load.
use tandem_ckpt::Value;

/// Splits a two-group optimizer state dict (torch layout) into the state without parameter
/// `head` and that parameter's entry (`Value::None` when it has none yet).
/// Takes `full` by value: the head's entry (1 GiB of momentum at the seed's size) moves out
/// instead of being copied.
pub fn split_optimizer(full: Value, head: i64) -> (Value, Value) {
    let mut rest = full;
    let mut entry = Value::None;
    if let Some(Value::Dict(items)) = rest.get_mut("state") {
        if let Some(i) = items.iter().position(|(k, _)| k.as_int() == Some(head)) {
            entry = items.remove(i).1;
        }
    }
    (rest, entry)
}

/// [`split_optimizer`] undone: `entry` back under index `head`.
pub fn merge_optimizer(rest: &Value, head: i64, entry: Value) -> Value {
    let mut full = rest.clone();
    if !matches!(entry, Value::None) {
        if let Some(Value::Dict(items)) = full.get_mut("state") {
            items.push((Value::Int(head), entry));
        }
    }
    full
}

#[cfg(test)]
mod tests {
    use tandem_ckpt::TensorData;

    use super::*;

    fn rows(n: usize, from: f32) -> TensorData {
        let data: Vec<f32> = (0..n * 2).map(|i| from + i as f32).collect();
        TensorData::from_f32(&[n, 2], &data)
    }

    #[test]
    fn optimizer_state_splits_and_merges_without_loss() {
        let state = Value::Dict(vec![
            (Value::Int(0), Value::dict_from([("momentum_buffer", Value::Tensor(rows(1, 0.0)))])),
            (Value::Int(3), Value::dict_from([("momentum_buffer", Value::Tensor(rows(2, 9.0)))])),
        ]);
        let full = Value::dict_from([("state", state), ("param_groups", Value::List(vec![]))]);
        let (rest, entry) = split_optimizer(full.clone(), 3);
        assert_eq!(rest.get("state").unwrap().as_dict().unwrap().len(), 1);
        assert!(entry.get("momentum_buffer").is_some());
        let back = merge_optimizer(&rest, 3, entry);
        assert_eq!(back, full);
    }
}
