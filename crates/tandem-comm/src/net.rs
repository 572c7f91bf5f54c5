//! This host on the network: its name, `host:port` spelling, and which local address a rank
//! uses: the interface TANDEM_SOCKET_IFNAME (or gloo's GLOO_SOCKET_IFNAME) names, for hosts
//! with several networks; otherwise the caller's default (the address this host reaches the
//! store from, or for a `file://` rank 0, its hostname's).
use crate::error::CommError;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};

/// The address of interface `name` on this host (IPv4 first); an error listing the interfaces
/// there are when it has none.
pub(crate) fn interface_ip(name: &str) -> Result<IpAddr, CommError> {
    let all = if_addrs::get_if_addrs().map_err(|e| {
        CommError::env(
            "TANDEM_SOCKET_IFNAME",
            name,
            format!("cannot list this host's interfaces: {e}"),
        )
    })?;
    let mine: Vec<IpAddr> = all.iter().filter(|i| i.name == name).map(|i| i.ip()).collect();
    if let Some(ip) = mine.iter().find(|ip| ip.is_ipv4()).or(mine.first()) {
        return Ok(*ip);
    }
    let mut names: Vec<&str> = all.iter().map(|i| i.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    Err(CommError::env(
        "TANDEM_SOCKET_IFNAME",
        name,
        format!(
            "host {} has no interface {name:?} with an address (it has {})",
            hostname(),
            names.join(", ")
        ),
    ))
}

/// The address other hosts can reach this one at when nothing else says: the interface named
/// by `ifname`, else what this host's name resolves to (not loopback), else loopback (every
/// rank on this host).
pub(crate) fn advertised_ip(ifname: Option<&str>) -> Result<IpAddr, CommError> {
    if let Some(name) = ifname {
        return interface_ip(name);
    }
    let resolved = (hostname().as_str(), 0)
        .to_socket_addrs()
        .map(|addrs| addrs.map(|a| a.ip()).filter(|ip| !ip.is_loopback()).collect::<Vec<_>>())
        .unwrap_or_default();
    Ok(resolved
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(resolved.first())
        .copied()
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// This machine's hostname ("unknown-host" when it cannot be read).
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).to_string()
    } else {
        "unknown-host".to_string()
    }
}

/// `host:port`, with an IPv6 host in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_by_name_and_a_missing_interface_lists_the_others() {
        assert_eq!(interface_ip("lo").unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        let e = interface_ip("nosuch9").unwrap_err().to_string();
        assert!(e.contains("TANDEM_SOCKET_IFNAME=\"nosuch9\"") && e.contains("lo"), "{e}");
    }
}
