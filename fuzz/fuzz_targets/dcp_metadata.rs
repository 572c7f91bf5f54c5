//! A PyTorch distributed checkpoint's `.metadata` (DCP's pickle) and the loads it drives, with
//! a small data file beside it: any bytes give metadata or an error naming the file; records
//! never name a file outside the directory; reads of the byte ranges it names are checked
//! against the file; nothing panics or allocates what the metadata merely claims.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tandem_ckpt::dcp;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a scratch directory");
    std::fs::write(dir.path().join(dcp::METADATA_FILE), data).expect("writing the input");
    std::fs::write(dir.path().join(dcp::DATA_FILE), [0u8; 64]).expect("writing a data file");
    if let Ok(md) = dcp::read_metadata(dir.path()) {
        for r in &md.records {
            assert!(!r.stored.file.contains('/') && r.stored.file != "..", "{:?} escapes", r.stored.file);
        }
        let _ = dcp::load(dir.path());
        if let Some((fqn, _)) = md.items.first() {
            let _ = dcp::load_rows(dir.path(), &md, fqn, 0..1);
        }
    }
});
