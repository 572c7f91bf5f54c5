//! The environment a worker starts with: torchrun's variables (what `tandem_comm::init` and
//! `torch.distributed`'s `env://` read) plus per-worker thread counts.
use std::ffi::OsString;

/// The facts about one attempt that every worker's variables are derived from.
#[derive(Clone, Debug)]
pub struct JobShape {
    pub nnodes: u32,
    pub nproc_per_node: u32,
    pub node_rank: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub restart_count: u32,
    pub max_restarts: u32,
    pub run_id: String,
    /// With `--rdzv-backend etcd`: the cluster's endpoints (joined by commas) and the id that
    /// scopes this attempt's keys there; the workers then rendezvous on etcd, not at
    /// MASTER_ADDR.
    pub etcd: Option<(String, String)>,
}

impl JobShape {
    pub fn world_size(&self) -> u32 {
        self.nnodes * self.nproc_per_node
    }

    /// Global rank of `local_rank` on this node. Every node runs the same number of workers, so
    /// ranks are assigned node by node, as torchrun's static rendezvous does.
    pub fn rank(&self, local_rank: u32) -> u32 {
        self.node_rank * self.nproc_per_node + local_rank
    }

    /// The launcher's variables for one worker. These override anything inherited.
    pub fn launcher_vars(&self, local_rank: u32) -> Vec<(&'static str, String)> {
        let rank = self.rank(local_rank).to_string();
        let world = self.world_size().to_string();
        let mut vars = vec![
            ("RANK", rank.clone()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", world.clone()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            ("ROLE_NAME", "default".into()),
            ("ROLE_RANK", rank),
            ("ROLE_WORLD_SIZE", world),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", self.restart_count.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_RUN_ID", self.run_id.clone()),
            // The launcher hosts no store: rank 0 of the job does (at MASTER_ADDR:MASTER_PORT).
            ("TORCHELASTIC_USE_AGENT_STORE", "False".into()),
        ];
        if let Some((endpoints, id)) = &self.etcd {
            vars.push(("TANDEM_RDZV_BACKEND", "etcd".into()));
            vars.push(("TANDEM_RDZV_ENDPOINTS", endpoints.clone()));
            vars.push(("TANDEM_RDZV_ID", id.clone()));
        }
        vars
    }
}

/// Variables naming how many threads each worker's pools (OpenMP, rayon) should use.
pub const THREAD_VARS: [&str; 2] = ["OMP_NUM_THREADS", "RAYON_NUM_THREADS"];

/// How long (spin iterations) candle's own elementwise pool spins for work before parking,
/// set on workers that do not set it: candle's default (25,000) keeps an extra thread busy
/// after every binary op, taking a core from the rank's compute threads when ranks fill the
/// host's cores (`tandem_nn::join_compute_pool` applies the same value in-process).
pub const CANDLE_SPIN: (&str, &str) = ("CANDLE_BARRIER_POOL_SPIN_LIMIT", "1000");

/// `max(1, cores / nproc)`: the workers share this host's cores evenly.
pub fn threads_per_worker(cores: u32, nproc_per_node: u32) -> u32 {
    (cores / nproc_per_node.max(1)).max(1)
}

/// The complete list of variables to set on a worker, on top of what it inherits:
/// `extra` first, then the launcher's variables, then thread counts for those of
/// [`THREAD_VARS`] that are neither inherited (`inherited_has`) nor in `extra`.
pub fn worker_env(
    shape: &JobShape,
    local_rank: u32,
    cores: u32,
    extra: &[(OsString, OsString)],
    inherited_has: impl Fn(&str) -> bool,
) -> Vec<(OsString, OsString)> {
    let mut vars: Vec<(OsString, OsString)> = extra.to_vec();
    for (k, v) in shape.launcher_vars(local_rank) {
        vars.push((k.into(), v.into()));
    }
    let threads = threads_per_worker(cores, shape.nproc_per_node).to_string();
    for key in THREAD_VARS {
        let in_extra = extra.iter().any(|(k, _)| k == key);
        if !in_extra && !inherited_has(key) {
            vars.push((key.into(), threads.clone().into()));
        }
    }
    let (key, value) = CANDLE_SPIN;
    if !extra.iter().any(|(k, _)| k == key) && !inherited_has(key) {
        vars.push((key.into(), value.into()));
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> JobShape {
        JobShape {
            nnodes: 2,
            nproc_per_node: 3,
            node_rank: 1,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            restart_count: 1,
            max_restarts: 4,
            run_id: "job7".into(),
            etcd: None,
        }
    }

    fn get<'a>(vars: &'a [(OsString, OsString)], key: &str) -> Option<&'a str> {
        vars.iter().rev().find(|(k, _)| k == key).and_then(|(_, v)| v.to_str())
    }

    #[test]
    fn ranks_are_assigned_node_by_node() {
        let s = shape();
        let v = worker_env(&s, 2, 12, &[], |_| false);
        assert_eq!(get(&v, "RANK"), Some("5"));
        assert_eq!(get(&v, "LOCAL_RANK"), Some("2"));
        assert_eq!(get(&v, "WORLD_SIZE"), Some("6"));
        assert_eq!(get(&v, "LOCAL_WORLD_SIZE"), Some("3"));
        assert_eq!(get(&v, "GROUP_RANK"), Some("1"));
        assert_eq!(get(&v, "MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get(&v, "MASTER_PORT"), Some("29500"));
        assert_eq!(get(&v, "TORCHELASTIC_RESTART_COUNT"), Some("1"));
        assert_eq!(get(&v, "TORCHELASTIC_MAX_RESTARTS"), Some("4"));
        assert_eq!(get(&v, "TORCHELASTIC_RUN_ID"), Some("job7"));
        assert_eq!(get(&v, "OMP_NUM_THREADS"), Some("4"));
        assert_eq!(get(&v, "RAYON_NUM_THREADS"), Some("4"));
        assert_eq!(get(&v, "CANDLE_BARRIER_POOL_SPIN_LIMIT"), Some("1000"));
    }

    #[test]
    fn thread_counts_respect_existing_settings_and_floor_at_one() {
        assert_eq!(threads_per_worker(2, 4), 1);
        assert_eq!(threads_per_worker(16, 4), 4);
        let extra = vec![(OsString::from("RAYON_NUM_THREADS"), OsString::from("7"))];
        let v = worker_env(&shape(), 0, 12, &extra, |k| k == "OMP_NUM_THREADS");
        assert_eq!(get(&v, "OMP_NUM_THREADS"), None, "inherited value must be left alone");
        assert_eq!(get(&v, "RAYON_NUM_THREADS"), Some("7"));
        let v = worker_env(&shape(), 0, 12, &[], |k| k == "CANDLE_BARRIER_POOL_SPIN_LIMIT");
        assert_eq!(get(&v, "CANDLE_BARRIER_POOL_SPIN_LIMIT"), None, "a user's value is kept");
    }

    #[test]
    fn launcher_variables_win_over_extra_env() {
        let extra = vec![
            (OsString::from("RANK"), OsString::from("99")),
            (OsString::from("FOO"), OsString::from("bar")),
        ];
        let v = worker_env(&shape(), 0, 1, &extra, |_| false);
        assert_eq!(get(&v, "RANK"), Some("3"));
        assert_eq!(get(&v, "FOO"), Some("bar"));
    }
}
