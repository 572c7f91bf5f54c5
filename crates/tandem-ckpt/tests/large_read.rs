//! Files read whole (not mapped) above 4 MiB go into a huge-page anonymous mapping, read by
//! several threads in 8 MiB pieces: the bytes must be exactly the file's, whatever the piece
//! boundaries.
use tandem_ckpt::{load_with, save, LoadOptions, TensorData, Value};

fn pattern(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as f32 * 1e-9
        })
        .collect()
}

#[test]
fn a_large_file_read_whole_equals_the_mapped_load_and_what_was_saved() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.pt");
    // 20 MiB + 3 floats and a small tensor: pieces end inside tensors, the last piece is partial.
    let big = pattern((20 << 18) + 3, 7);
    let small = pattern(5, 9);
    let sd = Value::dict_from(vec![
        ("big".to_string(), Value::Tensor(TensorData::from_f32(&[big.len()], &big))),
        ("small".to_string(), Value::Tensor(TensorData::from_f32(&[5], &small))),
    ]);
    save(&path, &sd).unwrap();
    let read = load_with(&path, &LoadOptions { mmap: false, ..Default::default() }).unwrap();
    let mapped = load_with(&path, &LoadOptions::default()).unwrap();
    assert_eq!(read, mapped);
    let dict = read.as_dict().unwrap();
    let get = |k: &str| {
        dict.iter()
            .find(|(n, _)| n.as_str() == Some(k))
            .unwrap()
            .1
            .as_tensor()
            .unwrap()
            .to_f32_vec()
    };
    assert_eq!(get("big"), big);
    assert_eq!(get("small"), small);
    // Both loads keep the bytes in a mapping (the file's, or the anonymous one it was read
    // into); a tensor built in memory does not.
    let storage = |v: &Value| v.get("big").unwrap().as_tensor().unwrap().storage.is_mapped();
    assert!(storage(&read) && storage(&mapped));
    assert!(!TensorData::from_f32(&[2], &[1.0, 2.0]).storage.is_mapped());
    // Checksums over the bytes the threads read.
    let verified = LoadOptions { mmap: false, verify_checksums: true, ..Default::default() };
    assert_eq!(load_with(&path, &verified).unwrap(), read);
}
