//! `tandem train --config FILE.py`: arcface_torch's Python configs read as data (assignments
//! of literals and arithmetic over earlier keys), merged over base.py and mapped onto the
//! flags. Any bytes give settings or an error naming the file and line, never a panic (deep
//! nesting, huge numbers, overflowing arithmetic and division by zero included). The module is
//! the CLI's own source, included here.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../crates/tandem-cli/src/train/arcface_config.rs"]
mod arcface_config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = std::path::Path::new("configs/fuzz.py");
    if let Ok(read) = arcface_config::parse(path, text) {
        let merged = arcface_config::with_base(path, read);
        let _ = arcface_config::to_flags(path, &merged);
    }
});
