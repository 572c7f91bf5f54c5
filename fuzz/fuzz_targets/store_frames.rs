//! The store server's side of one connection: the input is everything a client sends (the
//! handshake, then requests, as frames); the first byte picks a job with or without a secret.
//! Any bytes must give refusals or answers, never a panic, a hang or a runaway allocation.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((&mode, rest)) = data.split_first() {
        tandem_comm::fuzz_store_session(rest, mode & 1 == 1);
    }
});
