//! The rendezvous key-value store (PyTorch's `TCPStore`): a server thread in rank 0 (or the
//! launcher) and clients in every rank. Operations: set, get (waits for the key), wait for keys,
//! add, compare-and-set, delete — each bounded by a timeout. A key set with `set_owned` lives as
//! long as the connection that set it (a ZooKeeper-style ephemeral node): launchers use it to see
//! at once that another node's launcher died, since the kernel closes a dead process's sockets.
//!
//! Every connection starts with a handshake: the run id, and — when the server holds the job's
//! secret — a challenge–response both ways (`auth.rs`); a stranger is closed at once and
//! logged with its address, and learns nothing of the job. The server is bounded: frames (see
//! `frame::MAX_FRAME`), connections, keys and stored bytes are capped, a connection that has not
//! finished its handshake within [`HANDSHAKE_LIMIT`] is closed, waits are clamped, and accept
//! errors (out of descriptors) back off instead of spinning.
mod torch;

use crate::auth::JobSecret;
use crate::error::CommError;
use crate::frame::{
    read_frame, read_frame_at_most, write_frame, Dec, Enc, FrameError, MAX_HANDSHAKE_FRAME,
};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8] = b"tandem-store/2";
/// Open connections a server serves at once (each has a thread); more are closed at once.
const MAX_CONNECTIONS: usize = 1024;
/// Keys a server holds.
const MAX_KEYS: usize = 1 << 20;
/// Bytes of keys and values a server holds.
const MAX_STORED_BYTES: usize = 256 << 20;
/// The longest a GET or WAIT may ask the server to wait (a client asking for more is clamped:
/// it learns of the timeout and asks again, or reports it).
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const OP_CAS: u8 = 5;
const OP_DELETE: u8 = 6;
const OP_SET_OWNED: u8 = 7;
const R_OK: u8 = 0;
const R_REFUSED: u8 = 1;
const R_TIMEOUT: u8 = 2;
const R_ERROR: u8 = 3;

struct Table {
    map: Mutex<Entries>,
    changed: Condvar,
    /// The longest a GET or WAIT waits ([`MAX_WAIT`]; zero when fuzzing, where nothing else
    /// could ever set the key).
    max_wait: Duration,
}

impl Table {
    fn new(max_wait: Duration) -> Table {
        Table { map: Mutex::default(), changed: Condvar::new(), max_wait }
    }
}

/// The stored keys, with the bytes they hold counted as they change.
#[derive(Default)]
struct Entries {
    map: HashMap<String, Vec<u8>>,
    bytes: usize,
}

