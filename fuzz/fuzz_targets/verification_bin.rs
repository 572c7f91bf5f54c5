//! insightface `.bin` verification sets (a pickle of image bytes and pair labels): any bytes
//! load or give an error naming the file; a set that loads decodes its images or errs.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let path = dir.path().join("pairs.bin");
    std::fs::write(&path, data).expect("writing the input");
    if let Ok(set) = tandem_data::datasets::faces::VerificationSet::load(&path) {
        for i in 0..set.pairs().saturating_mul(2).min(4) {
            let _ = set.image(i, 16);
        }
    }
});
