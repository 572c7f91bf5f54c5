//! A sharded checkpoint's `manifest.json` (today's `tandem-state-1` or the face recipe's
//! earlier `tandem-partial-fc-1`) and the shard readers it drives, with no rank files present:
//! any bytes give a checkpoint or an error naming the file, a manifest never names a file
//! outside its directory, and no read panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tandem_train::checkpoint::{Saved, ShardSlice, MANIFEST};

fuzz_target!(|data: &[u8]| {
    tandem_recipes::face::register_checkpoint_formats();
    let dir = tempfile::tempdir().expect("a scratch directory");
    std::fs::write(dir.path().join(MANIFEST), data).expect("writing the input");
    if let Ok(saved) = Saved::open(dir.path()) {
        let m = saved.manifest().expect("a directory has a manifest");
        for r in &m.ranks {
            assert!(!r.file.contains('/') && r.file != "..", "{:?} escapes", r.file);
        }
        for name in saved.shard_names() {
            match saved.slices(name).and_then(|s| s.first().cloned().cloned()) {
                Some(ShardSlice::Rows { total, .. }) => {
                    let _ = saved.read_rows(name, 0..total.min(8));
                }
                Some(ShardSlice::Entries { .. }) => {
                    let _ = saved.read_entries(name, Some(&[0, 1]));
                }
                _ => {
                    let _ = saved.read_rank(name, 0);
                }
            }
        }
    }
});
