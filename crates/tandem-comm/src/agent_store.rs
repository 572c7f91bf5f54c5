//! Joining torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank is a client
//! of the PyTorch `TCPStore` that torchrun's agent hosts at `MASTER_ADDR:MASTER_PORT`, and
//! tandem's rendezvous runs over it unchanged, its keys scoped to one launch attempt.
//!
//! Why a generation and not `TORCHELASTIC_RESTART_COUNT`: with `--rdzv-backend c10d` one store
//! serves every restart round, so keys of a failed attempt are still there; and the restart
//! count can differ between nodes (an agent that restarts its workers for a membership change
//! does not count it). The workers agree through the store itself: each adds one to a counter
//! kept per world size, arrivals `g*W+1 ..= (g+1)*W` form generation `g`, and each rank claims
//! its slot in its generation. A slot already claimed means the arrivals lost step (a worker of
//! an earlier attempt died before it arrived): that is reported by name, never joined.
//!
//! An etcd cluster (`TANDEM_RDZV_BACKEND=etcd`) is joined the same way: it outlives every
//! attempt and every job that shares the run id.
use crate::error::CommError;
use crate::store::Store;

/// `store` scoped to this attempt's generation of run `run_id` (`TORCHELASTIC_RUN_ID`).
pub(crate) fn join_generation(
    store: &Store,
    run_id: &str,
    rank: usize,
    world_size: usize,
) -> Result<Store, CommError> {
    let per_world = store.with_prefix(&format!("tandem/{run_id}/w{world_size}"));
    let arrival = per_world.add("arrivals", 1)?;
    let generation = (arrival - 1).max(0) / world_size as i64;
    let scoped = per_world.with_prefix(&format!("g{generation}"));
    let me = format!("pid {} on {}", std::process::id(), crate::net::hostname());
    let slot = format!("claim/{rank}");
    let owner = scoped.compare_set(&slot, b"", me.as_bytes())?;
    if owner != me.as_bytes() {
        return Err(CommError::rendezvous(
            "w",
            format!(
                "the store at {}: rank {rank} of generation {generation} (run \
                 {run_id:?}, world size {world_size}) was already joined by {}: the workers' \
                 arrivals are out of step (a worker of an earlier attempt died before it joined); \
                 start the torchrun job again",
                store.addr(),
                String::from_utf8_lossy(&owner)
            ),
        ));
    }
    Ok(scoped)
}
