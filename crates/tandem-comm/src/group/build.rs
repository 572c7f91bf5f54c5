//! Turning a rendezvous (store + rank + members) into a ready `ProcessGroup`: find which ranks
//! share a host, choose the transport (shared memory when the whole group is on one host,
//! unless TANDEM_TRANSPORT says otherwise) and connect it. The world's, a subgroup's and a live
//! generation's groups are all built here.
use super::{Inner, NoPeers, ProcessGroup, State};
use crate::env::{self, InitOptions};
use crate::error::CommError;
use crate::store::{Store, StoreServer};
use crate::transport::{shm, tcp, Transport, TransportKind};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// Identifies a machine: hostname plus kernel boot id (containers may share a hostname).
fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", crate::net::hostname(), boot.trim())
}

pub(crate) fn single(
    opts: &InitOptions,
    name: &str,
    world_rank: usize,
    store: Option<Store>,
    server: Option<Arc<StoreServer>>,
) -> ProcessGroup {
    ProcessGroup::from_inner(Inner {
        rank: 0,
        size: 1,
        local_rank: 0,
        local_size: 1,
        world_ranks: vec![world_rank],
        name: name.to_string(),
        store,
        opts: opts.clone(),
        kind: None,
        local_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        timeout_ms: AtomicU64::new(opts.timeout.as_millis() as u64),
        subgroups: AtomicU64::new(0),
        children: Default::default(),
        hosts: vec![0],
        hierarchy: Default::default(),
        order: Default::default(),
        state: Mutex::new(State {
            seq: 0,
            transport: Box::new(NoPeers),
            p2p_sent: vec![0],
            p2p_recvd: vec![0],
        }),
        _server: server,
        #[cfg(feature = "nccl")]
        nccl: Default::default(),
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn build_group(
    store: Option<Store>,
    server: Option<Arc<StoreServer>>,
    name: &str,
    rank: usize,
    world_ranks: Vec<usize>,
    opts: &InitOptions,
    local_ip: IpAddr,
    env_local: (Option<usize>, Option<usize>),
) -> Result<ProcessGroup, CommError> {
    let size = world_ranks.len();
    let store = match store {
        Some(s) if size > 1 => s,
        s => return Ok(single(opts, name, world_ranks.first().copied().unwrap_or(0), s, server)),
    };
    let keys: Vec<String> = (0..size).map(|r| format!("{name}/host/{r}")).collect();
    // Each rank publishes "<group size> <host id>": a rank that disagrees on the size is
    // reported instead of leaving the others waiting.
    store.set(&keys[rank], format!("{size} {}", host_id()).as_bytes())?;
    let key_refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    store.wait_timeout(&key_refs, opts.init_timeout).map_err(|e| match e {
        CommError::StoreTimeout { key, after, .. } => CommError::rendezvous(
            name,
            format!("ranks did not join within {after:?} (missing keys {key}; world size here is {size})"),
        ),
        e => e,
    })?;
    let mut hosts = Vec::with_capacity(size);
    for (r, v) in store.multi_get(&key_refs)?.iter().enumerate() {
        let v = String::from_utf8_lossy(v).to_string();
        let (their_size, host) = v.split_once(' ').unwrap_or(("?", &v));
        if their_size != size.to_string() {
            return Err(CommError::rendezvous(
                name,
                format!(
                    "rank {r} was started with world size {their_size} but rank {rank} with {size}"
                ),
            ));
        }
        hosts.push(host.to_string());
    }
    let same_host: Vec<usize> = (0..size).filter(|&r| hosts[r] == hosts[rank]).collect();
    let host_indices: Vec<usize> = {
        let mut seen: Vec<&String> = Vec::new();
        hosts
            .iter()
            .map(|h| match seen.iter().position(|s| *s == h) {
                Some(i) => i,
                None => {
                    seen.push(h);
                    seen.len() - 1
                }
            })
            .collect()
    };
    let local_rank =
        env_local.0.unwrap_or_else(|| same_host.iter().position(|&r| r == rank).unwrap_or(0));
    let local_size = env_local.1.unwrap_or(same_host.len());
    let all_local = same_host.len() == size;

    let mesh = || -> Result<Box<dyn Transport>, CommError> {
        Ok(Box::new(tcp::connect_mesh(
            &store,
            name,
            rank,
            size,
            &opts.run_id,
            local_ip,
            opts.init_timeout,
        )?))
    };
    let (transport, kind): (Box<dyn Transport>, TransportKind) = match opts.transport {
        Some(TransportKind::Tcp) => (mesh()?, TransportKind::Tcp),
        Some(TransportKind::Shm) => {
            if !all_local {
                return Err(CommError::rendezvous(
                    name,
                    "TANDEM_TRANSPORT=shm but the ranks are on different hosts",
                ));
            }
            match shm::setup(&store, name, rank, size, &opts.run_id, opts.init_timeout)? {
                Ok(t) => (Box::new(t), TransportKind::Shm),
                Err(why) => {
                    return Err(CommError::rendezvous(name, format!("TANDEM_TRANSPORT=shm: {why}")))
                }
            }
        }
        None if all_local => {
            match shm::setup(&store, name, rank, size, &opts.run_id, opts.init_timeout)? {
                Ok(t) => (Box::new(t), TransportKind::Shm),
                Err(why) => {
                    tracing::info!("group {name}: shared memory unavailable ({why}); using tcp");
                    (mesh()?, TransportKind::Tcp)
                }
            }
        }
        None => (mesh()?, TransportKind::Tcp),
        Some(TransportKind::Mpi) => (mpi_transport(name, rank, &world_ranks)?, TransportKind::Mpi),
    };
    if opts.debug >= env::DebugLevel::Info {
        // Asked for by TORCH_DISTRIBUTED_DEBUG / TANDEM_DEBUG: the set-up PyTorch logs at INFO.
        let hosts = host_indices.iter().max().map_or(1, |m| m + 1);
        crate::diagnostics::debug_line(&format!(
            "[tandem rank {}] group {name}: rank {rank}/{size}, local {local_rank}/{local_size}, \
             {hosts} host(s), transport {}, address {local_ip}, timeout {:?}, desync check {}",
            world_ranks[rank],
            kind.name(),
            opts.timeout,
            if opts.desync_check { "on" } else { "off" }
        ));
    }
    Ok(ProcessGroup::from_inner(Inner {
        rank,
        size,
        local_rank,
        local_size,
        world_ranks,
        name: name.to_string(),
        store: Some(store),
        opts: opts.clone(),
        kind: Some(kind),
        local_ip,
        timeout_ms: AtomicU64::new(opts.timeout.as_millis() as u64),
        subgroups: AtomicU64::new(0),
        children: Default::default(),
        hosts: host_indices,
        hierarchy: Default::default(),
        order: Default::default(),
        state: Mutex::new(State {
            seq: 0,
            transport,
            p2p_sent: vec![0; size],
            p2p_recvd: vec![0; size],
        }),
        _server: server,
        #[cfg(feature = "nccl")]
        nccl: Default::default(),
    }))
}

#[cfg(feature = "mpi")]
fn mpi_transport(
    name: &str,
    rank: usize,
    world_ranks: &[usize],
) -> Result<Box<dyn Transport>, CommError> {
    let t = crate::transport::mpi::connect(name, rank, world_ranks)
        .map_err(|why| CommError::rendezvous(name, format!("TANDEM_TRANSPORT=mpi: {why}")))?;
    Ok(Box::new(t))
}

#[cfg(not(feature = "mpi"))]
fn mpi_transport(
    name: &str,
    _rank: usize,
    _world_ranks: &[usize],
) -> Result<Box<dyn Transport>, CommError> {
    Err(CommError::rendezvous(
        name,
        "TANDEM_TRANSPORT=mpi: this build has no MPI support (rebuild with `--features mpi`; \
         it needs an MPI library, e.g. Debian's libopenmpi-dev)",
    ))
}
