//! PyTorch's `TCPStore` wire protocol, client side: what tandem speaks to torchrun's agent store
//! (`TORCHELASTIC_USE_AGENT_STORE=True`). Facts from torch 2.x's `TCPStoreBackend.hpp` (the
//! query codes), `TCPStore.cpp` (the client) and `TCPStoreLibUvBackend.cpp` (the default
//! server since 2.4); checked against live servers of both backends in `tests/torch_store.rs`.
//!
//! The protocol: a connection opens with `VALIDATE` + the u32 magic `0x3C85F7CE` (no reply;
//! a server closes or ignores a client that gets it wrong); tandem then asks `CHECK` of one key,
//! which every validating server answers with one byte — the handshake. Every request is one
//! query byte and its arguments, all in the host's (little-endian) byte order: strings and byte values as a u64 length and the bytes,
//! counts as u64, numbers as i64. `SET` and `MULTI_SET` get no reply. `GET` of a missing key is
//! an error on the server, so `get` waits for the key first (as torch's client does). `WAIT`
//! answers one byte when the keys exist; a client that gives up sends `CANCEL_WAIT` and reads
//! `WAIT_CANCELED` (possibly after a late `STOP_WAITING`). Older torch servers, without
//! `VALIDATE` (every code one lower), fail the handshake, and the error says so.
//!
//! Hand-written: no crate speaks this protocol (it is torch's internal wire format).
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::frame::MAX_FRAME;

const MAGIC: u32 = 0x3C85_F7CE;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE_KEY: u8 = 8;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;

const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// How long the server has to answer a `CANCEL_WAIT` (it answers at once when alive).
const CANCEL_LIMIT: Duration = Duration::from_secs(5);

/// One request, built in memory and sent with one write.
struct Query(Vec<u8>);

