//! The store's server: a thread that accepts connections and one thread per admitted client,
//! over one table of keys (see the module above for the limits it keeps).

use super::wire::*;
use crate::auth::JobSecret;
use crate::frame::{
    read_frame, read_frame_at_most, write_frame, Dec, Enc, FrameError, MAX_HANDSHAKE_FRAME,
};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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
