//! Choosing MASTER_PORT when the user did not (single node, `--standalone`).
//!
//! The port is bound later by rank 0's store, in another process, so there is a window between
//! our check and that bind. Two things keep it harmless:
//! - the port is drawn at random from *below* the kernel's ephemeral range
//!   (`/proc/sys/net/ipv4/ip_local_port_range`). Ports handed out by `bind(:0)` and by outgoing
//!   connections come from that range, so nothing grabs ours by accident; only a process that
//!   names the very same number could;
//! - if that happens anyway, rank 0 fails with "Address already in use": the supervisor spots
//!   that text in the workers' stderr and starts the attempt again on a new port, without
//!   spending one of `--max-restarts` (see `supervisor.rs`).
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, TcpListener};

/// Lowest port we draw from; below are many fixed-port services.
const DRAW_FLOOR: u16 = 15000;

fn ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|s| s.parse::<u16>().ok());
    Some((it.next()??, it.next()??))
}

fn random_u64() -> u64 {
    // RandomState is seeded from the OS per instance: enough to spread concurrent launchers.
    let mut h = RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

fn is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok()
}

/// A port that is free now and unlikely to be taken before rank 0 binds it.
pub fn pick_master_port() -> std::io::Result<u16> {
    if let Some((lo, _)) = ephemeral_range() {
        if lo > DRAW_FLOOR + 100 {
            let span = u64::from(lo - DRAW_FLOOR);
            for _ in 0..64 {
                let port = DRAW_FLOOR + (random_u64() % span) as u16;
                if is_free(port) {
                    return Ok(port);
                }
            }
        }
    }
    // No usable range below the ephemeral one: let the kernel choose.
    Ok(TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))?.local_addr()?.port())
}

/// Whether a worker's stderr says a bind failed because the address was taken (the text of
/// `EADDRINUSE` as Rust's `io::Error` prints it, in Display or Debug form).
pub fn mentions_addr_in_use(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    lower.contains("address already in use") || lower.contains("addrinuse")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picked_port_is_bindable_and_outside_ephemeral_range() {
        let port = pick_master_port().unwrap();
        assert!(port > 0);
        if let Some((lo, hi)) = ephemeral_range() {
            if lo > DRAW_FLOOR + 100 {
                assert!(!(lo..=hi).contains(&port), "{port} is in the ephemeral range {lo}-{hi}");
            }
        }
        TcpListener::bind(("127.0.0.1", port)).expect("picked port should be free");
    }

    #[test]
    fn recognises_addr_in_use_messages() {
        let err = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        assert!(mentions_addr_in_use(&format!("{err:?}")));
        let real = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = real.local_addr().unwrap().port();
        let again = TcpListener::bind(("127.0.0.1", port)).unwrap_err();
        assert!(mentions_addr_in_use(&format!("store: cannot bind: {again}")), "{again}");
        assert!(!mentions_addr_in_use("connection refused"));
    }
}
