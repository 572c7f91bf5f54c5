//! A RecordIO identity set (`train.idx` + `train.rec`, as arcface_torch's MXFaceDataset reads
//! it): the input's first two bytes say how long the index text is, the rest is the record
//! file. Opening and reading the first records must give data or errors, never a panic or an
//! allocation sized by a hostile header.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tandem_data::Dataset;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let idx_len = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (idx, rec) = data[2..].split_at(idx_len);
    let dir = tempfile::tempdir().expect("a scratch directory");
    std::fs::write(dir.path().join("train.idx"), idx).expect("writing the index");
    std::fs::write(dir.path().join("train.rec"), rec).expect("writing the records");
    if let Ok(ds) = tandem_data::datasets::faces::FaceRecDataset::open(dir.path()) {
        for i in 0..ds.len().min(4) {
            let _ = ds.get(i);
            let _ = ds.label(i);
        }
    }
});
