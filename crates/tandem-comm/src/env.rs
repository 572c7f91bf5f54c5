//! Where a process learns its rank, world size and rendezvous address: torchrun's `env://`
//! variables, Slurm, OpenMPI, an explicit `tcp://host:port`,
//! a shared `file://`, or nothing (a world of one). Also the tuning variables
//! (TANDEM_TRANSPORT, TANDEM_TIMEOUT, TANDEM_INIT_TIMEOUT, TANDEM_DEBUG or PyTorch's
//! TORCH_DISTRIBUTED_DEBUG, TANDEM_SOCKET_IFNAME or gloo's GLOO_SOCKET_IFNAME, TANDEM_RUN_ID).
//! Every bad value is an error naming its variable.
use crate::error::CommError;
use crate::transport::TransportKind;
use std::time::Duration;

/// How to initialise the default process group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InitMethod {
    /// Detect from the environment: torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`, ...), then Slurm, then OpenMPI; with none, a world of one.
    Env,
    /// A world of one: no network, no store.
    Single,
    /// Explicit rendezvous: `url` is `tcp://host:port` (rank 0 hosts the store there).
    Tcp { url: String, rank: usize, world_size: usize },
    /// Rendezvous through a file every rank can read (PyTorch's `file://`; a shared filesystem
    /// across hosts): rank 0 hosts the store and writes where to find it (see `file_init.rs`).
    File { path: std::path::PathBuf, rank: usize, world_size: usize },
}

impl InitMethod {
    /// `InitMethod::Tcp` from a `tcp://host:port` url.
    pub fn tcp(url: &str, rank: usize, world_size: usize) -> InitMethod {
        InitMethod::Tcp { url: url.to_string(), rank, world_size }
    }

    /// `InitMethod::File` for the file at `path`.
    pub fn file(path: impl Into<std::path::PathBuf>, rank: usize, world_size: usize) -> InitMethod {
        InitMethod::File { path: path.into(), rank, world_size }
    }

    /// PyTorch's `init_method` strings: `env://`, `tcp://host:port`, `file:///path`.
    pub fn from_url(url: &str, rank: usize, world_size: usize) -> Result<InitMethod, CommError> {
        if url == "env://" {
            Ok(InitMethod::Env)
        } else if url.starts_with("tcp://") {
            Ok(InitMethod::tcp(url, rank, world_size))
        } else if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(CommError::invalid(
                    "init",
                    format!("init method {url:?}: a file:// url takes an absolute path (file:///dir/name)"),
                ));
            }
            Ok(InitMethod::file(path, rank, world_size))
        } else {
            Err(CommError::invalid(
                "init",
                format!("init method {url:?}: expected env://, tcp://host:port or file:///path"),
            ))
        }
    }
}

/// PyTorch's `TORCH_DISTRIBUTED_DEBUG` levels (TANDEM_DEBUG takes the same values and wins).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum DebugLevel {
    /// Nothing extra (the default).
    #[default]
    Off,
    /// Each rank logs on stderr how every group it joins was set up (transport, hosts, timeout)
    /// and Ddp its buckets — PyTorch's INFO logs the process group and DDP set-up.
    Info,
    /// INFO, and every collective is first checked across ranks (op, type, count, root):
    /// ranks calling different collectives fail naming both calls, as PyTorch's DETAIL wraps
    /// process groups in its consistency checks.
    Detail,
}

impl DebugLevel {
    fn parse(var: &str, v: &str) -> Result<DebugLevel, CommError> {
        match v.trim().to_ascii_lowercase().as_str() {
            "off" | "0" => Ok(DebugLevel::Off),
            "info" => Ok(DebugLevel::Info),
            "detail" => Ok(DebugLevel::Detail),
            _ => Err(CommError::env(var, v, "expected OFF, INFO or DETAIL")),
        }
    }

    fn from_vars(e: &Env) -> Result<DebugLevel, CommError> {
        for var in ["TANDEM_DEBUG", "TORCH_DISTRIBUTED_DEBUG"] {
            if let Some(v) = e.var(var) {
                return DebugLevel::parse(var, &v);
            }
        }
        Ok(DebugLevel::Off)
    }
}

