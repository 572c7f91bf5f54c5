//! The store's client, [`Store`]: one connection shared by its clones, every operation bounded
//! by a timeout; speaks tandem's wire, PyTorch's `TCPStore` (`torch.rs`) and, with the `etcd`
//! feature, an etcd v3 cluster (`etcd.rs`).

use super::torch;
use super::wire::*;
use crate::auth::JobSecret;
use crate::error::CommError;
use crate::frame::{read_frame, write_frame, Dec, Enc, FrameError};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A client of the rendezvous store. Cheap to clone (one shared connection).
#[derive(Clone)]
pub struct Store {
    addr: String,
    link: Link,
    timeout_ms: Arc<AtomicU64>,
    wire: StoreWire,
    /// Prepended to every key (PyTorch's `PrefixStore`); empty by default.
    prefix: Arc<str>,
    /// The job's secret this client proved (the mesh and shared memory prove it again).
    secret: Option<JobSecret>,
}

/// What a store's requests travel on.
#[derive(Clone)]
enum Link {
    /// One TCP connection to tandem's store or PyTorch's TCPStore, shared by the clones.
    Tcp(Arc<Mutex<TcpStream>>),
    /// A client of an etcd cluster.
    #[cfg(feature = "etcd")]
    Etcd(Arc<super::etcd::EtcdKv>),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({}, {:?}, prefix {:?})", self.addr, self.wire, self.prefix)
    }
}

impl Store {
    /// Connects to tandem's store at `addr` ("host:port"), retrying until `timeout`; with
    /// `secret`, only to a store that proves it holds it (and proves this side does). `var`
    /// names the setting the address came from (for the error message).
    pub fn connect(
        addr: &str,
        run_id: &str,
        secret: Option<&JobSecret>,
        timeout: Duration,
        var: &str,
    ) -> Result<Store, CommError> {
        let s = tcp_connect(addr, timeout, var)?;
        Self::handshake(s, addr, run_id, secret, timeout, var)
    }

    /// Connects to a PyTorch `TCPStore` at `addr` (torchrun's agent store), retrying the TCP
    /// connection until `timeout`; the handshake itself must answer within [`HANDSHAKE_LIMIT`].
    pub fn connect_torch(addr: &str, timeout: Duration, var: &str) -> Result<Store, CommError> {
        let mut s = tcp_connect(addr, timeout, var)?;
        let io = |e: std::io::Error| CommError::StoreIo {
            op: "connect",
            key: String::new(),
            reason: format!("connection to {addr}: {e}"),
        };
        s.set_nodelay(true).map_err(io)?;
        let limit = timeout.min(HANDSHAKE_LIMIT);
        let fail = |what: String| CommError::StoreHandshake {
            addr: addr.to_string(),
            var: var.to_string(),
            reason: format!(
                "{what}; TORCHELASTIC_USE_AGENT_STORE=True (set by torchrun) says the store there \
                 is PyTorch's TCPStore: if this job was not started by torchrun, \
                 unset TORCHELASTIC_USE_AGENT_STORE or set it to False"
            ),
        };
        match torch::handshake(&mut s, limit) {
            // torch's TCPStore client writes every key as "/key": so do we, so that torch's
            // clients (and its PrefixStore) see the same names.
            Ok(()) => Ok(Store {
                prefix: Arc::from("/"),
                ..Store::new(addr, s, timeout, StoreWire::Torch)
            }),
            Err(torch::Handshake::Silent) => Err(fail(format!(
                "nothing answered PyTorch's TCPStore handshake (validate + check) within {limit:?}"
            ))),
            Err(torch::Handshake::Closed) => Err(fail(
                "the server closed the connection on PyTorch's TCPStore handshake (validate + \
                 check): it is not a PyTorch TCPStore, or one from before torch validated \
                 connections (0x3C85F7CE)"
                    .to_string(),
            )),
            Err(torch::Handshake::Answered(bytes)) => Err(fail(format!(
                "the server answered PyTorch's TCPStore handshake with {} instead of one byte, 0 \
                 or 1",
                hex(&bytes)
            ))),
            Err(torch::Handshake::Io(e)) => Err(io(e)),
        }
    }

