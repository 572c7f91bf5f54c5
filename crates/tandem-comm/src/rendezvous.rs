//! Turning a rendezvous (store + rank + members) into a ready `ProcessGroup`: find which ranks
//! share a host, choose the transport (shared memory when the whole group is on one host,
//! unless TANDEM_TRANSPORT says otherwise) and connect it.
use crate::env::{self, Env, InitMethod, InitOptions, StoreHost};
use crate::error::CommError;
use crate::group::{Inner, NoPeers, ProcessGroup, State};
use crate::store::{Store, StoreServer};
use crate::transport::{shm, tcp, Transport, TransportKind};
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

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

/// Identifies a machine: hostname plus kernel boot id (containers may share a hostname).
fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", hostname(), boot.trim())
}

fn single(
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
        eprintln!(
            "[tandem rank {}] group {name}: rank {rank}/{size}, local {local_rank}/{local_size}, \
             {hosts} host(s), transport {}, address {local_ip}, timeout {:?}, desync check {}",
            world_ranks[rank],
            kind.name(),
            opts.timeout,
            if opts.desync_check { "on" } else { "off" }
        );
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

/// `host:port`, with an IPv6 host in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn is_loopback(addr: &str) -> bool {
    addr.to_socket_addrs().map(|mut a| a.all(|a| a.ip().is_loopback())).unwrap_or(false)
}

/// Initialises the world group from `method` with `opts`.
pub fn init_with(method: &InitMethod, opts: &InitOptions) -> Result<ProcessGroup, CommError> {
    if matches!(method, InitMethod::Env) {
        if let Some(store) = env::process_env(crate::live::LIVE_STORE_VAR) {
            // The launcher's store holds MASTER_PORT; a fixed world would wait for ranks that
            // the launcher restarts into a live one. Say so instead.
            return Err(CommError::env(
                crate::live::LIVE_STORE_VAR,
                &store,
                "this process was started by `tandem run --live-recovery`, whose workers join a \
                 live world: use tandem::live::LiveTraining (tandem train does), or start the \
                 job without --live-recovery",
            ));
        }
    }
    let spec = env::resolve(&Env(&env::process_env), method)?;
    let world: Vec<usize> = (0..spec.world_size).collect();
    if let StoreHost::File { path } = &spec.store {
        if spec.world_size == 1 {
            return Ok(single(opts, "w", 0, None, None));
        }
        let joined = crate::file_init::join(path, spec.rank, opts)?;
        let world = finish_world(joined.store, joined.server, &spec, world, &joined.opts);
        if let Some(file) = joined.owned_file {
            // Every rank has joined (or the world failed): nobody needs the file again.
            let _ = std::fs::remove_file(file);
        }
        return world;
    }
    let Some((host, port, var)) = spec.master.clone() else {
        return Ok(single(opts, "w", spec.rank, None, None));
    };
    if spec.world_size == 1 {
        return Ok(single(opts, "w", 0, None, None));
    }
    let addr = host_port(&host, port);
    if let StoreHost::TorchAgent { run_id } = &spec.store {
        let via = format!("{var} (torchrun's agent store)");
        let agent = Store::connect_torch(&addr, opts.init_timeout, &via)?;
        // torch's agent store cannot check a secret; tandem's own mesh and shared memory can.
        let store =
            crate::agent_store::join_generation(&agent, run_id, spec.rank, spec.world_size)?
                .with_secret(opts.secret.clone());
        return finish_world(store, None, &spec, world, opts);
    }
    let server = if spec.rank == 0 {
        let bind = if is_loopback(&addr) {
            host_port("127.0.0.1", port)
        } else {
            host_port("0.0.0.0", port)
        };
        let server = StoreServer::bind(&bind, &opts.run_id, opts.secret.as_ref()).map_err(|e| {
            CommError::env(
                "MASTER_PORT",
                &port.to_string(),
                format!("rank 0 cannot host the store on {bind}: {e}"),
            )
        })?;
        Some(Arc::new(server))
    } else {
        None
    };
    let store = Store::connect(&addr, &opts.run_id, opts.secret.as_ref(), opts.init_timeout, &var)?;
    finish_world(store, server, &spec, world, opts)
}

/// The world group over a connected store: rendezvous, transports, hierarchy.
fn finish_world(
    store: Store,
    server: Option<Arc<StoreServer>>,
    spec: &env::Spec,
    world: Vec<usize>,
    opts: &InitOptions,
) -> Result<ProcessGroup, CommError> {
    let local_ip = match &opts.socket_ifname {
        Some(name) => crate::net::interface_ip(name)?,
        None => store.local_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    };
    let world = build_group(
        Some(store),
        server,
        "w",
        spec.rank,
        world,
        opts,
        local_ip,
        (spec.local_rank, spec.local_size),
    )?;
    if opts.transport != Some(TransportKind::Mpi) {
        // MPI arranges its own intra- and inter-host stages.
        crate::hierarchy::setup(&world, opts.hierarchical)?;
    }
    Ok(world)
}