/// This process's debug level from TANDEM_DEBUG / TORCH_DISTRIBUTED_DEBUG (`Off` when unset or
/// invalid: `init` reports an invalid value).
pub fn debug_level() -> DebugLevel {
    DebugLevel::from_vars(&Env(&process_env)).unwrap_or_default()
}

/// Settings that are not part of the rendezvous itself. `InitOptions::from_env()` reads them
/// from the environment; fields can be overridden.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Force a transport; `None` chooses shared memory when every rank is on one host.
    pub transport: Option<TransportKind>,
    /// A collective fails when a peer makes no progress for this long (default 10 s).
    pub timeout: Duration,
    /// How long rendezvous waits for the store and the other ranks (default 300 s).
    pub init_timeout: Duration,
    /// Identifies the job; connections carrying another run id are refused.
    pub run_id: String,
    /// Check every collective's (sequence, op, dtype, count) across ranks (TANDEM_DEBUG=detail
    /// or TORCH_DISTRIBUTED_DEBUG=DETAIL).
    pub desync_check: bool,
    /// Log each group's set-up on stderr (INFO and DETAIL).
    pub debug: DebugLevel,
    /// The network interface whose address the TCP mesh (and a `file://` rank 0's store)
    /// uses, for hosts with several (TANDEM_SOCKET_IFNAME, else gloo's GLOO_SOCKET_IFNAME; the
    /// first of a comma-separated list). `None`: the address this host reaches the store from.
    pub socket_ifname: Option<String>,
    /// All-reduce of a group spanning several hosts: `None` (auto) goes hierarchical when every
    /// host has the same number of ranks, more than one; `Some(false)` keeps the flat ring
    /// (TANDEM_ALLREDUCE=auto|flat|hierarchical).
    pub hierarchical: Option<bool>,
    /// The job's secret: the store, the mesh and shared memory admit only processes that prove
    /// they hold it (TANDEM_SECRET from a launcher, or the file TANDEM_SECRET_FILE names).
    /// `None`: an unauthenticated job (docs/security.md).
    pub secret: Option<crate::auth::JobSecret>,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            transport: None,
            timeout: Duration::from_secs(10),
            init_timeout: Duration::from_secs(300),
            run_id: "tandem".to_string(),
            desync_check: false,
            debug: DebugLevel::Off,
            socket_ifname: None,
            hierarchical: None,
            secret: None,
        }
    }
}

/// Reads variables: the process environment, or a map in tests.
pub(crate) struct Env<'a>(pub &'a dyn Fn(&str) -> Option<String>);

impl Env<'_> {
    fn var(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.trim().is_empty())
    }
}

pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn seconds(e: &Env, name: &str) -> Result<Option<Duration>, CommError> {
    match e.var(name) {
        None => Ok(None),
        Some(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
            _ => Err(CommError::env(name, &v, "expected a positive number of seconds")),
        },
    }
}

/// The job's id as its launcher names it: `TANDEM_RUN_ID`, torchrun's `TORCHELASTIC_RUN_ID` or
/// Slurm's `SLURM_JOB_ID` (what scopes the store's keys, and what a program names the job's
/// files after); `None` when no launcher set one.
pub fn job_id_from_env() -> Option<String> {
    job_id(&Env(&process_env))
}

fn job_id(e: &Env) -> Option<String> {
    e.var("TANDEM_RUN_ID")
        .or_else(|| e.var("TANDEM_RDZV_ID"))
        .or_else(|| e.var("TORCHELASTIC_RUN_ID"))
        .or_else(|| e.var("SLURM_JOB_ID"))
}

impl InitOptions {
    pub fn from_env() -> Result<InitOptions, CommError> {
        Self::from_vars(&Env(&process_env))
    }