impl Query {
    fn new(code: u8) -> Query {
        Query(vec![code])
    }
    fn u32(mut self, v: u32) -> Query {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Query {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Query {
        let mut q = self.u64(b.len() as u64);
        q.0.extend_from_slice(b);
        q
    }
    fn keys<'a>(self, keys: impl ExactSizeIterator<Item = &'a str>) -> Query {
        let mut q = self.u64(keys.len() as u64);
        for k in keys {
            q = q.bytes(k.as_bytes());
        }
        q
    }
    fn send(self, s: &mut TcpStream) -> io::Result<()> {
        s.write_all(&self.0)?;
        s.flush()
    }
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

fn read_u8(s: &mut TcpStream) -> io::Result<u8> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_i64(s: &mut TcpStream) -> io::Result<i64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

/// A length-prefixed byte vector, refused above [`MAX_FRAME`] before allocating.
fn read_vec(s: &mut TcpStream) -> io::Result<Vec<u8>> {
    let len = read_i64(s)? as u64;
    if len > MAX_FRAME as u64 {
        return Err(invalid(format!("a {len}-byte value exceeds the {MAX_FRAME}-byte limit")));
    }
    let mut v = vec![0u8; len as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// Why a handshake failed, in words for the user.
#[derive(Debug)]
pub(crate) enum Handshake {
    /// Nothing came back within the limit.
    Silent,
    /// The server closed the connection.
    Closed,
    /// Something answered, but not one byte 0 or 1.
    Answered(Vec<u8>),
    Io(io::Error),
}

/// The key the handshake asks about (any key would do: the answer is "not there" or "there").
const HANDSHAKE_KEY: &str = "/tandem/handshake";

/// Validates the connection, then asks `check` of one key: any torch `TCPStore` that validates
/// connections answers it with one byte, 0 or 1. (`PING` would do as well on recent servers, but
/// those of the first releases that validate connections do not know it.)
pub(crate) fn handshake(s: &mut TcpStream, limit: Duration) -> Result<(), Handshake> {
    s.set_read_timeout(Some(limit.max(Duration::from_millis(1)))).map_err(Handshake::Io)?;
    // Both queries in one write: the server reads them in order.
    let mut hello = Query::new(VALIDATE).u32(MAGIC);
    hello.0.extend(Query::new(CHECK).keys([HANDSHAKE_KEY].into_iter()).0);
    hello.send(s).map_err(Handshake::Io)?;
    let mut answer = [0u8; 1];
    match s.read(&mut answer) {
        Ok(0) => Err(Handshake::Closed),
        Ok(_) if matches!(answer[0], READY | NOT_READY) => Ok(()),
        Ok(_) => {
            // Read whatever else came, to show it.
            let mut rest = [0u8; 15];
            s.set_read_timeout(Some(Duration::from_millis(100))).map_err(Handshake::Io)?;
            let n = s.read(&mut rest).unwrap_or(0);
            let mut got = answer.to_vec();
            got.extend_from_slice(&rest[..n]);
            Err(Handshake::Answered(got))
        }
        Err(e) if is_timeout(&e) => Err(Handshake::Silent),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => Err(Handshake::Closed),
        Err(e) => Err(Handshake::Io(e)),
    }
}

pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

pub(crate) fn set(s: &mut TcpStream, key: &str, value: &[u8]) -> io::Result<()> {
    Query::new(SET).bytes(key.as_bytes()).bytes(value).send(s)
}

pub(crate) fn multi_set(s: &mut TcpStream, pairs: &[(&str, &[u8])]) -> io::Result<()> {
    let mut q = Query::new(MULTI_SET).u64(pairs.len() as u64);
    for (k, v) in pairs {
        q = q.bytes(k.as_bytes()).bytes(v);
    }
    q.send(s)
}

/// The value of `key`, which must exist (call [`wait`] first).
pub(crate) fn get(s: &mut TcpStream, key: &str) -> io::Result<Vec<u8>> {
    Query::new(GET).bytes(key.as_bytes()).send(s)?;
    read_vec(s)
}

/// The values of `keys`, which must all exist (call [`wait`] first).
pub(crate) fn multi_get(s: &mut TcpStream, keys: &[&str]) -> io::Result<Vec<Vec<u8>>> {
    Query::new(MULTI_GET).keys(keys.iter().copied()).send(s)?;
    keys.iter().map(|_| read_vec(s)).collect()
}

pub(crate) fn add(s: &mut TcpStream, key: &str, delta: i64) -> io::Result<i64> {
    Query::new(ADD).bytes(key.as_bytes()).u64(delta as u64).send(s)?;
    read_i64(s)
}

/// Torch's compare-and-set: returns the value after the operation. (A missing key with a
/// non-empty `expected` answers `expected` itself: torch's server does so.)
pub(crate) fn compare_set(
    s: &mut TcpStream,
    key: &str,
    expected: &[u8],
    desired: &[u8],
) -> io::Result<Vec<u8>> {
    Query::new(COMPARE_SET).bytes(key.as_bytes()).bytes(expected).bytes(desired).send(s)?;
    read_vec(s)
}

pub(crate) fn delete(s: &mut TcpStream, key: &str) -> io::Result<bool> {
    Query::new(DELETE_KEY).bytes(key.as_bytes()).send(s)?;
    Ok(read_i64(s)? > 0)
}

/// Whether every key exists now (does not wait).
pub(crate) fn check(s: &mut TcpStream, keys: &[&str]) -> io::Result<bool> {
    Query::new(CHECK).keys(keys.iter().copied()).send(s)?;
    match read_u8(s)? {
        READY => Ok(true),
        NOT_READY => Ok(false),
        b => Err(invalid(format!("check answered {b}, expected 0 (ready) or 1 (not ready)"))),
    }
}

/// Waits up to `limit` for every key; `Ok(false)` when the wait was cancelled at the limit.
/// The connection's read timeout is left changed.
pub(crate) fn wait(s: &mut TcpStream, keys: &[&str], limit: Duration) -> io::Result<bool> {
    Query::new(WAIT).keys(keys.iter().copied()).send(s)?;
    s.set_read_timeout(Some(limit.max(Duration::from_millis(1))))?;
    match read_u8(s) {
        Ok(STOP_WAITING) => return Ok(true),
        Ok(b) => return Err(invalid(format!("wait answered {b}, expected 0 (stop waiting)"))),
        Err(e) if is_timeout(&e) => {}
        Err(e) => return Err(e),
    }
    Query::new(CANCEL_WAIT).send(s)?;
    s.set_read_timeout(Some(CANCEL_LIMIT))?;
    match read_u8(s)? {
        WAIT_CANCELED => Ok(false),
        // The keys arrived just before the cancel: the server still confirms it.
        STOP_WAITING => match read_u8(s)? {
            WAIT_CANCELED => Ok(true),
            b => Err(invalid(format!("cancel answered {b}, expected 1 (wait cancelled)"))),
        },
        b => Err(invalid(format!("cancel answered {b}, expected 1 (wait cancelled)"))),
    }
}
