//! `file://` rendezvous (PyTorch's `init_method="file:///path"`): rank 0 hosts tandem's store and
//! writes where it listens into the file — and, in a job that no launcher gave a secret, a fresh
//! one, so the store and the mesh still admit only processes that could read the file. The file
//! is written whole (a private temporary file renamed over it, mode 0600) and removed by rank 0
//! once every rank has joined, so a later run cannot find a stale one. The other ranks poll for
//! it; a stale file from a crashed run (an address nobody answers at, another secret) is read
//! again until rank 0 replaces it or the init timeout passes. Put the file where only the job's
//! user can read it: reading it is joining the job.
use crate::auth::JobSecret;
use crate::env::InitOptions;
use crate::error::CommError;
use crate::net::host_port;
use crate::store::{Store, StoreServer};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAGIC: &str = "tandem-file-init/1";
/// A rendezvous file holds three short lines; anything longer is not one.
const MAX_FILE_BYTES: u64 = 4096;

/// What the file says.
#[derive(Debug, PartialEq)]
struct Contents {
    addr: String,
    run_id: String,
    secret: Option<String>,
}

fn render(c: &Contents) -> String {
    let secret = c.secret.as_deref().unwrap_or("-");
    format!("{MAGIC}\naddr {}\nrun {}\nsecret {secret}\n", c.addr, c.run_id)
}

fn parse(text: &str) -> Result<Contents, String> {
    let mut lines = text.lines();
    if lines.next() != Some(MAGIC) {
        return Err(format!("does not start with {MAGIC:?} (not a tandem rendezvous file)"));
    }
    let mut field = |name: &str| {
        lines
            .next()
            .and_then(|l| l.strip_prefix(name))
            .and_then(|v| v.strip_prefix(' '))
            .map(str::to_string)
            .ok_or_else(|| format!("has no `{name}` line"))
    };
    let addr = field("addr")?;
    let run_id = field("run")?;
    let secret = Some(field("secret")?).filter(|s| s != "-");
    Ok(Contents { addr, run_id, secret })
}

fn read(path: &Path) -> Result<Option<Contents>, String> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len > MAX_FILE_BYTES {
        return Err(format!("is {len} bytes, more than a rendezvous file's {MAX_FILE_BYTES}"));
    }
    if len == 0 {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    parse(&text).map(Some)
}

/// Writes `text` to `path` whole: a private temporary file beside it, renamed over it.
fn write_whole(path: &Path, text: &str) -> std::io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("rendezvous");
    let tmp = path.with_file_name(format!(".{name}.tandem-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The store this rank joins through the file, rank 0's server, and the options the rest of
/// the rendezvous uses (the file's secret where the launcher gave none).
pub(crate) struct Joined {
    pub store: Store,
    pub server: Option<Arc<StoreServer>>,
    pub opts: InitOptions,
    /// The file rank 0 removes once the world is formed.
    pub owned_file: Option<PathBuf>,
}

pub(crate) fn join(path: &Path, rank: usize, opts: &InitOptions) -> Result<Joined, CommError> {
    let via = format!("init file {}", path.display());
    let fail = |why: String| CommError::rendezvous("w", format!("{via}: {why}"));
    let mut opts = opts.clone();
    if rank == 0 {
        let fresh = match &opts.secret {
            Some(_) => None,
            None => Some(JobSecret::generate()?),
        };
        let secret = opts.secret.clone().or(fresh.clone());
        let ip = crate::net::advertised_ip(opts.socket_ifname.as_deref())?;
        let server =
            StoreServer::bind(&host_port(&ip.to_string(), 0), &opts.run_id, secret.as_ref())
                .map_err(|e| fail(format!("rank 0 cannot host the store on {ip}: {e}")))?;
        let addr = host_port(&ip.to_string(), server.local_addr().port());
        let contents = Contents {
            addr: addr.clone(),
            run_id: opts.run_id.clone(),
            secret: fresh.as_ref().map(JobSecret::to_hex),
        };
        write_whole(path, &render(&contents)).map_err(|e| fail(format!("cannot write it: {e}")))?;
        opts.secret = secret;
        let store =
            Store::connect(&addr, &opts.run_id, opts.secret.as_ref(), opts.init_timeout, &via);
        let store = store.inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        })?;
        return Ok(Joined {
            store,
            server: Some(Arc::new(server)),
            opts,
            owned_file: Some(path.to_path_buf()),
        });
    }
    let deadline = Instant::now() + opts.init_timeout;
    let mut last = "it does not exist yet (is rank 0 running, with the same path?)".to_string();
    while Instant::now() < deadline {
        match read(path) {
            Ok(Some(c)) => {
                let secret = match (&opts.secret, &c.secret) {
                    (Some(s), _) => Some(s.clone()),
                    (None, Some(hex)) => Some(
                        JobSecret::from_hex(hex)
                            .map_err(|e| fail(format!("bad secret line: {e}")))?,
                    ),
                    (None, None) => None,
                };
                // A stale file names a store nobody answers at: try briefly, then read again.
                let left = deadline.saturating_duration_since(Instant::now());
                match Store::connect(
                    &c.addr,
                    &opts.run_id,
                    secret.as_ref(),
                    left.min(Duration::from_secs(3)),
                    &via,
                ) {
                    Ok(store) => {
                        opts.secret = secret;
                        return Ok(Joined { store, server: None, opts, owned_file: None });
                    }
                    Err(e) => last = format!("it names the store {} ({e})", c.addr),
                }
            }
            Ok(None) => {}
            Err(why) => last = why,
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(fail(format!("no store joined within {:?}: {last}", opts.init_timeout)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_round_trips_and_anything_else_is_refused() {
        let c = Contents {
            addr: "10.0.0.1:4242".into(),
            run_id: "job".into(),
            secret: Some("ab".into()),
        };
        assert_eq!(parse(&render(&c)).unwrap(), c);
        let none = Contents { secret: None, ..c };
        assert_eq!(parse(&render(&none)).unwrap(), none);
        assert!(parse("hello\n").unwrap_err().contains("not a tandem rendezvous file"));
        assert!(parse(&format!("{MAGIC}\naddr x\n")).unwrap_err().contains("no `run` line"));
    }

    #[test]
    fn the_file_is_private_and_replaced_whole() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("init");
        std::fs::write(&path, "stale").unwrap();
        write_whole(&path, "fresh").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "fresh");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file left");
        std::fs::write(&path, vec![b'x'; 5000]).unwrap();
        assert!(read(&path).unwrap_err().contains("more than a rendezvous file's 4096"));
    }
}