    pub(crate) fn from_vars(e: &Env) -> Result<InitOptions, CommError> {
        let mut o = InitOptions::default();
        // TANDEM_BACKEND=mpi is the spelling `--backend mpi` users know; TANDEM_TRANSPORT wins.
        for var in ["TANDEM_BACKEND", "TANDEM_TRANSPORT"] {
            if let Some(v) = e.var(var) {
                o.transport = match v.trim().to_ascii_lowercase().as_str() {
                    "tcp" => Some(TransportKind::Tcp),
                    "shm" => Some(TransportKind::Shm),
                    "mpi" => Some(TransportKind::Mpi),
                    "auto" => None,
                    _ => return Err(CommError::env(var, &v, "expected tcp, shm, mpi or auto")),
                };
            }
        }
        if let Some(v) = e.var("TANDEM_ALLREDUCE") {
            o.hierarchical = match v.trim().to_ascii_lowercase().as_str() {
                "flat" => Some(false),
                "hierarchical" => Some(true),
                "auto" => None,
                _ => {
                    return Err(CommError::env(
                        "TANDEM_ALLREDUCE",
                        &v,
                        "expected auto, flat or hierarchical",
                    ))
                }
            };
        }
        if let Some(t) = seconds(e, "TANDEM_TIMEOUT")? {
            o.timeout = t;
        }
        if let Some(t) = seconds(e, "TANDEM_INIT_TIMEOUT")? {
            o.init_timeout = t;
        }
        if let Some(id) = job_id(e) {
            o.run_id = id;
        }
        o.secret = crate::auth::JobSecret::from_vars(|var| e.var(var))?;
        o.debug = DebugLevel::from_vars(e)?;
        o.desync_check = o.debug == DebugLevel::Detail;
        for var in ["TANDEM_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"] {
            if let Some(v) = e.var(var) {
                let first = v.split(',').map(str::trim).find(|s| !s.is_empty());
                let first = first.ok_or_else(|| CommError::env(var, &v, "names no interface"))?;
                o.socket_ifname = Some(first.to_string());
                break;
            }
        }
        Ok(o)
    }
}

/// The resolved rendezvous of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: Option<usize>,
    pub local_size: Option<usize>,
    /// host, port, and the variable(s) they came from (for errors).
    pub master: Option<(String, u16, String)>,
    /// Who hosts the rendezvous store.
    pub store: StoreHost,
}

/// Who hosts the rendezvous store at the master address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreHost {
    /// Rank 0 hosts tandem's store (plain env, tcp://, Slurm, OpenMPI, `tandem run`).
    Rank0,
    /// torchrun's agent hosts PyTorch's TCPStore (`TORCHELASTIC_USE_AGENT_STORE=True`); every
    /// rank is a client. `run_id` is `TORCHELASTIC_RUN_ID`, which scopes tandem's keys there.
    TorchAgent { run_id: String },
    /// `file://`: rank 0 hosts tandem's store and writes its address into the file.
    File { path: std::path::PathBuf },
    /// `TANDEM_RDZV_BACKEND=etcd`: an etcd cluster at `TANDEM_RDZV_ENDPOINTS` holds the store
    /// (feature `etcd`); every rank is a client, keys scoped by `run_id` and a generation.
    Etcd { endpoints: Vec<String>, run_id: String },
}

/// The etcd cluster named by `TANDEM_RDZV_BACKEND=etcd` and `TANDEM_RDZV_ENDPOINTS`
/// (torchrun's `--rdzv-backend` / `--rdzv-endpoint` as variables); `None` when no backend is set.
pub(crate) fn etcd_store(e: &Env) -> Result<Option<StoreHost>, CommError> {
    let Some(backend) = e.var("TANDEM_RDZV_BACKEND") else { return Ok(None) };
    match backend.as_str() {
        "etcd" | "etcd-v2" | "etcd-v3" => {}
        "static" | "tandem" | "c10d" => return Ok(None),
        _ => {
            return Err(CommError::env(
                "TANDEM_RDZV_BACKEND",
                &backend,
                "expected etcd (an etcd v3 cluster holds the store) or static (rank 0 hosts it)",
            ))
        }
    }
    let raw = e.var("TANDEM_RDZV_ENDPOINTS").unwrap_or_default();
    let endpoints: Vec<String> =
        raw.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
    if endpoints.is_empty() {
        return Err(CommError::env(
            "TANDEM_RDZV_ENDPOINTS",
            &raw,
            "names no etcd member (expected host:port[,host:port...]; TANDEM_RDZV_BACKEND=etcd)",
        ));
    }
    // The launcher scopes each attempt by TANDEM_RDZV_ID; the job's id otherwise.
    let run_id = e.var("TANDEM_RDZV_ID").or_else(|| job_id(e)).unwrap_or_else(|| "none".into());
    Ok(Some(StoreHost::Etcd { endpoints, run_id }))
}

