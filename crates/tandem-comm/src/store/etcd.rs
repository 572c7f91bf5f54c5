//! The job's store on an etcd v3 cluster (feature `etcd`; `TANDEM_RDZV_BACKEND=etcd`): the
//! keys `server.rs` holds in one launcher's memory, kept by a quorum of etcd members instead,
//! so that no host of the job is special.
//!
//! - Keys are as the caller names them: rendezvous scopes them by run id and generation
//!   (`agent_store::join_generation`), so jobs sharing a cluster never meet.
//! - Keys a process owns (`set_owned`) hang on one lease per client, granted on first use with
//!   a [`LEASE_TTL`] of 3 s, kept alive twice a second by a task of the client's runtime (a
//!   member silent for half a second is left for the next) and revoked when the last clone of
//!   the client is dropped. A process that dies loses its keys when the TTL runs out, as
//!   tandem's store drops them when the connection closes; one cut off from every member for
//!   the TTL loses them too, and gets a new lease for its next owned key.
//! - Waits poll the keys (all of them in one transaction), every 5 ms growing to 50 ms, rather
//!   than hold a watch stream: a watch breaks with the member it was opened on, a poll simply
//!   goes to another member.
//! - `add` and `compare_set` are etcd transactions (compare a key's revision or value, then
//!   put), so concurrent clients on different members see one order.
//! - Requests go to one member, the last that answered, and move on to the next when it does
//!   not — refuses, or stays silent for [`TRY_LIMIT`] (a cut link): a member down costs one
//!   failed try, once, not a share of every request.
//! - Every call is bounded by a timeout; one the cluster cannot answer (its quorum lost) fails
//!   naming the endpoints.
//! - The store cannot check the job's secret (etcd's own users and TLS guard the cluster):
//!   peers prove it to one another on every connection of the mesh, as under torchrun's agent
//!   store.
//!
//! The client is the `etcd-client` crate (gRPC, async); a small multi-threaded tokio runtime
//! of its own runs it, so every call here is blocking like the rest of `Store`.

