//! The collective mesh's handshake, server side (what a connecting peer sends, then its
//! answer to the challenge); the first byte picks a job with or without a secret.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((&mode, rest)) = data.split_first() {
        tandem_comm::fuzz_mesh_hello(rest, mode & 1 == 1);
    }
});