fn parse_usize(e: &Env, name: &str) -> Result<Option<usize>, CommError> {
    match e.var(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| CommError::env(name, &v, "expected a non-negative integer")),
    }
}

fn require_usize(e: &Env, name: &str) -> Result<usize, CommError> {
    parse_usize(e, name)?.ok_or_else(|| {
        CommError::env(name, "", "is not set (required alongside the other launcher variables)")
    })
}

fn check_rank(rank_var: &str, rank: usize, size_var: &str, size: usize) -> Result<(), CommError> {
    if size == 0 {
        return Err(CommError::env(size_var, "0", "world size must be at least 1"));
    }
    if rank >= size {
        return Err(CommError::env(
            rank_var,
            &rank.to_string(),
            format!("must be less than {size_var}={size}"),
        ));
    }
    Ok(())
}

fn master_port(e: &Env, default: Option<u16>) -> Result<u16, CommError> {
    match e.var("MASTER_PORT") {
        Some(v) => match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(CommError::env("MASTER_PORT", &v, "expected a port number 1-65535")),
        },
        None => default.ok_or_else(|| CommError::env("MASTER_PORT", "", "is not set")),
    }
}

/// A task started by `srun`: rank and size from SLURM_PROCID/SLURM_NTASKS, the local rank and
/// the tasks on this node from SLURM_LOCALID and SLURM_TASKS_PER_NODE/SLURM_NODEID, the store on
/// the first host of SLURM_JOB_NODELIST (or MASTER_ADDR) at MASTER_PORT, else at a port derived
/// from SLURM_JOB_ID (see `slurm::port_for_job`), else 29500.
fn slurm_spec(e: &Env) -> Result<Spec, CommError> {
    let rank = require_usize(e, "SLURM_PROCID")?;
    let size = require_usize(e, "SLURM_NTASKS")?;
    check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", size)?;
    let local_rank = parse_usize(e, "SLURM_LOCALID")?;
    let local_size = match (e.var("SLURM_TASKS_PER_NODE"), parse_usize(e, "SLURM_NODEID")?) {
        (Some(spec), Some(node)) => {
            let per_node = crate::slurm::tasks_per_node(&spec)
                .map_err(|why| CommError::env("SLURM_TASKS_PER_NODE", &spec, &why))?;
            let here = per_node.get(node).copied().ok_or_else(|| {
                CommError::env(
                    "SLURM_NODEID",
                    &node.to_string(),
                    format!("SLURM_TASKS_PER_NODE={spec} lists {} node(s)", per_node.len()),
                )
            })?;
            if let Some(lr) = local_rank {
                check_rank("SLURM_LOCALID", lr, "SLURM_TASKS_PER_NODE", here)?;
            }
            Some(here)
        }
        _ => None,
    };
    let master = if size > 1 {
        let (host, var_name) = match e.var("MASTER_ADDR") {
            Some(h) => (h, "MASTER_ADDR"),
            None => {
                let (var, list) = match e.var("SLURM_JOB_NODELIST") {
                    Some(l) => ("SLURM_JOB_NODELIST", l),
                    None => (
                        "SLURM_NODELIST",
                        e.var("SLURM_NODELIST").ok_or_else(|| {
                            CommError::env(
                                "SLURM_JOB_NODELIST",
                                "",
                                "is not set and MASTER_ADDR is not set either",
                            )
                        })?,
                    ),
                };
                let hosts = crate::slurm::expand_nodelist(&list)
                    .map_err(|why| CommError::env(var, &list, &why))?;
                (hosts[0].clone(), var)
            }
        };
        let job_port = match e.var("SLURM_JOB_ID") {
            Some(id) => match id.trim().parse::<u64>() {
                Ok(id) => Some(crate::slurm::port_for_job(id)),
                Err(_) => return Err(CommError::env("SLURM_JOB_ID", &id, "expected a number")),
            },
            None => None,
        };
        let port = master_port(e, Some(job_port.unwrap_or(29500)))?;
        let how = match (e.var("MASTER_PORT"), job_port) {
            (None, Some(_)) => format!("{var_name}/SLURM_JOB_ID"),
            _ => format!("{var_name}/MASTER_PORT"),
        };
        Some((host, port, how))
    } else {
        None
    };
    Ok(Spec { rank, world_size: size, local_rank, local_size, master, store: StoreHost::Rank0 })
}

