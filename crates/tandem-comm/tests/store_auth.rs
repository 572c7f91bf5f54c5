//! The job secret at the store: only holders get in, both ways, and strangers (wrong secret, no
//! secret, raw bytes, silence, floods) neither get in nor disturb the job's own clients.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tandem_comm::{CommError, JobSecret, Store, StoreServer};

fn secret(byte: u8) -> JobSecret {
    JobSecret::from_bytes(&[byte; 32]).unwrap()
}

fn connect(addr: &str, secret: Option<&JobSecret>) -> Result<Store, CommError> {
    Store::connect(addr, "job", secret, Duration::from_secs(5), "test")
}

/// A raw frame as the store reads it (u32 little-endian length, payload).
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}

fn field(bytes: &[u8]) -> Vec<u8> {
    let mut f = (bytes.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(bytes);
    f
}

#[test]
fn holders_of_the_secret_get_in_and_others_are_refused_both_ways() {
    let ours = secret(1);
    let server = StoreServer::bind("127.0.0.1:0", "job", Some(&ours)).unwrap();
    let addr = server.local_addr().to_string();
    let member = connect(&addr, Some(&ours)).unwrap();
    member.set("k", b"v").unwrap();

    // Another secret: the server's proof does not check out, so the client stops first.
    let started = Instant::now();
    let e = connect(&addr, Some(&secret(2))).expect_err("another secret");
    assert!(matches!(e, CommError::AuthFailed { .. }), "{e}");
    assert!(e.to_string().contains("did not prove it holds this job's secret"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(3), "refused at once");
    // No secret at all: told what to set.
    let e = connect(&addr, None).expect_err("no secret");
    assert!(e.to_string().contains("TANDEM_SECRET_FILE"), "{e}");
    // A server without a secret is not trusted by a client holding one (an impostor could
    // hand out addresses).
    let open = StoreServer::bind("127.0.0.1:0", "job", None).unwrap();
    let e = connect(&open.local_addr().to_string(), Some(&ours)).expect_err("unauthenticated");
    assert!(e.to_string().contains("without a job secret"), "{e}");

    // The member never noticed.
    assert_eq!(member.get("k").unwrap(), b"v");
}

#[test]
fn a_forged_client_proof_is_closed_without_a_reply() {
    let ours = secret(1);
    let server = StoreServer::bind("127.0.0.1:0", "job", Some(&ours)).unwrap();
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = field(b"tandem-store/2");
    hello.extend(field(b"job"));
    hello.extend(field(&[7u8; 32]));
    raw.write_all(&frame(&hello)).unwrap();
    // The challenge comes back (nonce + the server's proof) ...
    let mut len = [0u8; 4];
    raw.read_exact(&mut len).unwrap();
    let mut challenge = vec![0u8; u32::from_le_bytes(len) as usize];
    raw.read_exact(&mut challenge).unwrap();
    assert_eq!(challenge[0], 9, "a challenge");
    // ... and a made-up answer gets the connection closed, nothing more.
    raw.write_all(&frame(&field(&[0u8; 32]))).unwrap();
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the server answered a forged proof with {rest:?}");
    // A replayed proof from another connection cannot help either: every challenge is fresh.
    let member = connect(&server.local_addr().to_string(), Some(&ours)).unwrap();
    member.set("after", b"1").unwrap();
}

#[test]
fn silent_and_garbage_connections_do_not_hold_up_members() {
    let ours = secret(3);
    let server = StoreServer::bind("127.0.0.1:0", "job", Some(&ours)).unwrap();
    let addr = server.local_addr().to_string();
    let silent: Vec<TcpStream> =
        (0..50).map(|_| TcpStream::connect(server.local_addr()).unwrap()).collect();
    let mut garbage = TcpStream::connect(server.local_addr()).unwrap();
    garbage.write_all(&[0xff; 64]).unwrap();
    let started = Instant::now();
    let member = connect(&addr, Some(&ours)).unwrap();
    member.set("k", b"v").unwrap();
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    drop(silent);
    // A stranger's hello may not be large: 1 MiB (well under the 16 MiB frames members may
    // send) is closed at once, before anything is allocated for it.
    let mut big = TcpStream::connect(server.local_addr()).unwrap();
    big.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    big.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(big.read(&mut buf).unwrap_or(0), 0, "closed without a reply");
}

#[test]
fn a_wait_longer_than_the_server_allows_is_clamped_not_a_crash() {
    // An unauthenticated server, reached with raw frames as any stranger could: GET with a
    // deadline of u64::MAX milliseconds used to overflow the server's clock arithmetic.
    let server = StoreServer::bind("127.0.0.1:0", "job", None).unwrap();
    let member = connect(&server.local_addr().to_string(), None).unwrap();
    member.set("k", b"v").unwrap();
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = field(b"tandem-store/2");
    hello.extend(field(b"job"));
    hello.extend(field(&[0u8; 32]));
    raw.write_all(&frame(&hello)).unwrap();
    let mut ok = [0u8; 5];
    raw.read_exact(&mut ok).unwrap();
    assert_eq!(ok, [1, 0, 0, 0, 0], "accepted");
    let mut get = vec![2u8];
    get.extend(field(b"k"));
    get.extend(u64::MAX.to_le_bytes());
    raw.write_all(&frame(&get)).unwrap();
    let mut reply = [0u8; 4 + 1 + 4 + 1];
    raw.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[4..5], &[0], "the value, not a dropped connection: {reply:?}");
    assert_eq!(&reply[9..], b"v");
}

#[test]
fn a_full_store_refuses_more_bytes_and_keeps_serving() {
    let server = StoreServer::bind("127.0.0.1:0", "job", None).unwrap();
    let store = connect(&server.local_addr().to_string(), None).unwrap();
    let big = vec![0u8; 15 << 20];
    let mut refused = None;
    for i in 0..20 {
        if let Err(e) = store.set(&format!("big/{i}"), &big) {
            refused = Some((i, e));
            break;
        }
    }
    let (at, e) = refused.expect("256 MiB is the cap: the 18th 15 MiB value is refused");
    assert_eq!(at, 17, "{e}");
    assert!(e.to_string().contains("more than its"), "{e}");
    // Deleting makes room again; small keys still work meanwhile.
    store.set("small", b"1").unwrap();
    assert!(store.delete("big/0").unwrap());
    store.set("big/again", &big).unwrap();
}

#[test]
fn get_now_answers_at_once_whether_or_not_the_key_is_set() {
    let server = StoreServer::bind("127.0.0.1:0", "job", None).unwrap();
    let store = connect(&server.local_addr().to_string(), None).unwrap();
    store.set_timeout(Duration::from_secs(30));
    let started = Instant::now();
    assert_eq!(store.get_now("missing").unwrap(), None);
    store.set("k", b"v").unwrap();
    assert_eq!(store.get_now("k").unwrap().as_deref(), Some(&b"v"[..]));
    assert!(started.elapsed() < Duration::from_secs(2), "waited {:?}", started.elapsed());
}