impl std::ops::Deref for Entries {
    type Target = HashMap<String, Vec<u8>>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl Entries {
    /// Why `key = value` would not fit (the store is full), if so.
    fn full(&self, key: &str, value: usize) -> Option<String> {
        let old = self.map.get(key).map(|v| key.len() + v.len());
        if old.is_none() && self.map.len() >= MAX_KEYS {
            return Some(format!("the store holds {MAX_KEYS} keys already"));
        }
        let after = self.bytes - old.unwrap_or(0) + key.len() + value;
        (after > MAX_STORED_BYTES).then(|| {
            format!("the store would hold {after} bytes, more than its {MAX_STORED_BYTES}")
        })
    }

    fn insert(&mut self, key: String, value: Vec<u8>) {
        let added = key.len() + value.len();
        let key_len = key.len();
        if let Some(old) = self.map.insert(key, value) {
            self.bytes -= key_len + old.len();
        }
        self.bytes += added;
    }

    fn remove(&mut self, key: &str) -> Option<Vec<u8>> {
        let old = self.map.remove(key)?;
        self.bytes -= key.len() + old.len();
        Some(old)
    }
}

/// Live connection threads; a slot is given back when its connection ends.
struct Slots(Arc<std::sync::atomic::AtomicUsize>);

impl Slots {
    fn take(count: &Arc<std::sync::atomic::AtomicUsize>) -> Option<Slots> {
        let taken = count.fetch_add(1, Ordering::AcqRel);
        if taken >= MAX_CONNECTIONS {
            count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slots(count.clone()))
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The server side, hosted by rank 0 (or a launcher). Stops accepting when dropped.
pub struct StoreServer {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    id: String,
}

/// Key under which every server stores its own [`StoreServer::id`], so a client can tell
/// which server it reached.
pub const SERVER_ID_KEY: &str = "__server_id";

impl StoreServer {
    /// Binds `addr` ("host:port"; port 0 picks a free one) and serves clients of `run_id`; with
    /// `secret`, only clients that prove they hold it.
    pub fn bind(
        addr: &str,
        run_id: &str,
        secret: Option<&JobSecret>,
    ) -> std::io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::new(MAX_WAIT));
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = format!("{}-{}-{nanos}", std::process::id(), local);
        table
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(SERVER_ID_KEY.to_string(), id.clone().into_bytes());
        let job = Arc::new(Job { run_id: run_id.to_string(), secret: secret.cloned() });
        let stop2 = stop.clone();
        let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        std::thread::Builder::new().name("tandem-store".into()).spawn(move || {
            let mut backoff = Duration::from_millis(10);
            for conn in listener.incoming() {
                if stop2.load(Ordering::Acquire) {
                    break;
                }
                let conn = match conn {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Out of descriptors or memory: wait for some to come back rather than
                        // spin on the error.
                        tracing::warn!(
                            "store {local}: accept failed: {e}; retrying in {backoff:?}"
                        );
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                        continue;
                    }
                };
                backoff = Duration::from_millis(10);
                let Some(slot) = Slots::take(&live) else {
                    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!(
                        "store {local}: closed a connection from {peer}: {MAX_CONNECTIONS} open"
                    );
                    continue;
                };
                let table = table.clone();
                let job = job.clone();
                let _ =
                    std::thread::Builder::new().name("tandem-store-conn".into()).spawn(move || {
                        serve_client(conn, &table, &job);
                        drop(slot);
                    });
            }
        })?;
        Ok(StoreServer { addr: local, stop, id })
    }

