//! `monitored_barrier` (PyTorch's, from gloo): a barrier that, when ranks do not arrive in time,
//! fails on every rank naming each rank that is missing (not only the first). It goes through
//! the rendezvous store, not the data transport: the ranks that did arrive learn the verdict
//! even though the missing ones never send a byte.
use super::ProcessGroup;
use crate::error::CommError;
use std::time::Duration;

/// How much longer than rank 0 the other ranks wait for its verdict: rank 0 decides at
/// `timeout` after its own arrival, which may come after theirs.
const VERDICT_GRACE: Duration = Duration::from_secs(2);

impl ProcessGroup {
    /// Returns once every rank of the group arrived; otherwise fails after `timeout` (the
    /// group's timeout when `None`) on every rank with [`CommError::BarrierMissing`] naming
    /// every rank (world ranks) that had not arrived, and the group is broken. A rank that
    /// arrives after the verdict fails with the same list.
    pub fn monitored_barrier(&self, timeout: Option<Duration>) -> Result<(), CommError> {
        let op = "monitored_barrier";
        let timeout = timeout.unwrap_or_else(|| self.timeout());
        let turn = self.ticket().wait(op, self.timeout())?;
        let seq = {
            let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
            st.seq += 1;
            st.seq - 1
        };
        if let Some(first) = self.inner.order.broken() {
            return Err(CommError::Broken { op, seq, first });
        }
        let Some(store) = self.inner.store.as_ref().filter(|_| self.size() > 1) else {
            return Ok(());
        };
        let (n, me) = (self.size(), self.rank());
        let prefix = format!("{}/monitored_barrier/{seq}", self.inner.name);
        let arrived = |r: usize| format!("{prefix}/arrived/{r}");
        let verdict_key = format!("{prefix}/verdict");
        let result = if me == 0 {
            let keys: Vec<String> = (1..n).map(arrived).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let missing: Vec<usize> = match store.wait_timeout(&refs, timeout) {
                Ok(()) => Vec::new(),
                Err(CommError::StoreTimeout { .. }) => {
                    let absent = store.missing(&refs)?;
                    (1..n).filter(|&r| absent.contains(&arrived(r))).collect()
                }
                Err(e) => return Err(e),
            };
            let world: Vec<usize> = missing.iter().map(|&r| self.inner.world_ranks[r]).collect();
            let verdict = world.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",");
            store.set(&verdict_key, verdict.as_bytes())?;
            for k in &refs {
                let _ = store.delete(k);
            }
            if world.is_empty() {
                Ok(())
            } else {
                Err(CommError::BarrierMissing { seq, missing: world, after: timeout })
            }
        } else {
            store.set(&arrived(me), b"")?;
            match store.wait_timeout(&[&verdict_key], timeout + VERDICT_GRACE) {
                Ok(()) => {
                    let verdict = store.get(&verdict_key)?;
                    let missing: Vec<usize> = String::from_utf8_lossy(&verdict)
                        .split(',')
                        .filter_map(|r| r.parse().ok())
                        .collect();
                    if missing.is_empty() {
                        Ok(())
                    } else {
                        Err(CommError::BarrierMissing { seq, missing, after: timeout })
                    }
                }
                Err(CommError::StoreTimeout { .. }) => Err(CommError::BarrierMissing {
                    seq,
                    missing: vec![self.inner.world_ranks[0]],
                    after: timeout + VERDICT_GRACE,
                }),
                Err(e) => Err(e),
            }
        };
        if let Err(e) = &result {
            self.inner.order.set_broken(e.to_string());
        }
        drop(turn);
        result
    }
}
