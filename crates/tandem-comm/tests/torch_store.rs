//! tandem's client of PyTorch's `TCPStore` (torchrun's agent store), against live torch servers
//! of both backends (libuv, torch's default, and the classic one) started from Python: every
//! operation tandem uses, checked from both sides (what tandem writes, torch's own client reads,
//! and the other way round). Without torch these tests are reported as skipped, and CI sets
//! TANDEM_REQUIRE_TORCH=1 so they cannot be. Servers that answer something else — or nothing —
//! fail the handshake within its limit, with an error naming the address and what to set.
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tandem_comm::{CommError, Store, StoreServer, StoreWire};
use tandem_testutil::harness;

fn main() -> ExitCode {
    let torch = tandem_testutil::torch_python().is_none().then(|| {
        "no Python with torch (set TANDEM_PYTHON or create .venv-torch, see README)".to_string()
    });
    let mut tests = Vec::new();
    for t in tandem_testutil::tests![
        every_operation_against_torch_libuv_server,
        every_operation_against_torch_classic_server,
        tandem_handshake_to_a_torch_server_fails_fast_naming_the_variable,
    ] {
        tests.push(t.skip_if(torch.clone()));
    }
    tests.extend(tandem_testutil::tests![
        a_silent_server_fails_the_handshake_within_its_limit,
        a_server_answering_garbage_is_named_with_what_it_sent,
        tandem_store_closes_a_torch_handshake_and_the_error_says_so,
        a_silent_server_fails_tandem_handshake_naming_torchrun,
    ]);
    harness::main(tests)
}

/// A torch TCPStore server process with a torch client of the same store on its stdin/stdout.
struct TorchServer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    addr: String,
}

impl TorchServer {
    fn start(backend: &str) -> TorchServer {
        let python = tandem_testutil::torch_python().expect("torch");
        let script = tandem_testutil::workspace_root()
            .join("crates/tandem-comm/tests/scripts/torch_store_server.py");
        let mut child = Command::new(python)
            .arg(script)
            .arg(backend)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the torch store server");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words.first(), Some(&"port"), "server said {line:?}");
        // The backend asked for is the one serving.
        assert_eq!(words[3], if backend == "libuv" { "True" } else { "False" }, "{line}");
        let addr = format!("127.0.0.1:{}", words[1]);
        TorchServer { child, stdin, stdout, addr }
    }

    /// One command to torch's own client; its answer after "value " (or "ok").
    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        let line = line.trim();
        line.strip_prefix("value ").unwrap_or(line).to_string()
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn every_operation_against_torch_libuv_server() {
    every_operation("libuv");
}

fn every_operation_against_torch_classic_server() {
    every_operation("classic");
}

fn every_operation(backend: &str) {
    let mut torch = TorchServer::start(backend);
    let s = Store::connect_torch(&torch.addr, Duration::from_secs(10), "test").unwrap();
    assert_eq!(s.wire(), StoreWire::Torch);

    // set / get, both directions, binary values included.
    s.set("a", b"\x00\x01tandem\xff").unwrap();
    assert_eq!(torch.ask("get a"), hex(b"\x00\x01tandem\xff"));
    assert_eq!(torch.ask(&format!("set b {}", hex(b"from torch"))), "ok");
    assert_eq!(s.get("b").unwrap(), b"from torch");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");

    // add: torch's counters are decimal strings, shared with torch's client.
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -7).unwrap(), -2);
    assert_eq!(torch.ask("add n 10"), "8");
    assert_eq!(s.add_within("n", 0, Duration::from_secs(2)).unwrap(), 8);
    assert_eq!(s.get("n").unwrap(), b"8");

    // compare_set: missing + empty expected sets; a mismatch leaves the value.
    assert_eq!(s.compare_set("c", b"", b"first").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"wrong", b"second").unwrap(), b"first");
    assert_eq!(s.compare_set("c", b"first", b"third").unwrap(), b"third");
    assert_eq!(torch.ask("get c"), hex(b"third"));

    // delete
    assert!(s.delete("c").unwrap());
    assert!(!s.delete("c").unwrap());
    assert_eq!(torch.ask("check c"), "False");

    // check (missing): which keys are absent, none when all exist.
    assert_eq!(s.missing(&["a", "b"]).unwrap(), Vec::<String>::new());
    assert_eq!(s.missing(&["a", "nope", "b", "nada"]).unwrap(), vec!["nope", "nada"]);

    // multi_set / multi_get in one message each.
    s.multi_set(&[("m1", b"x".as_slice()), ("m2", b"yy".as_slice())]).unwrap();
    assert_eq!(torch.ask("get m2"), hex(b"yy"));
    assert_eq!(
        s.multi_get(&["m1", "m2", "a"]).unwrap(),
        vec![b"x".to_vec(), b"yy".to_vec(), b"\x00\x01tandem\xff".to_vec()]
    );

    // wait: returns once torch's client sets the key.
    let waiter = {
        let s = s.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            s.wait_timeout(&["late1", "late2"], Duration::from_secs(20)).map(|_| t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(torch.ask(&format!("set late1 {}", hex(b"1"))), "ok");
    assert_eq!(torch.ask(&format!("set late2 {}", hex(b"2"))), "ok");
    let waited = waiter.join().unwrap().unwrap();
    assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(10), "{waited:?}");

    // wait and get time out at their limit (the server's wait is cancelled), name the missing
    // key, and leave the connection usable.
    let t = Instant::now();
    let e = s.wait_timeout(&["a", "never"], Duration::from_millis(400)).expect_err("times out");
    assert!(t.elapsed() >= Duration::from_millis(350) && t.elapsed() < Duration::from_secs(4));
    assert!(matches!(&e, CommError::StoreTimeout { key, .. } if key == "never"), "{e}");
    s.set_timeout(Duration::from_millis(300));
    let e = s.get("never").expect_err("times out");
    assert!(matches!(&e, CommError::StoreTimeout { op: "get", key, .. } if key == "never"), "{e}");
    s.set_timeout(Duration::from_secs(10));
    assert_eq!(s.get("b").unwrap(), b"from torch", "the connection is usable after timeouts");

    // Prefixes read as torch's PrefixStore writes them: "prefix/key".
    let p = s.with_prefix("job").with_prefix("g0");
    p.set("k", b"scoped").unwrap();
    assert_eq!(torch.ask("get job/g0/k"), hex(b"scoped"));
    assert_eq!(p.add("count", 2).unwrap(), 2);
    assert_eq!(p.missing(&["k", "absent"]).unwrap(), vec!["absent"]);
    assert_eq!(p.multi_get(&["k"]).unwrap(), vec![b"scoped".to_vec()]);

    // Owned keys are tandem's alone: refused by name, not sent.
    let e = s.set_owned("mine", b"1").expect_err("refused");
    assert!(e.to_string().contains("PyTorch's TCPStore") && e.to_string().contains("mine"), "{e}");
}

