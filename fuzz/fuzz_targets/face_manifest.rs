//! A face checkpoint's `manifest.json` (and the head-row reader it drives, with no head files
//! present): any bytes give a manifest or an error naming the file, and a manifest never names
//! a file outside its directory.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tandem_train::face::checkpoint::{read_head_rows, read_manifest, MANIFEST};

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a scratch directory");
    std::fs::write(dir.path().join(MANIFEST), data).expect("writing the input");
    if let Ok(m) = read_manifest(dir.path()) {
        for h in &m.heads {
            assert!(!h.file.contains('/') && h.file != "..", "{:?} escapes", h.file);
        }
        let split = tandem::partial_fc::ClassSplit::new(m.num_classes.min(8), 1, 0);
        let _ = read_head_rows(dir.path(), &m, split, 0);
    }
});
