//! `tandem train --config FILE.py`: arcface_torch's Python configs read as data (assignments
//! of literals and arithmetic over earlier keys), merged over base.py and mapped onto the
//! recipes' settings. Any bytes give settings or an error naming the file and line, never a
//! panic (deep nesting, huge numbers, overflowing arithmetic and division by zero included).
#![no_main]
use libfuzzer_sys::fuzz_target;
use tandem_recipes::face::config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = std::path::Path::new("configs/fuzz.py");
    if let Ok(read) = config::parse(path, text) {
        let merged = config::with_base(path, read);
        let _ = config::to_settings(path, &merged);
    }
});