    /// Connects to the etcd v3 cluster at `endpoints` ("host:port" each), retrying until a
    /// member answers or `timeout` passes; `var` names the setting they came from. etcd cannot
    /// check the job's secret: `secret` is kept for the connections built over this store (the
    /// mesh, shared memory), which prove it to each other. A build without the `etcd` feature
    /// answers with an error saying how to get one.
    pub fn connect_etcd(
        endpoints: &[String],
        secret: Option<&JobSecret>,
        timeout: Duration,
        var: &str,
    ) -> Result<Store, CommError> {
        #[cfg(feature = "etcd")]
        {
            let kv = super::etcd::EtcdKv::connect(endpoints, timeout, var)?;
            Ok(Store {
                addr: format!("etcd {}", kv.endpoints()),
                link: Link::Etcd(Arc::new(kv)),
                timeout_ms: Arc::new(AtomicU64::new(timeout.as_millis() as u64)),
                wire: StoreWire::Etcd,
                prefix: Arc::from(""),
                secret: secret.cloned(),
            })
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = (secret, timeout);
            Err(CommError::InvalidArgument {
                op: "etcd rendezvous",
                reason: format!(
                    "this build of tandem has no etcd client (TANDEM_RDZV_BACKEND=etcd or \
                     --rdzv-backend etcd; endpoints {} from {var}): build it with the `etcd` \
                     feature (cargo build --release --features etcd; protoc is needed at build \
                     time)",
                    endpoints.join(",")
                ),
            })
        }
    }

    /// The etcd client behind this store, if it is one.
    #[cfg(feature = "etcd")]
    fn etcd(&self) -> Option<&super::etcd::EtcdKv> {
        match &self.link {
            Link::Etcd(kv) => Some(kv),
            Link::Tcp(_) => None,
        }
    }

