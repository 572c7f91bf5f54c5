//! The rendezvous store: every operation, timeouts, run-id refusal and bounded frames.
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use tandem_comm::{CommError, Store, StoreServer};

fn pair(run: &str) -> (StoreServer, Store) {
    let server = StoreServer::bind("127.0.0.1:0", run, None).unwrap();
    let addr = server.local_addr().to_string();
    let client = Store::connect(&addr, run, None, Duration::from_secs(5), "test").unwrap();
    (server, client)
}

#[test]
fn set_get_add_compare_set_delete() {
    let (_server, s) = pair("r");
    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a").unwrap(), b"1");
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -2).unwrap(), 3);
    assert!(s.add("a", 1).is_ok()); // "1" parses as an integer
    s.set("txt", b"hello").unwrap();
    assert!(matches!(s.add("txt", 1), Err(CommError::Protocol { .. })));
    // compare_set: PyTorch semantics
    assert_eq!(s.compare_set("c", b"", b"first").unwrap(), b"first"); // missing + empty expected
    assert_eq!(s.compare_set("c", b"wrong", b"second").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"first", b"third").unwrap(), b"third");
    assert!(s.delete("c").unwrap());
    assert!(!s.delete("c").unwrap());
    // a second client sees the same table
    let s2 = s.clone();
    assert_eq!(s2.get("txt").unwrap(), b"hello");
}

#[test]
fn get_and_wait_block_until_set_or_timeout() {
    let (server, s) = pair("r");
    let addr = server.local_addr().to_string();
    let setter = std::thread::spawn(move || {
        let c = Store::connect(&addr, "r", None, Duration::from_secs(5), "test").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        c.set("late", b"v").unwrap();
        c.set("late2", b"w").unwrap();
    });
    s.wait(&["late", "late2"]).unwrap();
    assert_eq!(s.get("late").unwrap(), b"v");
    setter.join().unwrap();
    s.set_timeout(Duration::from_millis(300));
    let t = Instant::now();
    let e = s.get("never").expect_err("times out");
    assert!(t.elapsed() >= Duration::from_millis(250) && t.elapsed() < Duration::from_secs(3));
    assert!(matches!(&e, CommError::StoreTimeout { op: "get", key, .. } if key == "never"), "{e}");
    let e =
        s.wait_timeout(&["late", "missing"], Duration::from_millis(200)).expect_err("times out");
    assert!(e.to_string().contains("missing") && !e.to_string().contains("late,"), "{e}");
}

#[test]
fn another_run_is_refused_and_learns_nothing_of_ours() {
    let server = StoreServer::bind("127.0.0.1:0", "job-1", None).unwrap();
    let e = Store::connect(
        &server.local_addr().to_string(),
        "job-2",
        None,
        Duration::from_secs(5),
        "MASTER_PORT",
    )
    .expect_err("refused");
    let msg = e.to_string();
    assert!(
        matches!(e, CommError::RunIdMismatch { .. })
            && msg.contains("job-2")
            && !msg.contains("job-1"),
        "{msg}"
    );
}

#[test]
fn client_retries_until_the_server_appears() {
    let port = tandem_testutil::free_port();
    let addr = format!("127.0.0.1:{port}");
    let a2 = addr.clone();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        StoreServer::bind(&a2, "r", None).unwrap()
    });
    let s = Store::connect(&addr, "r", None, Duration::from_secs(10), "test").unwrap();
    s.set("k", b"v").unwrap();
    drop(late.join().unwrap());
}

#[test]
fn hostile_length_prefix_is_dropped_and_server_keeps_serving() {
    let (server, s) = pair("r");
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap(); // claims a 4 GiB handshake
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "server must close the connection");
    s.set("still", b"alive").unwrap();
    assert_eq!(s.get("still").unwrap(), b"alive");
}

#[test]
fn client_refuses_an_oversized_reply() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        if let Ok((mut c, _)) = listener.accept() {
            let mut b = [0u8; 256];
            let _ = c.read(&mut b);
            let _ = c.write_all(&(1u32 << 31).to_le_bytes());
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let e =
        Store::connect(&addr, "r", None, Duration::from_secs(5), "test").expect_err("oversized");
    assert!(matches!(e, CommError::FrameTooLarge { len: 2147483648, .. }), "{e}");
}

#[test]
fn owned_keys_vanish_with_their_connection() {
    let (server, watcher) = pair("r");
    let addr = server.local_addr().to_string();
    let owner = Store::connect(&addr, "r", None, Duration::from_secs(5), "test").unwrap();
    owner.set_owned("alive/a", b"host-a").unwrap();
    watcher.set("plain", b"x").unwrap();
    assert_eq!(watcher.get("alive/a").unwrap(), b"host-a");
    assert!(watcher.missing(&["alive/a", "plain"]).unwrap().is_empty());
    assert_eq!(watcher.missing(&["alive/a", "nope"]).unwrap(), vec!["nope".to_string()]);
    drop(owner);
    // The server notices the closed connection promptly and removes only the owned key.
    let start = Instant::now();
    while watcher.missing(&["alive/a"]).unwrap().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(5), "owned key outlived its connection");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(watcher.missing(&["plain"]).unwrap().is_empty());
}