    /// Unique to this server (process, address, start time); clients read it at
    /// [`SERVER_ID_KEY`].
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so the thread ends.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Who a server serves.
struct Job {
    run_id: String,
    secret: Option<JobSecret>,
}

/// The context every store proof is bound to (a mesh proof cannot stand in for it).
fn auth_context(run_id: &str) -> String {
    format!("store/{run_id}")
}

fn serve_client(mut conn: TcpStream, table: &Table, job: &Job) {
    let _ = conn.set_nodelay(true);
    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    // Until the handshake is done, a silent or slow peer holds its thread at most this long.
    let _ = conn.set_read_timeout(Some(HANDSHAKE_LIMIT));
    let _ = conn.set_write_timeout(Some(HANDSHAKE_LIMIT));
    if !admit(&mut conn, job, &peer) {
        return;
    }
    // A member of the job: its connection may stay idle between operations for as long as the
    // job runs, and a large reply to it may take longer than a handshake.
    let _ = conn.set_read_timeout(None);
    let _ = conn.set_write_timeout(None);
    let Ok(wconn) = conn.try_clone() else { return };
    let mut r = BufReader::new(conn);
    let mut w = BufWriter::new(wconn);
    serve_member(&mut r, &mut w, table, &peer);
}

/// Serves a member's requests until its connection ends; then the keys it owned go.
fn serve_member(r: &mut impl Read, w: &mut impl Write, table: &Table, peer: &str) {
    let mut owned = Vec::new();
    serve_requests(r, w, table, peer, &mut owned);
    if !owned.is_empty() {
        let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
        for key in owned {
            map.remove(&key);
        }
        drop(map);
        table.changed.notify_all();
    }
}

/// The handshake, server side: magic, run id and the client's nonce, then (with a secret) the
/// challenge. True when the peer is a member of the job (and has been told so).
fn admit<S: Read + Write>(conn: &mut S, job: &Job, peer: &str) -> bool {
    let Ok(hello) = read_frame_at_most(conn, MAX_HANDSHAKE_FRAME) else {
        tracing::warn!("store: closed a connection from {peer}: no handshake");
        return false;
    };
    let mut d = Dec(&hello);
    let ok_magic = d.bytes() == Some(MAGIC);
    let theirs = d.str().unwrap_or_default();
    let client_nonce = d.bytes().unwrap_or_default();
    if let Some(secret) = &job.secret {
        if let Err(why) =
            crate::auth::challenge(conn, secret, &auth_context(&job.run_id), client_nonce)
        {
            tracing::warn!("store: refused a connection from {peer}: {why}");
            return false;
        }
    }
    if !ok_magic || theirs != job.run_id {
        // Nothing of ours goes back: not the run id, not why.
        tracing::warn!("store: refused a connection from {peer}: another run id or protocol");
        let _ = write_frame(conn, &Enc::default().u8(R_REFUSED).0);
        return false;
    }
    write_frame(conn, &Enc::default().u8(R_OK).0).is_ok()
}

/// Runs the server side of one connection whose client sends `data` (the store's handshake
/// and requests, as frames), with or without a secret, on a fresh table whose waits end at
/// once. For the fuzz targets: any bytes must give refusals or answers, never a panic.
#[doc(hidden)]
pub fn fuzz_store_session(data: &[u8], with_secret: bool) {
    let job = Job {
        run_id: "fuzz".into(),
        secret: with_secret.then(|| JobSecret::from_bytes(&[7; 32]).expect("a valid secret")),
    };
    let table = Table::new(Duration::ZERO);
    let mut conn = crate::auth::Duplex::new(data);
    if admit(&mut conn, &job, "fuzz") {
        let (input, output) = conn.halves();
        serve_member(input, output, &table, "fuzz");
    }
}

fn serve_requests(
    r: &mut impl Read,
    w: &mut impl Write,
    table: &Table,
    peer: &str,
    owned: &mut Vec<String>,
) {
    loop {
        let req = match read_frame(r) {
            Ok(req) => req,
            Err(FrameError::TooLarge(n)) => {
                tracing::warn!("store: {peer} sent a {n}-byte frame; closing the connection");
                return;
            }
            Err(FrameError::Io(_)) => return,
        };
        if req.first() == Some(&OP_SET_OWNED) {
            if let Some(key) = Dec(&req[1..]).str() {
                owned.push(key);
            }
        }
        let resp = handle(&req, table)
            .unwrap_or_else(|| Enc::default().u8(R_ERROR).str("malformed request").0);
        if write_frame(w, &resp).is_err() {
            return;
        }
    }
}

fn wait_until<'a>(
    table: &'a Table,
    deadline: Instant,
    mut ready: impl FnMut(&HashMap<String, Vec<u8>>) -> bool,
) -> (std::sync::MutexGuard<'a, Entries>, bool) {
    let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if ready(&map) {
            return (map, true);
        }
        let now = Instant::now();
        if now >= deadline {
            return (map, false);
        }
        map = table.changed.wait_timeout(map, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
}

/// When a wait of `ms` milliseconds (the client's choice) ends, clamped to `max`.
fn deadline_in(ms: u64, max: Duration) -> Instant {
    Instant::now() + Duration::from_millis(ms).min(max)
}

fn handle(req: &[u8], table: &Table) -> Option<Vec<u8>> {
    let mut d = Dec(req);
    let op = d.u8()?;
    let resp = match op {
        OP_SET | OP_SET_OWNED => {
            let key = d.str()?;
            let val = d.bytes()?.to_vec();
            let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(why) = map.full(&key, val.len()) {
                return Some(Enc::default().u8(R_ERROR).str(&why).0);
            }
            map.insert(key, val);
            drop(map);
            table.changed.notify_all();
            Enc::default().u8(R_OK)
        }
        OP_GET => {
            let key = d.str()?;
            let deadline = deadline_in(d.u64()?, table.max_wait);
            let (map, ok) = wait_until(table, deadline, |m| m.contains_key(&key));
            match (ok, map.get(&key)) {
                (true, Some(v)) => Enc::default().u8(R_OK).bytes(v),
                _ => Enc::default().u8(R_TIMEOUT).str(&key),
            }
        }
        OP_WAIT => {
            let n = d.u64()? as usize;
            let mut keys = Vec::new();
            for _ in 0..n.min(1 << 16) {
                keys.push(d.str()?);
            }
            let deadline = deadline_in(d.u64()?, table.max_wait);
            let (map, ok) = wait_until(table, deadline, |m| keys.iter().all(|k| m.contains_key(k)));
            if ok {
                Enc::default().u8(R_OK)
            } else {
                let missing: Vec<&str> =
                    keys.iter().filter(|k| !map.contains_key(*k)).map(|k| k.as_str()).collect();
                Enc::default().u8(R_TIMEOUT).str(&missing.join(","))
            }
        }
        OP_ADD => {
            let key = d.str()?;
            let delta = d.u64()? as i64;
            let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
            let cur = match map.get(&key) {
                None => 0,
                Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()) {
                    Some(x) => x,
                    None => {
                        return Some(Enc::default().u8(R_ERROR).str("value is not an integer").0)
                    }
                },
            };
            let new = cur.wrapping_add(delta);
            let text = new.to_string().into_bytes();
            if let Some(why) = map.full(&key, text.len()) {
                return Some(Enc::default().u8(R_ERROR).str(&why).0);
            }
            map.insert(key, text);
            drop(map);
            table.changed.notify_all();
            Enc::default().u8(R_OK).u64(new as u64)
        }
        OP_CAS => {
            let key = d.str()?;
            let expected = d.bytes()?;
            let desired = d.bytes()?;
            let mut map = table.map.lock().unwrap_or_else(|p| p.into_inner());
            // PyTorch semantics: a missing key matches an empty `expected`.
            let matches = match map.get(&key) {
                None => expected.is_empty(),
                Some(cur) => cur.as_slice() == expected,
            };
            if matches {
                if let Some(why) = map.full(&key, desired.len()) {
                    return Some(Enc::default().u8(R_ERROR).str(&why).0);
                }
                map.insert(key.clone(), desired.to_vec());
            }
            let cur = map.get(&key).cloned().unwrap_or_default();
            drop(map);
            table.changed.notify_all();
            Enc::default().u8(R_OK).bytes(&cur)
        }
        OP_DELETE => {
            let key = d.str()?;
            let existed =
                table.map.lock().unwrap_or_else(|p| p.into_inner()).remove(&key).is_some();
            Enc::default().u8(R_OK).u8(existed as u8)
        }
        _ => Enc::default().u8(R_ERROR).str("unknown operation"),
    };
    Some(resp.0)
}