use crate::error::CommError;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use std::future::Future;
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a dead process's owned keys outlive it (etcd's own minimum is about 2 s).
pub const LEASE_TTL: Duration = Duration::from_secs(3);
/// Keep-alives go this often, and a member that has not answered one within
/// [`KEEPALIVE_ANSWER`] is left for the next: a member cut off (silent, not refusing) is
/// passed over well within the TTL.
const KEEPALIVE_EVERY: Duration = Duration::from_millis(500);
const KEEPALIVE_ANSWER: Duration = Duration::from_millis(500);
/// The longest one try of a request waits for a member before the next member is tried: a
/// member cut off answers nothing, and a request must not wait for it for its whole limit.
const TRY_LIMIT: Duration = Duration::from_secs(2);
const POLL_FIRST: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(50);
/// The longest one request may take before it counts as unanswered (a member without a leader
/// answers at once: `require_leader`).
const REQUEST_LIMIT: Duration = Duration::from_secs(10);
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Operations in one transaction (etcd's default `--max-txn-ops`).
const MAX_TXN_OPS: usize = 128;

/// A connection to the etcd cluster for one job.
pub(crate) struct EtcdKv {
    rt: tokio::runtime::Runtime,
    /// One client per member: a request goes to the member that answered last, and on to the
    /// next when it cannot. (The crate's one balanced client over every endpoint keeps sending
    /// a share of the requests to a dead member, each costing a failed try and a pause.)
    members: Vec<Client>,
    /// The member requests go to now.
    current: AtomicUsize,
    /// The endpoints as given, joined by commas (for messages).
    endpoints: String,
    lease: Mutex<Option<i64>>,
    local_ip: Option<IpAddr>,
}

impl EtcdKv {
    /// Connects to the cluster at `endpoints` ("host:port"), retrying until one member answers
    /// or `timeout` passes. `var` names the setting the endpoints came from.
    pub(crate) fn connect(
        endpoints: &[String],
        timeout: Duration,
        var: &str,
    ) -> Result<EtcdKv, CommError> {
        let joined = endpoints.join(",");
        let unreachable = |after: Duration, reason: String| CommError::StoreUnreachable {
            addr: format!("etcd {joined}"),
            var: var.to_string(),
            after,
            reason,
        };
        if endpoints.is_empty() {
            return Err(unreachable(Duration::ZERO, "no endpoint given".into()));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tandem-etcd")
            .enable_all()
            .build()
            .map_err(|e| unreachable(Duration::ZERO, format!("no runtime for the client: {e}")))?;
        let start = Instant::now();
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_require_leader(true);
        let members = rt
            .block_on(async {
                let mut members = Vec::with_capacity(endpoints.len());
                for e in endpoints {
                    members.push(Client::connect([e], Some(options.clone())).await?);
                }
                Ok::<_, etcd_client::Error>(members)
            })
            .map_err(|e| unreachable(start.elapsed(), e.to_string()))?;
        let kv = EtcdKv {
            rt,
            members,
            current: AtomicUsize::new(0),
            endpoints: joined.clone(),
            lease: Mutex::new(None),
            local_ip: endpoints.iter().find_map(|e| probe_local_ip(e)),
        };
        // The channel connects lazily: the first answer proves a member is up.
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            match kv.call(
                "connect",
                "",
                left.clamp(Duration::from_millis(100), REQUEST_LIMIT),
                |mut c| async move { c.get("tandem/", None).await.map(|_| ()) },
            ) {
                Ok(()) => return Ok(kv),
                Err(e) if start.elapsed() >= timeout => {
                    return Err(unreachable(start.elapsed(), e.to_string()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    pub(crate) fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// The local address of a connection to a member: one the other ranks can reach.
    pub(crate) fn local_ip(&self) -> Option<IpAddr> {
        self.local_ip
    }

    /// Runs one request on the runtime, bounded by `limit`. A member that cannot be reached or
    /// has no leader is answered by trying the next one (and this and later requests stay
    /// there), so one member down costs one retry, not an error; after a round of the members
    /// without an answer it pauses before the next. The last error is the one reported.
    fn call<T, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        limit: Duration,
        f: F,
    ) -> Result<T, CommError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let start = Instant::now();
        let mut tries = 0u32;
        let n = self.members.len();
        let attempts = async {
            loop {
                tries += 1;
                let i = self.current.load(Ordering::Relaxed) % n;
                let answer = tokio::time::timeout(TRY_LIMIT, f(self.members[i].clone())).await;
                // (A try that outlasts its limit counts as the member unreachable.)
                let answer = answer.unwrap_or_else(|_| {
                    Err(etcd_client::Error::IoError(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("member {i} did not answer within {TRY_LIMIT:?}"),
                    )))
                });
                match answer {
                    Err(e) if retryable(&e) && start.elapsed() + RETRY_PAUSE < limit => {
                        // (Another thread may have moved on already.)
                        let next = (i + 1) % n;
                        let _ = self.current.compare_exchange(
                            i,
                            next,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
                        if (tries as usize).is_multiple_of(n) {
                            tokio::time::sleep(RETRY_PAUSE).await
                        }
                    }
                    result => return result,
                }
            }
        };
        let result = self.rt.block_on(async { tokio::time::timeout(limit, attempts).await });
        let reason = match result {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if tries > 1 => format!(
                "the etcd cluster at {} had no member with a leader to answer within {limit:?} \
                 ({tries} tries: has it lost its quorum?); last error: {e}",
                self.endpoints
            ),
            Ok(Err(e)) => format!("the etcd cluster at {}: {e}", self.endpoints),
            Err(_) => format!(
                "no answer from the etcd cluster at {} within {limit:?} (has it lost its \
                 quorum?)",
                self.endpoints
            ),
        };
        Err(CommError::StoreIo { op, key: key.to_string(), reason })
    }

    /// The value and modification revision of `key` now.
    fn read(&self, op: &'static str, key: &str) -> Result<Option<(Vec<u8>, i64)>, CommError> {
        let mut resp =
            self.call(op, key, REQUEST_LIMIT, |mut c| async move { c.get(key, None).await })?;
        Ok(resp.take_kvs().into_iter().next().map(|kv| {
            let rev = kv.mod_revision();
            (kv.into_key_value().1, rev)
        }))
    }

    pub(crate) fn get_now(&self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        Ok(self.read("get", key)?.map(|(v, _)| v))
    }

    /// The value of `key`, polling until it is set or `wait` passes.
    pub(crate) fn get(&self, key: &str, wait: Duration) -> Result<Vec<u8>, CommError> {
        self.poll("get", wait, || Ok(self.read("get", key)?.map(|(v, _)| v).ok_or(key.to_string())))
    }

    /// Which of `keys` do not exist now: one transaction of reads per [`MAX_TXN_OPS`] keys.
    pub(crate) fn missing(&self, keys: &[String]) -> Result<Vec<String>, CommError> {
        let mut out = Vec::new();
        for chunk in keys.chunks(MAX_TXN_OPS) {
            let reads: Vec<TxnOp> = chunk
                .iter()
                .map(|k| TxnOp::get(k.as_str(), Some(GetOptions::new().with_keys_only())))
                .collect();
            let txn = Txn::new().and_then(reads);
            let answers = self.call("check", &chunk.join(","), REQUEST_LIMIT, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await.map(|r| r.op_responses()) }
            })?;
            for (k, answer) in chunk.iter().zip(answers) {
                if matches!(answer, TxnOpResponse::Get(r) if r.kvs().is_empty()) {
                    out.push(k.clone());
                }
            }
        }
        Ok(out)
    }

    /// Waits until every key exists, or fails naming those still missing after `wait`.
    pub(crate) fn wait(&self, keys: &[String], wait: Duration) -> Result<(), CommError> {
        let mut left: Vec<String> = keys.to_vec();
        self.poll("wait", wait, || {
            left = self.missing(&left)?;
            Ok(if left.is_empty() { Ok(()) } else { Err(left.join(",")) })
        })
    }

    /// Runs `attempt` every 5 ms growing to 50 ms until it gives a value (`Ok`) or `wait`
    /// passes; then the timeout names the keys of its last `Err`.
    fn poll<T>(
        &self,
        op: &'static str,
        wait: Duration,
        mut attempt: impl FnMut() -> Result<Result<T, String>, CommError>,
    ) -> Result<T, CommError> {
        let start = Instant::now();
        let mut pause = POLL_FIRST;
        loop {
            let missing = match attempt()? {
                Ok(v) => return Ok(v),
                Err(missing) => missing,
            };
            if start.elapsed() >= wait {
                return Err(CommError::StoreTimeout { op, key: missing, after: wait });
            }
            std::thread::sleep(pause.min(wait.saturating_sub(start.elapsed())));
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    pub(crate) fn set(&self, key: &str, value: &[u8], limit: Duration) -> Result<(), CommError> {
        self.call(
            "set",
            key,
            limit,
            |mut c| async move { c.put(key, value, None).await.map(|_| ()) },
        )
    }

    /// Sets `key` on this client's lease: it goes when the client is dropped or its process dies.
    /// A lease that ran out meanwhile (the process could reach no member for the TTL: its keys
    /// are gone) is replaced by a new one.
    pub(crate) fn set_owned(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let put = |lease: i64| {
            self.call("set_owned", key, REQUEST_LIMIT, |mut c| async move {
                c.put(key, value, Some(PutOptions::new().with_lease(lease))).await.map(|_| ())
            })
        };
        match put(self.lease()?) {
            Err(e) if e.to_string().contains("lease not found") => {
                *self.lease.lock().unwrap_or_else(|p| p.into_inner()) = None;
                put(self.lease()?)
            }
            other => other,
        }
    }

    /// This client's lease, granted (and its keep-alive started) on first use.
    fn lease(&self) -> Result<i64, CommError> {
        let mut held = self.lease.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = *held {
            return Ok(id);
        }
        let ttl = LEASE_TTL.as_secs() as i64;
        let id =
            self.call("set_owned", "", REQUEST_LIMIT, |mut c| async move {
                c.lease_grant(ttl, None).await
            })?
            .id();
        let start = self.current.load(Ordering::Relaxed);
        self.rt.spawn(keep_alive(self.members.clone(), start, id));
        *held = Some(id);
        Ok(id)
    }

    /// Adds `delta` to the integer at `key` (missing = 0): read, then put if nobody wrote since.
    pub(crate) fn add(&self, key: &str, delta: i64, limit: Duration) -> Result<i64, CommError> {
        let start = Instant::now();
        loop {
            let now = self.read("add", key)?;
            let (current, rev) = match &now {
                None => (0, 0),
                Some((v, rev)) => {
                    let n = std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok());
                    let n = n.ok_or_else(|| CommError::Protocol {
                        from: format!("etcd {}", self.endpoints),
                        reason: format!("store add {key:?}: value is not an integer"),
                    })?;
                    (n, *rev)
                }
            };
            let new = current.wrapping_add(delta);
            let unchanged = if now.is_none() {
                Compare::create_revision(key, CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(key, CompareOp::Equal, rev)
            };
            let txn =
                Txn::new().when([unchanged]).and_then([TxnOp::put(key, new.to_string(), None)]);
            let applied = self.call("add", key, REQUEST_LIMIT, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await.map(|r| r.succeeded()) }
            })?;
            if applied {
                return Ok(new);
            }
            if start.elapsed() >= limit {
                return Err(CommError::StoreTimeout {
                    op: "add",
                    key: key.to_string(),
                    after: limit,
                });
            }
        }
    }

    /// PyTorch's `compare_set`: sets `desired` if the value is `expected` (a missing key
    /// matches an empty `expected`); returns the value after the operation.
    pub(crate) fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        limit: Duration,
    ) -> Result<Vec<u8>, CommError> {
        let mut conditions = vec![Compare::value(key, CompareOp::Equal, expected)];
        if expected.is_empty() {
            // etcd's value comparison fails on a missing key: ask for that case first.
            conditions.insert(0, Compare::create_revision(key, CompareOp::Equal, 0));
        }
        for condition in conditions {
            let txn = Txn::new().when([condition]).and_then([TxnOp::put(key, desired, None)]);
            let applied = self.call("compare_set", key, limit, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await.map(|r| r.succeeded()) }
            })?;
            if applied {
                return Ok(desired.to_vec());
            }
        }
        Ok(self.read("compare_set", key)?.map(|(v, _)| v).unwrap_or_default())
    }

    /// Deletes `key`; returns whether it existed.
    pub(crate) fn delete(&self, key: &str) -> Result<bool, CommError> {
        self.call("delete", key, REQUEST_LIMIT, |mut c| async move {
            c.delete(key, None).await.map(|r| r.deleted() > 0)
        })
    }
}

