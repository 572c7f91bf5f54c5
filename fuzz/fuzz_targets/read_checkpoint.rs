//! Feeds arbitrary bytes to tandem-ckpt's file reader (format detection, zip, legacy pickle
//! stream, safetensors) and, when something loads, to the state-dict matcher and the writer.
//! Any panic, abort, leak or runaway allocation is a bug: hostile files must give errors.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tandem_ckpt::pt::load_from_bytes;

fuzz_target!(|data: &[u8]| {
    for verify in [false, true] {
        if let Ok(v) = load_from_bytes("fuzz-input", data.to_vec(), verify) {
            let _ = tandem_ckpt::keys::load_state_dict(
                &v,
                &[("w".into(), vec![2], tandem_ckpt::ElemType::F32)],
                false,
            );
            let _ = tandem_ckpt::to_pt_bytes(&v);
        }
    }
});
