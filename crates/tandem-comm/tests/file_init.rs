//! `file://` init (PyTorch's `init_method="file:///path"`): ranks meet through a file rank 0
//! writes; without a launcher's secret the file carries a fresh one, so the store refuses
//! anyone who did not read it; a stale file from an earlier run is waited out; the file is gone
//! once the world formed; a rank waiting for a rank 0 that never comes names the file.
use std::path::{Path, PathBuf};
use std::time::Duration;
use tandem_comm::{
    init_with, InitMethod, InitOptions, ProcessGroup, ReduceOp, Store, TransportKind,
};

fn opts(secret: bool) -> InitOptions {
    let mut o = tandem_testutil::test_options(TransportKind::Tcp);
    o.init_timeout = Duration::from_secs(20);
    if !secret {
        o.secret = None;
    }
    o
}

fn start(
    path: &Path,
    rank: usize,
    n: usize,
    o: InitOptions,
) -> std::thread::JoinHandle<Result<Vec<f32>, String>> {
    let method = InitMethod::from_url(&format!("file://{}", path.display()), rank, n).unwrap();
    std::thread::spawn(move || {
        let pg: ProcessGroup = init_with(&method, &o).map_err(|e| e.to_string())?;
        let mut v = vec![pg.rank() as f32 + 1.0; 5];
        pg.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| e.to_string())?;
        pg.barrier().map_err(|e| e.to_string())?;
        Ok(v)
    })
}

fn wait_for(path: &Path) -> String {
    for _ in 0..400 {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("{} never appeared", path.display());
}

fn line<'a>(text: &'a str, name: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .trim()
}

#[test]
fn ranks_meet_through_the_file_which_carries_a_secret_and_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("rendezvous");
    let rank0 = start(&path, 0, 3, opts(false));
    let text = wait_for(&path);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    let (addr, secret) = (line(&text, "addr "), line(&text, "secret "));
    assert_eq!(secret.len(), 64, "a fresh secret in hex: {text}");
    // Someone who knows the address but did not read the secret is refused.
    let stranger = Store::connect(addr, "test-run", None, Duration::from_secs(2), "a stranger");
    let Err(e) = stranger else { panic!("a store without the secret must refuse") };
    let e = e.to_string();
    assert!(e.contains("refused"), "{e}");
    let others: Vec<_> = (1..3).map(|r| start(&path, r, 3, opts(false))).collect();
    let results: Vec<_> =
        std::iter::once(rank0).chain(others).map(|h| h.join().unwrap().unwrap()).collect();
    assert!(results.iter().all(|v| v == &vec![6.0; 5]), "{results:?}");
    assert!(!path.exists(), "rank 0 removes the file once the world formed");
}

#[test]
fn a_launchers_secret_stays_out_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rendezvous");
    // Rank 1 starts once the file is read: the world cannot form (and remove the file) before.
    let rank0 = start(&path, 0, 2, opts(true));
    let text = wait_for(&path);
    let rank1 = start(&path, 1, 2, opts(true));
    assert_eq!(line(&text, "secret "), "-", "{text}");
    assert_eq!(rank0.join().unwrap().unwrap(), vec![3.0; 5]);
    assert_eq!(rank1.join().unwrap().unwrap(), vec![3.0; 5]);
}

#[test]
fn a_stale_file_from_an_earlier_run_is_waited_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rendezvous");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let stale =
        format!("tandem-file-init/1\naddr {dead}\nrun test-run\nsecret {}\n", "ab".repeat(32));
    std::fs::write(&path, stale).unwrap();
    let rank1 = start(&path, 1, 2, opts(false));
    std::thread::sleep(Duration::from_millis(700));
    let rank0 = start(&path, 0, 2, opts(false));
    assert_eq!(rank1.join().unwrap().unwrap(), vec![3.0; 5]);
    assert_eq!(rank0.join().unwrap().unwrap(), vec![3.0; 5]);
}

#[test]
fn waiting_for_a_rank_0_that_never_comes_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("never");
    let mut o = opts(false);
    o.init_timeout = Duration::from_secs(1);
    let e = start(&path, 1, 2, o).join().unwrap().unwrap_err();
    assert!(e.contains(&format!("init file {}", path.display())), "{e}");
    assert!(e.contains("does not exist yet"), "{e}");
}