impl Drop for EtcdKv {
    fn drop(&mut self) {
        let lease = *self.lease.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(id) = lease {
            // The owned keys go now rather than a TTL later; a cluster that cannot answer
            // within a second lets the TTL do it.
            let _ = self.call("drop", "", Duration::from_secs(1), |mut c| async move {
                c.lease_revoke(id).await.map(|_| ())
            });
        }
        // (The runtime, dropped next, stops the keep-alive task.)
    }
}

/// Keeps lease `id` alive until the runtime shuts down or the lease is found expired; a stream
/// whose member does not answer (dead, or cut off) is opened again on the next member at once,
/// every step bounded so that the lease never waits on a silent member.
async fn keep_alive(mut members: Vec<Client>, start: usize, id: i64) {
    let n = members.len();
    for turn in start.. {
        let client = &mut members[turn % n];
        let opened = tokio::time::timeout(KEEPALIVE_ANSWER * 2, client.lease_keep_alive(id)).await;
        if let Ok(Ok((mut keeper, mut stream))) = opened {
            loop {
                let sent = tokio::time::timeout(KEEPALIVE_ANSWER, keeper.keep_alive()).await;
                if !matches!(sent, Ok(Ok(()))) {
                    break;
                }
                match tokio::time::timeout(KEEPALIVE_ANSWER, stream.message()).await {
                    Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
                    // TTL 0: the lease expired (the process was stopped longer than the TTL).
                    Ok(Ok(Some(_))) => return,
                    _ => break,
                }
                tokio::time::sleep(KEEPALIVE_EVERY).await;
            }
        }
        // A pause only after a round of every member (the cluster may be electing a leader).
        if (turn + 1 - start).is_multiple_of(n) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Whether `e` may pass on another try: a member unreachable, restarting or without a leader
/// (gRPC's Unavailable), or the transport broken under the request.
fn retryable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
        ),
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// The local address of a TCP connection to `endpoint` ("host:port", an `http://` prefix
/// allowed), if one can be made within a second.
fn probe_local_ip(endpoint: &str) -> Option<IpAddr> {
    let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let addr = hostport.to_socket_addrs().ok()?.next()?;
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}