fn parse_tcp_url(url: &str) -> Result<(String, u16), CommError> {
    let bad = |why: &str| {
        CommError::invalid("init", format!("init method {url:?}: {why} (expected tcp://host:port)"))
    };
    let rest = url.strip_prefix("tcp://").ok_or_else(|| bad("not a tcp:// url"))?;
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("missing port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port.parse().map_err(|_| bad("bad port"))?;
    if host.is_empty() || port == 0 {
        return Err(bad("empty host or port 0"));
    }
    Ok((host.to_string(), port))
}

pub(crate) fn resolve(e: &Env, method: &InitMethod) -> Result<Spec, CommError> {
    let agent_store = e
        .var("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    match method {
        InitMethod::Single => Ok(Spec {
            rank: 0,
            world_size: 1,
            local_rank: Some(0),
            local_size: Some(1),
            master: None,
            store: StoreHost::Rank0,
        }),
        InitMethod::Tcp { url, rank, world_size } => {
            let (host, port) = parse_tcp_url(url)?;
            check_init_rank(*rank, *world_size)?;
            Ok(Spec {
                rank: *rank,
                world_size: *world_size,
                local_rank: None,
                local_size: None,
                master: Some((host, port, format!("init url {url}"))),
                store: StoreHost::Rank0,
            })
        }
        InitMethod::File { path, rank, world_size } => {
            check_init_rank(*rank, *world_size)?;
            Ok(Spec {
                rank: *rank,
                world_size: *world_size,
                local_rank: None,
                local_size: None,
                master: None,
                store: StoreHost::File { path: path.clone() },
            })
        }
        InitMethod::Env => {
            if e.var("RANK").is_some() || e.var("WORLD_SIZE").is_some() {
                let rank = require_usize(e, "RANK")?;
                let size = require_usize(e, "WORLD_SIZE")?;
                check_rank("RANK", rank, "WORLD_SIZE", size)?;
                let local_rank = parse_usize(e, "LOCAL_RANK")?;
                let local_size = parse_usize(e, "LOCAL_WORLD_SIZE")?;
                if let (Some(lr), Some(ls)) = (local_rank, local_size) {
                    check_rank("LOCAL_RANK", lr, "LOCAL_WORLD_SIZE", ls)?;
                }
                if let Some(store) = etcd_store(e)? {
                    return Ok(Spec {
                        rank,
                        world_size: size,
                        local_rank,
                        local_size,
                        master: None,
                        store,
                    });
                }
                let master = if size > 1 {
                    let host = e.var("MASTER_ADDR").ok_or_else(|| {
                        CommError::env(
                            "MASTER_ADDR",
                            "",
                            "is not set (required when WORLD_SIZE > 1)",
                        )
                    })?;
                    Some((host, master_port(e, None)?, "MASTER_ADDR/MASTER_PORT".to_string()))
                } else {
                    None
                };
                return Ok(Spec {
                    rank,
                    world_size: size,
                    local_rank,
                    local_size,
                    master,
                    store: if agent_store {
                        StoreHost::TorchAgent {
                            run_id: e.var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
                        }
                    } else {
                        StoreHost::Rank0
                    },
                });
            }
            if e.var("SLURM_PROCID").is_some() && e.var("SLURM_NTASKS").is_some() {
                return slurm_spec(e);
            }
            if e.var("OMPI_COMM_WORLD_RANK").is_some() || e.var("OMPI_COMM_WORLD_SIZE").is_some() {
                let rank = require_usize(e, "OMPI_COMM_WORLD_RANK")?;
                let size = require_usize(e, "OMPI_COMM_WORLD_SIZE")?;
                check_rank("OMPI_COMM_WORLD_RANK", rank, "OMPI_COMM_WORLD_SIZE", size)?;
                let local_rank = parse_usize(e, "OMPI_COMM_WORLD_LOCAL_RANK")?;
                let local_size = parse_usize(e, "OMPI_COMM_WORLD_LOCAL_SIZE")?;
                let master = if size > 1 {
                    // All ranks on this host: loopback needs no configuration.
                    let all_local = local_size == Some(size);
                    let host = match e.var("MASTER_ADDR") {
                        Some(h) => h,
                        None if all_local => "127.0.0.1".to_string(),
                        None => {
                            return Err(CommError::env(
                                "MASTER_ADDR",
                                "",
                                "is not set (required for OpenMPI jobs spanning hosts)",
                            ))
                        }
                    };
                    Some((
                        host,
                        master_port(e, Some(29500))?,
                        "MASTER_ADDR/MASTER_PORT".to_string(),
                    ))
                } else {
                    None
                };
                return Ok(Spec {
                    rank,
                    world_size: size,
                    local_rank,
                    local_size,
                    master,
                    store: StoreHost::Rank0,
                });
            }
            resolve(e, &InitMethod::Single)
        }
    }
}

/// An explicit rank and world size from an init method, checked.
fn check_init_rank(rank: usize, world_size: usize) -> Result<(), CommError> {
    if world_size == 0 || rank >= world_size {
        return Err(CommError::invalid(
            "init",
            format!("rank {rank} is out of range for world size {world_size}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_tasks_per_node_give_the_local_size_and_the_job_id_a_port() {
        let base = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_JOB_NODELIST", "rack[1-2]-n[07-08]"),
            ("SLURM_JOB_ID", "123456"),
        ];
        let s = resolve_vars(&base).unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.local_size), (5, 7, Some(1), Some(2)));
        let (host, port, how) = s.master.unwrap();
        assert_eq!((host.as_str(), port), ("rack1-n07", 23456));
        assert!(how.contains("SLURM_JOB_ID"), "{how}");
        // MASTER_PORT wins over the job id.
        let mut with_port = base.to_vec();
        with_port.push(("MASTER_PORT", "31000"));
        assert_eq!(resolve_vars(&with_port).unwrap().master.unwrap().1, 31000);
        // Inconsistent values are named.
        let mut bad_node = base.to_vec();
        bad_node[3] = ("SLURM_NODEID", "4");
        assert!(err_text(&bad_node).contains("SLURM_NODEID"));
        let mut bad_local = base.to_vec();
        bad_local[2] = ("SLURM_LOCALID", "2");
        assert!(err_text(&bad_local).contains("SLURM_LOCALID"));
        let mut bad_list = base.to_vec();
        bad_list[5] = ("SLURM_JOB_NODELIST", "n[01-");
        assert!(err_text(&bad_list).contains("SLURM_JOB_NODELIST"));
        let mut bad_job = base.to_vec();
        bad_job[6] = ("SLURM_JOB_ID", "abc");
        assert!(err_text(&bad_job).contains("SLURM_JOB_ID"));
    }

    fn resolve_vars(vars: &[(&str, &str)]) -> Result<Spec, CommError> {
        let map: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let get = move |k: &str| map.get(k).cloned();
        resolve(&Env(&get), &InitMethod::Env)
    }

    fn err_text(vars: &[(&str, &str)]) -> String {
        resolve_vars(vars).expect_err("should fail").to_string()
    }

    #[test]
    fn an_etcd_backend_makes_every_rank_a_client_and_needs_no_master() {
        let base = [("RANK", "1"), ("WORLD_SIZE", "3"), ("TANDEM_RDZV_BACKEND", "etcd")];
        let mut vars = base.to_vec();
        vars.push(("TANDEM_RDZV_ENDPOINTS", " h1:2379, h2:2379,,h3:2379 "));
        vars.push(("TANDEM_RDZV_ID", "job9"));
        let s = resolve_vars(&vars).unwrap();
        assert_eq!((s.rank, s.world_size, s.master), (1, 3, None));
        let endpoints = ["h1:2379", "h2:2379", "h3:2379"].map(String::from).to_vec();
        assert_eq!(s.store, StoreHost::Etcd { endpoints, run_id: "job9".into() });
        // The static backend is the default one: MASTER_ADDR is needed again.
        let stat = [("RANK", "1"), ("WORLD_SIZE", "3"), ("TANDEM_RDZV_BACKEND", "static")];
        assert!(err_text(&stat).contains("MASTER_ADDR"));
        // No endpoint, or a backend tandem does not know: named.
        assert!(err_text(&base).contains("TANDEM_RDZV_ENDPOINTS"));
        let mut zk = base.to_vec();
        zk[2] = ("TANDEM_RDZV_BACKEND", "zookeeper");
        let e = err_text(&zk);
        assert!(e.contains("TANDEM_RDZV_BACKEND") && e.contains("zookeeper"), "{e}");
    }

    #[test]
    fn torchrun_variables() {
        let s = resolve_vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "29501"),
        ])
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.local_size), (2, 4, Some(0), Some(2)));
        assert_eq!(s.master.as_ref().map(|m| (m.0.as_str(), m.1)), Some(("10.1.2.3", 29501)));
        assert_eq!(s.store, StoreHost::Rank0);
    }

    #[test]
    fn torchrun_agent_store_makes_every_rank_a_client_scoped_by_run_id() {
        let base =
            [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "29500")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v: Vec<(&str, &str)> = base.to_vec();
            v.extend_from_slice(extra);
            resolve_vars(&v).unwrap().store
        };
        assert_eq!(
            with(&[("TORCHELASTIC_USE_AGENT_STORE", "True"), ("TORCHELASTIC_RUN_ID", "job7")]),
            StoreHost::TorchAgent { run_id: "job7".into() }
        );
        assert_eq!(
            with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]),
            StoreHost::TorchAgent { run_id: "none".into() }
        );
        // `tandem run` sets False: rank 0 hosts tandem's store.
        assert_eq!(with(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]), StoreHost::Rank0);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v: Vec<(&str, &str)> = base.to_vec();
            v.extend_from_slice(extra);
            err_text(&v)
        };
        assert!(with(&[("RANK", "4"), ("WORLD_SIZE", "4")]).contains("RANK=\"4\""));
        assert!(with(&[("RANK", "0"), ("WORLD_SIZE", "four")]).contains("WORLD_SIZE"));
        assert!(with(&[("RANK", "0")]).contains("WORLD_SIZE"));
        assert!(with(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2")
        ])
        .contains("LOCAL_RANK"));
        assert!(err_text(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
            .contains("MASTER_ADDR"));
        assert!(err_text(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999")
        ])
        .contains("MASTER_PORT"));
        assert!(err_text(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "2")]).contains("SLURM_PROCID"));
        assert!(err_text(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2")])
            .contains("OMPI_COMM_WORLD_RANK"));
    }

    #[test]
    fn slurm_uses_first_node_when_master_addr_is_unset() {
        let s = resolve_vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ])
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank), (1, 8, Some(1)));
        assert_eq!(s.master.as_ref().map(|m| (m.0.as_str(), m.1)), Some(("gpu07", 29500)));
    }

    #[test]
    fn openmpi_single_host_defaults_to_loopback() {
        let s = resolve_vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.local_size), (1, 2, Some(1), Some(2)));
        assert_eq!(s.master.as_ref().map(|m| m.0.as_str()), Some("127.0.0.1"));
    }

    #[test]
    fn nothing_set_is_a_world_of_one() {
        let s = resolve_vars(&[]).unwrap();
        assert_eq!((s.rank, s.world_size, s.master.is_none()), (0, 1, true));
    }

    #[test]
    fn the_job_id_is_tandem_s_then_torchrun_s_then_slurm_s() {
        let id = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> =
                vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            let get = move |q: &str| vars.iter().find(|(k, _)| k == q).map(|(_, v)| v.clone());
            job_id(&Env(&get))
        };
        let all = [("SLURM_JOB_ID", "77"), ("TORCHELASTIC_RUN_ID", "te"), ("TANDEM_RUN_ID", "t")];
        assert_eq!(id(&all).as_deref(), Some("t"));
        assert_eq!(id(&all[..2]).as_deref(), Some("te"));
        assert_eq!(id(&all[..1]).as_deref(), Some("77"));
        assert_eq!(id(&[("TANDEM_RUN_ID", " ")]), None, "blank is unset");
    }

    #[test]
    fn options_from_variables() {
        let map: std::collections::HashMap<&str, &str> = [
            ("TANDEM_TRANSPORT", "shm"),
            ("TANDEM_TIMEOUT", "2.5"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TANDEM_DEBUG", "detail"),
        ]
        .into_iter()
        .collect();
        let get = |k: &str| map.get(k).map(|v| v.to_string());
        let o = InitOptions::from_vars(&Env(&get)).unwrap();
        assert_eq!(o.transport, Some(TransportKind::Shm));
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert_eq!(o.run_id, "job7");
        assert!(o.desync_check);
        let bad = |k: &'static str, v: &'static str| {
            let get = move |q: &str| (q == k).then(|| v.to_string());
            InitOptions::from_vars(&Env(&get)).expect_err("bad value").to_string()
        };
        assert!(bad("TANDEM_TRANSPORT", "ib").contains("TANDEM_TRANSPORT"));
        assert!(bad("TANDEM_TIMEOUT", "-1").contains("TANDEM_TIMEOUT"));
    }

    fn options(vars: &[(&'static str, &'static str)]) -> Result<InitOptions, CommError> {
        let map: std::collections::HashMap<&str, &str> = vars.iter().copied().collect();
        let get = move |k: &str| map.get(k).map(|v| v.to_string());
        InitOptions::from_vars(&Env(&get))
    }

    #[test]
    fn torch_distributed_debug_is_read_as_pytorch_documents_it() {
        let o = options(&[("TORCH_DISTRIBUTED_DEBUG", "DETAIL")]).unwrap();
        assert_eq!((o.debug, o.desync_check), (DebugLevel::Detail, true));
        let o = options(&[("TORCH_DISTRIBUTED_DEBUG", "INFO")]).unwrap();
        assert_eq!((o.debug, o.desync_check), (DebugLevel::Info, false));
        let o = options(&[("TORCH_DISTRIBUTED_DEBUG", "OFF")]).unwrap();
        assert_eq!((o.debug, o.desync_check), (DebugLevel::Off, false));
        // tandem's own variable wins over PyTorch's.
        let o = options(&[("TORCH_DISTRIBUTED_DEBUG", "DETAIL"), ("TANDEM_DEBUG", "off")]).unwrap();
        assert_eq!(o.debug, DebugLevel::Off);
        let e = options(&[("TORCH_DISTRIBUTED_DEBUG", "verbose")]).unwrap_err().to_string();
        assert!(
            e.contains("TORCH_DISTRIBUTED_DEBUG=\"verbose\": expected OFF, INFO or DETAIL"),
            "{e}"
        );
    }

    #[test]
    fn the_socket_interface_comes_from_tandem_or_gloo() {
        let o = options(&[("GLOO_SOCKET_IFNAME", "eth1,eth2")]).unwrap();
        assert_eq!(o.socket_ifname.as_deref(), Some("eth1"));
        let o =
            options(&[("GLOO_SOCKET_IFNAME", "eth1"), ("TANDEM_SOCKET_IFNAME", "ib0")]).unwrap();
        assert_eq!(o.socket_ifname.as_deref(), Some("ib0"));
        assert!(options(&[("TANDEM_SOCKET_IFNAME", ",")]).is_err());
        assert_eq!(options(&[]).unwrap().socket_ifname, None);
    }

    #[test]
    fn init_method_urls() {
        assert_eq!(InitMethod::from_url("env://", 0, 1).unwrap(), InitMethod::Env);
        assert_eq!(
            InitMethod::from_url("file:///tmp/x", 1, 2).unwrap(),
            InitMethod::file("/tmp/x", 1, 2)
        );
        assert!(InitMethod::from_url("file://relative", 0, 1).is_err());
        assert!(InitMethod::from_url("nccl://x", 0, 1)
            .unwrap_err()
            .to_string()
            .contains("expected env://"));
    }

    #[test]
    fn tcp_urls() {
        assert_eq!(parse_tcp_url("tcp://10.0.0.1:29500").unwrap(), ("10.0.0.1".to_string(), 29500));
        assert_eq!(parse_tcp_url("tcp://[::1]:80").unwrap(), ("::1".to_string(), 80));
        assert!(parse_tcp_url("env://").is_err());
        assert!(parse_tcp_url("tcp://host:notaport").is_err());
    }
}
