//! The world group from the environment: which init method (env vars, a store, a shared file,
//! torchrun's agent store, a live job's), where the store is, then `group::build` connects it.
use crate::env::{self, Env, InitMethod, InitOptions, StoreHost};
use crate::error::CommError;
use crate::group::build::{build_group, single};
use crate::group::ProcessGroup;
use crate::net::host_port;
use crate::store::{Store, StoreServer};
use crate::transport::TransportKind;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::Arc;

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
    if let StoreHost::Etcd { endpoints, run_id } = &spec.store {
        if spec.world_size == 1 {
            return Ok(single(opts, "w", 0, None, None));
        }
        let store = Store::connect_etcd(
            endpoints,
            opts.secret.as_ref(),
            opts.init_timeout,
            "TANDEM_RDZV_ENDPOINTS",
        )?;
        let store =
            crate::agent_store::join_generation(&store, run_id, spec.rank, spec.world_size)?;
        return finish_world(store, None, &spec, world, opts);
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
        crate::group::hierarchy::setup(&world, opts.hierarchical)?;
    }
    Ok(world)
}

#[cfg(test)]
mod tests {
    #[cfg(not(feature = "etcd"))]
    #[test]
    fn without_the_etcd_feature_an_etcd_backend_says_how_to_get_one() {
        let timeout = std::time::Duration::from_secs(1);
        let endpoints = ["h1:2379".to_string()];
        let e = super::Store::connect_etcd(&endpoints, None, timeout, "TANDEM_RDZV_ENDPOINTS");
        let e = e.unwrap_err().to_string();
        assert!(e.contains("TANDEM_RDZV_BACKEND") && e.contains("--features etcd"), "{e}");
        assert!(e.contains("h1:2379"), "{e}");
    }
}