    /// The shared TCP connection, locked (every request of tandem's and torch's wire).
    fn conn(&self) -> Result<std::sync::MutexGuard<'_, TcpStream>, CommError> {
        match &self.link {
            Link::Tcp(conn) => Ok(conn.lock().unwrap_or_else(|p| p.into_inner())),
            #[cfg(feature = "etcd")]
            Link::Etcd(_) => Err(CommError::Protocol {
                from: self.addr.clone(),
                reason: "a TCP request was sent to an etcd store".into(),
            }),
        }
    }

    fn new(addr: &str, s: TcpStream, timeout: Duration, wire: StoreWire) -> Store {
        Store {
            addr: addr.to_string(),
            link: Link::Tcp(Arc::new(Mutex::new(s))),
            timeout_ms: Arc::new(AtomicU64::new(timeout.as_millis() as u64)),
            wire,
            prefix: Arc::from(""),
            secret: None,
        }
    }

    fn handshake(
        s: TcpStream,
        addr: &str,
        run_id: &str,
        secret: Option<&JobSecret>,
        timeout: Duration,
        var: &str,
    ) -> Result<Store, CommError> {
        let io = |e: std::io::Error| CommError::StoreIo {
            op: "connect",
            key: String::new(),
            reason: e.to_string(),
        };
        s.set_nodelay(true).map_err(io)?;
        let limit = timeout.min(HANDSHAKE_LIMIT).max(Duration::from_millis(1));
        s.set_read_timeout(Some(limit)).map_err(io)?;
        let mut s2 = s.try_clone().map_err(io)?;
        let nonce = crate::auth::nonce()?;
        write_frame(&mut s2, &Enc::default().bytes(MAGIC).str(run_id).bytes(&nonce).0)
            .map_err(io)?;
        let no_answer = |e: FrameError| match e {
            FrameError::Io(e) if torch::is_timeout(&e) => CommError::StoreHandshake {
                addr: addr.to_string(),
                var: var.to_string(),
                reason: format!(
                    "nothing answered tandem's store handshake within {limit:?}: the server \
                     there speaks another protocol; if it is torchrun's agent store (PyTorch's \
                     TCPStore), set TORCHELASTIC_USE_AGENT_STORE=True (torchrun sets it)"
                ),
            },
            e => frame_err(e, "connect", "", addr),
        };
        let first = read_frame(&mut s2).map_err(no_answer)?;
        let refused = |reason: String| CommError::AuthFailed {
            addr: addr.to_string(),
            var: var.to_string(),
            reason,
        };
        let resp = match crate::auth::answer(&mut s2, secret, &auth_context(run_id), &nonce, &first)
        {
            Ok(Some(reply)) => reply.to_vec(),
            // Proved both ways: the verdict on the run id follows. A server that closes now
            // refused our proof.
            Ok(None) => read_frame(&mut s2).map_err(|_| {
                refused("the store closed the connection: it holds another secret".into())
            })?,
            Err(why) => return Err(refused(format!("the store at {addr}: {why}"))),
        };
        let mut d = Dec(&resp);
        match d.u8() {
            Some(R_OK) => Ok(Store {
                secret: secret.cloned(),
                ..Store::new(addr, s, timeout, StoreWire::Tandem)
            }),
            Some(R_REFUSED) => {
                Err(CommError::RunIdMismatch { addr: addr.to_string(), ours: run_id.to_string() })
            }
            _ => Err(CommError::Protocol {
                from: addr.to_string(),
                reason: "bad handshake reply".into(),
            }),
        }
    }

    /// This store with `prefix` before every key (PyTorch's `PrefixStore`, whose keys read
    /// `prefix/key`); prefixes nest. Shares the connection.
    pub fn with_prefix(&self, prefix: &str) -> Store {
        Store { prefix: Arc::from(format!("{}{prefix}/", self.prefix)), ..self.clone() }
    }

    /// This store with `secret` for the connections built over it (the mesh, shared memory):
    /// for torch's agent store, which cannot check one itself.
    pub(crate) fn with_secret(self, secret: Option<JobSecret>) -> Store {
        Store { secret, ..self }
    }

    /// The job secret this client proved to the store (`None`: an unauthenticated job).
    pub fn secret(&self) -> Option<&JobSecret> {
        self.secret.as_ref()
    }

    /// The protocol this client speaks.
    pub fn wire(&self) -> StoreWire {
        self.wire
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// `key` as the caller named it (for errors and `missing`).
    fn unprefixed(&self, key: String) -> String {
        key.strip_prefix(&*self.prefix).map(str::to_string).unwrap_or(key)
    }

    /// A timeout naming its keys as the caller named them.
    #[cfg(feature = "etcd")]
    fn unprefixed_err(&self, e: CommError) -> CommError {
        match e {
            CommError::StoreTimeout { op, key, after } => {
                let key: Vec<String> =
                    key.split(',').map(|k| self.unprefixed(k.to_string())).collect();
                CommError::StoreTimeout { op, key: key.join(","), after }
            }
            e => e,
        }
    }

    /// The local address of the connection to the store: an address the other ranks can reach.
    pub(crate) fn local_ip(&self) -> Option<std::net::IpAddr> {
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.local_ip();
        }
        self.conn().ok()?.local_addr().ok().map(|a| a.ip())
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Sets the timeout of every later operation.
    pub fn set_timeout(&self, t: Duration) {
        self.timeout_ms.store(t.as_millis() as u64, Ordering::Relaxed);
    }

    fn request(
        &self,
        op: &'static str,
        key: &str,
        req: &[u8],
        wait: Duration,
    ) -> Result<Vec<u8>, CommError> {
        // The server answers a waiting request at its deadline; allow it some slack.
        self.request_within(op, key, req, wait, wait + Duration::from_secs(5))
    }

    fn request_within(
        &self,
        op: &'static str,
        key: &str,
        req: &[u8],
        wait: Duration,
        io_limit: Duration,
    ) -> Result<Vec<u8>, CommError> {
        self.request_on(self.conn()?, op, key, req, wait, io_limit)
    }

    fn request_on(
        &self,
        mut conn: std::sync::MutexGuard<'_, TcpStream>,
        op: &'static str,
        key: &str,
        req: &[u8],
        wait: Duration,
        io_limit: Duration,
    ) -> Result<Vec<u8>, CommError> {
        let io = |e: std::io::Error| CommError::StoreIo {
            op,
            key: key.to_string(),
            reason: e.to_string(),
        };
        conn.set_read_timeout(Some(io_limit)).map_err(io)?;
        conn.set_write_timeout(Some(io_limit)).map_err(io)?;
        let result = write_frame(&mut *conn, req)
            .map_err(io)
            .and_then(|_| read_frame(&mut *conn).map_err(|e| frame_err(e, op, key, &self.addr)));
        if result.is_err() {
            // The stream may be mid-frame: never reuse it.
            let _ = conn.shutdown(Shutdown::Both);
        }
        let resp = result?;
        match resp.first() {
            Some(&R_OK) => Ok(resp[1..].to_vec()),
            Some(&R_TIMEOUT) => Err(CommError::StoreTimeout {
                op,
                key: Dec(&resp[1..]).str().unwrap_or_else(|| key.to_string()),
                after: wait,
            }),
            _ => Err(CommError::Protocol {
                from: self.addr.clone(),
                reason: format!(
                    "store {op} {key:?}: {}",
                    Dec(resp.get(1..).unwrap_or(&[])).str().unwrap_or_default()
                ),
            }),
        }
    }

    /// Runs one torch-protocol exchange on the locked connection with `limit` on every read
    /// and write; a failed exchange closes the connection (it may be mid-message).
    fn torch_on<T>(
        &self,
        mut conn: std::sync::MutexGuard<'_, TcpStream>,
        op: &'static str,
        key: &str,
        limit: Duration,
        f: impl FnOnce(&mut TcpStream) -> std::io::Result<T>,
    ) -> Result<T, CommError> {
        let limit = limit.max(Duration::from_millis(1));
        let result = conn
            .set_read_timeout(Some(limit))
            .and_then(|_| conn.set_write_timeout(Some(limit)))
            .and_then(|_| f(&mut conn));
        result.map_err(|e| {
            let _ = conn.shutdown(Shutdown::Both);
            let reason = if torch::is_timeout(&e) {
                format!("no reply from {} within {limit:?}: {e}", self.addr)
            } else {
                format!("connection to {}: {e}", self.addr)
            };
            CommError::StoreIo { op, key: key.to_string(), reason }
        })
    }

    fn torch<T>(
        &self,
        op: &'static str,
        key: &str,
        limit: Duration,
        f: impl FnOnce(&mut TcpStream) -> std::io::Result<T>,
    ) -> Result<T, CommError> {
        self.torch_on(self.conn()?, op, key, limit, f)
    }

    /// Waits for `keys` (already prefixed) on a torch store; on timeout, names the missing ones.
    fn torch_wait(
        &self,
        op: &'static str,
        keys: &[String],
        timeout: Duration,
    ) -> Result<(), CommError> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let joined = keys.join(",");
        let ready = self.torch(op, &joined, timeout + Duration::from_secs(5), |s| {
            torch::wait(s, &refs, timeout)
        })?;
        if ready {
            return Ok(());
        }
        let missing: Vec<String> =
            self.torch_missing(&refs)?.into_iter().map(|k| self.unprefixed(k)).collect();
        Err(CommError::StoreTimeout { op, key: missing.join(","), after: timeout })
    }

    /// Which of `keys` (already prefixed) a torch store lacks: one `check` for all, then one
    /// per key when some are missing (torch's `check` answers a single yes or no).
    fn torch_missing(&self, keys: &[&str]) -> Result<Vec<String>, CommError> {
        let limit = self.timeout().min(HANDSHAKE_LIMIT);
        let joined = keys.join(",");
        self.torch("check", &joined, limit, |s| {
            if torch::check(s, keys)? {
                return Ok(Vec::new());
            }
            let mut missing = Vec::new();
            for k in keys {
                if !torch::check(s, &[k])? {
                    missing.push(k.to_string());
                }
            }
            Ok(missing)
        })
    }

    fn malformed(&self, op: &str) -> CommError {
        CommError::Protocol { from: self.addr.clone(), reason: format!("malformed {op} reply") }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.set_within(key, value, self.timeout())
    }

    /// Sets `key` for as long as this connection lives: the server deletes it when the
    /// connection closes (this process exited or was killed, or the client was dropped).
    /// tandem's store only: PyTorch's `TCPStore` has no such keys.
    pub fn set_owned(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        if self.wire == StoreWire::Torch {
            return Err(CommError::invalid(
                "set_owned",
                format!(
                    "key {key:?}: the store at {} is PyTorch's TCPStore, which has no keys owned \
                     by a connection (tandem's launcher hosts its own store for that)",
                    self.addr
                ),
            ));
        }
        let key = self.key(key);
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.set_owned(&key, value);
        }
        self.request(
            "set_owned",
            &key,
            &Enc::default().u8(OP_SET_OWNED).str(&key).bytes(value).0,
            self.timeout(),
        )?;
        Ok(())
    }

    /// Which of `keys` do not exist now (does not wait).
    pub fn missing(&self, keys: &[&str]) -> Result<Vec<String>, CommError> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return Ok(kv.missing(&full)?.into_iter().map(|k| self.unprefixed(k)).collect());
        }
        if self.wire == StoreWire::Torch {
            let refs: Vec<&str> = full.iter().map(String::as_str).collect();
            return Ok(self
                .torch_missing(&refs)?
                .into_iter()
                .map(|k| self.unprefixed(k))
                .collect());
        }
        let mut e = Enc::default().u8(OP_WAIT).u64(full.len() as u64);
        for k in &full {
            e = e.str(k);
        }
        let e = e.u64(0);
        match self.request("check", &full.join(","), &e.0, Duration::ZERO) {
            Ok(_) => Ok(Vec::new()),
            Err(CommError::StoreTimeout { key, .. }) => Ok(key
                .split(',')
                .filter(|k| !k.is_empty())
                .map(|k| self.unprefixed(k.to_string()))
                .collect()),
            Err(e) => Err(e),
        }
    }

    /// The value of `key`, waiting for it to be set (up to the store timeout).
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        let t = self.timeout();
        let key = self.key(key);
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.get(&key, t).map_err(|e| self.unprefixed_err(e));
        }
        if self.wire == StoreWire::Torch {
            self.torch_wait("get", std::slice::from_ref(&key), t)?;
            return self.torch("get", &key, t, |s| torch::get(s, &key));
        }
        let resp = self.request(
            "get",
            &key,
            &Enc::default().u8(OP_GET).str(&key).u64(t.as_millis() as u64).0,
            t,
        )?;
        Dec(&resp).bytes().map(|v| v.to_vec()).ok_or_else(|| self.malformed("get"))
    }

    /// The value of `key` if it is set now, without waiting (`None` when it is not). On
    /// PyTorch's store, which has no such request, a check then a get (a key deleted between
    /// the two waits for the store timeout).
    pub fn get_now(&self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        if self.wire == StoreWire::Torch {
            if !self.missing(&[key])?.is_empty() {
                return Ok(None);
            }
            return self.get(key).map(Some);
        }
        let full = self.key(key);
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.get_now(&full);
        }
        let req = Enc::default().u8(OP_GET).str(&full).u64(0).0;
        match self.request("get", &full, &req, Duration::ZERO) {
            Ok(resp) => {
                Dec(&resp).bytes().map(|v| Some(v.to_vec())).ok_or_else(|| self.malformed("get"))
            }
            Err(CommError::StoreTimeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The values of `keys` in order, waiting for all of them (up to the store timeout): one
    /// round trip on PyTorch's store (`multi_get`), one per key on tandem's.
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, CommError> {
        if self.wire != StoreWire::Torch {
            return keys.iter().map(|k| self.get(k)).collect();
        }
        let t = self.timeout();
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        self.torch_wait("multi_get", &full, t)?;
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.torch("multi_get", &full.join(","), t, |s| torch::multi_get(s, &refs))
    }

    /// Sets every pair: one message on PyTorch's store (`multi_set`), one per key on tandem's.
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), CommError> {
        if self.wire != StoreWire::Torch {
            return pairs.iter().try_for_each(|(k, v)| self.set(k, v));
        }
        let full: Vec<(String, &[u8])> = pairs.iter().map(|(k, v)| (self.key(k), *v)).collect();
        let refs: Vec<(&str, &[u8])> = full.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let joined: Vec<&str> = refs.iter().map(|p| p.0).collect();
        self.torch("multi_set", &joined.join(","), self.timeout(), |s| torch::multi_set(s, &refs))
    }

    /// Waits until every key exists (up to the store timeout).
    pub fn wait(&self, keys: &[&str]) -> Result<(), CommError> {
        self.wait_timeout(keys, self.timeout())
    }

    pub fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.wait(&full, timeout).map_err(|e| self.unprefixed_err(e));
        }
        if self.wire == StoreWire::Torch {
            return self.torch_wait("wait", &full, timeout);
        }
        let mut e = Enc::default().u8(OP_WAIT).u64(full.len() as u64);
        for k in &full {
            e = e.str(k);
        }
        let e = e.u64(timeout.as_millis() as u64);
        self.request("wait", &full.join(","), &e.0, timeout)?;
        Ok(())
    }

    /// Adds `delta` to the integer at `key` (missing = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let t = self.timeout();
        self.add_inner(key, delta, t, t + Duration::from_secs(5))
    }

    /// `add` that gives up after `limit` whatever the store timeout (for failure paths).
    pub fn add_within(&self, key: &str, delta: i64, limit: Duration) -> Result<i64, CommError> {
        self.add_inner(key, delta, limit, limit)
    }

    fn add_inner(
        &self,
        key: &str,
        delta: i64,
        wait: Duration,
        limit: Duration,
    ) -> Result<i64, CommError> {
        let key = self.key(key);
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.add(&key, delta, limit);
        }
        if self.wire == StoreWire::Torch {
            return self.torch("add", &key, limit, |s| torch::add(s, &key, delta));
        }
        let req = Enc::default().u8(OP_ADD).str(&key).u64(delta as u64).0;
        let resp = self.request_within("add", &key, &req, wait, limit)?;
        Dec(&resp).u64().map(|v| v as i64).ok_or_else(|| self.malformed("add"))
    }

    /// `set` that gives up after `limit` whatever the store timeout (for failure paths).
    pub fn set_within(&self, key: &str, value: &[u8], limit: Duration) -> Result<(), CommError> {
        let key = self.key(key);
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.set(&key, value, limit);
        }
        if self.wire == StoreWire::Torch {
            return self.torch("set", &key, limit, |s| torch::set(s, &key, value));
        }
        let req = Enc::default().u8(OP_SET).str(&key).bytes(value).0;
        self.request_within("set", &key, &req, limit, limit)?;
        Ok(())
    }

    /// `compare_set` that gives up after `limit` (used on failure paths, which must stay fast).
    pub(crate) fn compare_set_within(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        limit: Duration,
    ) -> Result<Vec<u8>, CommError> {
        // (One arm without the `etcd` feature.)
        #[allow(clippy::infallible_destructuring_match)]
        let conn = match &self.link {
            Link::Tcp(conn) => conn,
            #[cfg(feature = "etcd")]
            Link::Etcd(kv) => return kv.compare_set(&self.key(key), expected, desired, limit),
        };
        // Never queue behind another thread's long `wait` on the shared connection.
        let conn = match conn.try_lock() {
            Ok(c) => c,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(CommError::StoreIo {
                    op: "compare_set",
                    key: key.to_string(),
                    reason: "connection busy".into(),
                })
            }
        };
        self.compare_set_on(conn, key, expected, desired, limit)
    }

    fn compare_set_on(
        &self,
        conn: std::sync::MutexGuard<'_, TcpStream>,
        key: &str,
        expected: &[u8],
        desired: &[u8],
        limit: Duration,
    ) -> Result<Vec<u8>, CommError> {
        let key = self.key(key);
        if self.wire == StoreWire::Torch {
            return self.torch_on(conn, "compare_set", &key, limit, |s| {
                torch::compare_set(s, &key, expected, desired)
            });
        }
        let req = Enc::default().u8(OP_CAS).str(&key).bytes(expected).bytes(desired).0;
        let resp = self.request_on(conn, "compare_set", &key, &req, limit, limit)?;
        Dec(&resp).bytes().map(|v| v.to_vec()).ok_or_else(|| self.malformed("compare_set"))
    }

    /// Sets `key` to `desired` if its value is `expected` (a missing key matches an empty
    /// `expected`); returns the value after the operation (PyTorch's `compare_set`).
    pub fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, CommError> {
        let t = self.timeout();
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.compare_set(&self.key(key), expected, desired, t);
        }
        self.compare_set_on(self.conn()?, key, expected, desired, t + Duration::from_secs(5))
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, CommError> {
        let key = self.key(key);
        let t = self.timeout();
        #[cfg(feature = "etcd")]
        if let Some(kv) = self.etcd() {
            return kv.delete(&key);
        }
        if self.wire == StoreWire::Torch {
            return self.torch("delete", &key, t, |s| torch::delete(s, &key));
        }
        let resp = self.request("delete", &key, &Enc::default().u8(OP_DELETE).str(&key).0, t)?;
        Dec(&resp).u8().map(|v| v != 0).ok_or_else(|| self.malformed("delete"))
    }
}