fn tandem_handshake_to_a_torch_server_fails_fast_naming_the_variable() {
    let torch = TorchServer::start("libuv");
    let t = Instant::now();
    let e =
        Store::connect(&torch.addr, "run", None, Duration::from_secs(3), "MASTER_ADDR/MASTER_PORT")
            .expect_err("torch does not speak tandem's protocol");
    assert!(t.elapsed() < Duration::from_secs(6), "took {:?}", t.elapsed());
    let msg = e.to_string();
    assert!(msg.contains(&torch.addr) && msg.contains("MASTER_ADDR/MASTER_PORT"), "{msg}");
    assert!(msg.contains("TORCHELASTIC_USE_AGENT_STORE=True") || msg.contains("closed"), "{msg}");
}

/// A listener that accepts and then does `serve` with each connection.
fn fake_server(serve: fn(std::net::TcpStream)) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            std::thread::spawn(move || serve(c));
        }
    });
    addr
}

fn a_silent_server_fails_the_handshake_within_its_limit() {
    let addr = fake_server(|c| {
        std::thread::sleep(Duration::from_secs(30));
        drop(c);
    });
    let t = Instant::now();
    let e = Store::connect_torch(&addr, Duration::from_secs(2), "MASTER_ADDR/MASTER_PORT")
        .expect_err("nothing answers");
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_secs(5), "{took:?}");
    let msg = e.to_string();
    assert!(matches!(e, CommError::StoreHandshake { .. }), "{msg}");
    assert!(msg.contains(&addr) && msg.contains("nothing answered"), "{msg}");
    assert!(msg.contains("MASTER_ADDR/MASTER_PORT"), "{msg}");
    assert!(msg.contains("TORCHELASTIC_USE_AGENT_STORE"), "{msg}");
}

fn a_server_answering_garbage_is_named_with_what_it_sent() {
    let addr = fake_server(|mut c| {
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_secs(5));
    });
    let e = Store::connect_torch(&addr, Duration::from_secs(3), "test").expect_err("garbage");
    let msg = e.to_string();
    // The first bytes it sent, in hex ("HTTP" = 48 54 54 50).
    assert!(msg.contains("48 54 54 50") && msg.contains(&addr), "{msg}");
}

fn tandem_store_closes_a_torch_handshake_and_the_error_says_so() {
    let server = StoreServer::bind("127.0.0.1:0", "r", None).unwrap();
    let addr = server.local_addr().to_string();
    let t = Instant::now();
    let e = Store::connect_torch(&addr, Duration::from_secs(5), "test").expect_err("not torch");
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.contains("closed the connection") && msg.contains("not a PyTorch TCPStore"),
        "{msg}"
    );
}

fn a_silent_server_fails_tandem_handshake_naming_torchrun() {
    let addr = fake_server(|c| {
        std::thread::sleep(Duration::from_secs(30));
        drop(c);
    });
    let t = Instant::now();
    let e = Store::connect(&addr, "r", None, Duration::from_secs(2), "MASTER_ADDR/MASTER_PORT")
        .expect_err("nothing answers");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.contains(&addr) && msg.contains("nothing answered tandem's store handshake"),
        "{msg}"
    );
    assert!(msg.contains("TORCHELASTIC_USE_AGENT_STORE=True"), "{msg}");
}