/// The protocol a store speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreWire {
    /// tandem's own (`tandem run`, rank 0 of a tandem job): run-id handshake, owned keys.
    Tandem,
    /// PyTorch's `TCPStore` (torchrun's agent store): see `store/torch.rs`.
    Torch,
}

/// The longest a connection waits for the server's first answer: a server that speaks another
/// protocol stays silent, and a rank must not wait the whole init timeout to learn that.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// A client of the rendezvous store. Cheap to clone (one shared connection).
#[derive(Clone)]
pub struct Store {
    addr: String,
    conn: Arc<Mutex<TcpStream>>,
    timeout_ms: Arc<AtomicU64>,
    wire: StoreWire,
    /// Prepended to every key (PyTorch's `PrefixStore`); empty by default.
    prefix: Arc<str>,
    /// The job's secret this client proved (the mesh and shared memory prove it again).
    secret: Option<JobSecret>,
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

    fn new(addr: &str, s: TcpStream, timeout: Duration, wire: StoreWire) -> Store {
        Store {
            addr: addr.to_string(),
            conn: Arc::new(Mutex::new(s)),
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

    /// The local address of the connection to the store: an address the other ranks can reach.
    pub(crate) fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).local_addr().ok().map(|a| a.ip())
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
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        self.request_on(conn, op, key, req, wait, io_limit)
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
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        self.torch_on(conn, op, key, limit, f)
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
        if self.wire == StoreWire::Tandem {
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
        if self.wire == StoreWire::Tandem {
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
        // Never queue behind another thread's long `wait` on the shared connection.
        let conn = match self.conn.try_lock() {
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
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let t = self.timeout();
        self.compare_set_on(conn, key, expected, desired, t + Duration::from_secs(5))
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, CommError> {
        let key = self.key(key);
        let t = self.timeout();
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