/// Opens a TCP connection to `addr`, retrying refused or unresolvable addresses until `timeout`
/// (the server may not be up yet).
fn tcp_connect(addr: &str, timeout: Duration, var: &str) -> Result<TcpStream, CommError> {
    let start = Instant::now();
    let mut last_err = String::from("no attempt made");
    loop {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    let left =
                        timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(50));
                    match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(5))) {
                        Ok(s) => return Ok(s),
                        Err(e) => last_err = e.to_string(),
                    }
                }
            }
            Err(e) => last_err = format!("cannot resolve: {e}"),
        }
        if start.elapsed() >= timeout {
            return Err(CommError::StoreUnreachable {
                addr: addr.to_string(),
                var: var.to_string(),
                after: start.elapsed(),
                reason: last_err,
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Up to 16 bytes as hex, for messages about what a server sent.
fn hex(bytes: &[u8]) -> String {
    let shown: Vec<String> = bytes.iter().take(16).map(|b| format!("{b:02x}")).collect();
    let more = if bytes.len() > 16 { " ..." } else { "" };
    format!("{} byte(s) [{}{more}]", bytes.len(), shown.join(" "))
}

fn frame_err(e: FrameError, op: &'static str, key: &str, addr: &str) -> CommError {
    match e {
        FrameError::TooLarge(len) => {
            CommError::FrameTooLarge { len, max: crate::frame::MAX_FRAME, from: addr.to_string() }
        }
        FrameError::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            CommError::StoreIo {
                op,
                key: key.to_string(),
                reason: format!("no reply from {addr}: {e}"),
            }
        }
        FrameError::Io(e) => CommError::StoreIo {
            op,
            key: key.to_string(),
            reason: format!("connection to {addr}: {e}"),
        },
    }
}
