//! TCP transport: a full mesh of sockets between the ranks of a group (rank i connects to every
//! lower rank; addresses are published in the store), non-blocking, with send and receive
//! driven together by `poll(2)` so a ring step overlaps both directions. Every connection starts
//! with a handshake carrying the run id and group, and — in a job with a secret — a
//! challenge–response both ways; strangers are closed and logged. Each incoming handshake runs
//! on its own thread with its own time limit, so a silent connection cannot stall the others.
use super::{FailKind, PeerError, Recv, Transport};
use crate::error::CommError;
use crate::frame::{read_frame, read_frame_at_most, write_frame, Dec, Enc, MAX_HANDSHAKE_FRAME};
use crate::store::Store;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const MAGIC: &[u8] = b"tandem-mesh/2";
/// Receive buffer for reductions (multiple of every element size).
const SCRATCH: usize = 256 << 10;

pub(crate) struct TcpMesh {
    peers: Vec<Option<TcpStream>>,
    scratch: Vec<u8>,
}

fn tune(s: &TcpStream) -> std::io::Result<()> {
    // Socket buffers stay auto-tuned: fixed sizes measured slower on loopback here.
    s.set_nodelay(true)
}

/// The least time one incoming connection is given for its handshake; it gets all the time
/// left until the mesh's deadline when that is longer (a silent peer holds only its own
/// handshake thread, never the others'). Not less: on a lossy link a connection whose SYN was
/// lost retransmits its data every 3 s, 6 s, ... (Linux's fallback RTO), so two more losses of
/// the hello alone take 10 s (seen at 10% loss, 1 trial in 12).
const HELLO_LIMIT: Duration = Duration::from_secs(10);
/// Incoming connections being handshaken at once; more are closed at once.
const MAX_PENDING_HELLOS: usize = 64;

/// What a handshake was about: a proof for one group of one run is worth nothing elsewhere.
fn auth_context(run_id: &str, group: &str) -> String {
    format!("mesh/{run_id}/{group}")
}

/// Builds the mesh for group `group` (store key prefix) of `size` ranks. With the store's job
/// secret, every connection proves it both ways before any byte of data moves.
pub(crate) fn connect_mesh(
    store: &Store,
    group: &str,
    rank: usize,
    size: usize,
    run_id: &str,
    local_ip: IpAddr,
    timeout: Duration,
) -> Result<TcpMesh, CommError> {
    let rv = |reason: String| CommError::rendezvous(group, reason);
    let listener = TcpListener::bind(SocketAddr::new(local_ip, 0))
        .map_err(|e| rv(format!("cannot listen on {local_ip}: {e}")))?;
    let my_addr = listener.local_addr().map_err(|e| rv(e.to_string()))?;
    store.set(&format!("{group}/addr/{rank}"), my_addr.to_string().as_bytes())?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let secret = store.secret();
    let context = auth_context(run_id, group);

    for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
        let addr =
            String::from_utf8_lossy(&store.get(&format!("{group}/addr/{peer}"))?).to_string();
        let sa: SocketAddr = addr
            .parse()
            .map_err(|_| rv(format!("rank {peer} published a bad address {addr:?}")))?;
        let left =
            deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        let mut s = TcpStream::connect_timeout(&sa, left)
            .map_err(|e| rv(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
        s.set_read_timeout(Some(left)).map_err(|e| rv(e.to_string()))?;
        let nonce = crate::auth::nonce()?;
        let hello =
            Enc::default().bytes(MAGIC).str(run_id).str(group).u64(rank as u64).bytes(&nonce).0;
        write_frame(&mut s, &hello).map_err(|e| rv(format!("handshake with rank {peer}: {e}")))?;
        let handshake = |e| rv(format!("handshake with rank {peer} at {addr}: {e:?}"));
        let first = read_frame(&mut s).map_err(handshake)?;
        let verdict = match crate::auth::answer(&mut s, secret, &context, &nonce, &first) {
            Ok(Some(reply)) => reply.to_vec(),
            Ok(None) => read_frame(&mut s).map_err(handshake)?,
            Err(why) => {
                return Err(CommError::AuthFailed {
                    addr: addr.clone(),
                    var: format!("rank {peer} of group {group}"),
                    reason: why.to_string(),
                })
            }
        };
        if verdict.first() != Some(&0) {
            return Err(rv(format!(
                "rank {peer} at {addr} refused the connection (another run, group or rank)"
            )));
        }
        *slot = Some(s);
    }

    listener.set_nonblocking(true).map_err(|e| rv(e.to_string()))?;
    let (done, arrived) = std::sync::mpsc::channel::<Option<(usize, TcpStream)>>();
    let mut pending = 0usize;
    let mut missing = size - rank - 1;
    while missing > 0 {
        while let Ok(result) = arrived.try_recv() {
            pending -= 1;
            let Some((r, s)) = result else { continue };
            if peers[r].is_some() {
                tracing::warn!("mesh {group}: a second connection claims rank {r}; closed");
                continue;
            }
            peers[r] = Some(s);
            missing -= 1;
        }
        if missing == 0 {
            break;
        }
        match listener.accept() {
            Ok((s, from)) => {
                if pending >= MAX_PENDING_HELLOS {
                    tracing::warn!("mesh {group}: closed a connection from {from}: {pending} handshakes pending");
                    continue;
                }
                pending += 1;
                let (done, secret, context) = (done.clone(), secret.cloned(), context.clone());
                let (run_id, group) = (run_id.to_string(), group.to_string());
                let limit = deadline.saturating_duration_since(Instant::now()).max(HELLO_LIMIT);
                std::thread::spawn(move || {
                    let who = (from, rank, size);
                    let joined = admit(s, who, limit, &run_id, &group, secret.as_ref(), &context);
                    let _ = done.send(joined);
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let who: Vec<usize> =
                        (rank + 1..size).filter(|&r| peers[r].is_none()).collect();
                    return Err(rv(format!("ranks {who:?} did not connect within {timeout:?}")));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                // Out of descriptors: the job cannot form now, but wait for the deadline rather
                // than spin.
                tracing::warn!("mesh {group}: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    for s in peers.iter().flatten() {
        s.set_read_timeout(None).map_err(|e| rv(e.to_string()))?;
        s.set_nonblocking(true).map_err(|e| rv(e.to_string()))?;
        tune(s).map_err(|e| rv(e.to_string()))?;
    }
    Ok(TcpMesh { peers, scratch: Vec::new() })
}

/// One incoming connection's handshake (on its own thread, within `limit`): the peer's rank if
/// it is a rank of this group above ours that proved the job's secret; otherwise it is closed
/// and logged with its address (nothing of ours is sent back but a refusal byte).
fn admit(
    mut s: TcpStream,
    (from, rank, size): (SocketAddr, usize, usize),
    limit: Duration,
    run_id: &str,
    group: &str,
    secret: Option<&crate::auth::JobSecret>,
    context: &str,
) -> Option<(usize, TcpStream)> {
    s.set_nonblocking(false).ok()?;
    s.set_read_timeout(Some(limit)).ok()?;
    s.set_write_timeout(Some(limit)).ok()?;
    match check_hello(&mut s, (rank, size), run_id, group, secret, context) {
        Ok(r) => Some((r, s)),
        Err(why) => {
            tracing::warn!("mesh {group}: refused a connection from {from}: {why}");
            None
        }
    }
}

/// The hello and (with a secret) the challenge, on any stream: the peer's rank, or why it was
/// refused (a refusal byte has been sent where one is due).
fn check_hello<S: Read + Write>(
    s: &mut S,
    (rank, size): (usize, usize),
    run_id: &str,
    group: &str,
    secret: Option<&crate::auth::JobSecret>,
    context: &str,
) -> Result<usize, String> {
    let refuse = |s: &mut S, why: String| {
        let _ = write_frame(s, &Enc::default().u8(1).0);
        Err(why)
    };
    let hello =
        read_frame_at_most(s, MAX_HANDSHAKE_FRAME).map_err(|e| format!("no handshake ({e:?})"))?;
    let mut d = Dec(&hello);
    let (magic, theirs, their_group, their_rank) = (d.bytes(), d.str(), d.str(), d.u64());
    let nonce = d.bytes().unwrap_or_default();
    if let Some(secret) = secret {
        crate::auth::challenge(s, secret, context, nonce).map_err(|why| why.to_string())?;
    }
    if magic != Some(MAGIC)
        || theirs.as_deref() != Some(run_id)
        || their_group.as_deref() != Some(group)
    {
        return refuse(s, "another run, group or protocol".into());
    }
    let r = their_rank.unwrap_or(u64::MAX) as usize;
    if r <= rank || r >= size {
        return refuse(s, format!("unexpected rank {r}"));
    }
    write_frame(s, &Enc::default().u8(0).0).map_err(|e| e.to_string())?;
    Ok(r)
}

/// The mesh's server-side handshake over `data` (what a connecting peer sends), with or without
/// a secret. For the fuzz targets: any bytes must give a refusal or a rank, never a panic.
#[doc(hidden)]
pub fn fuzz_mesh_hello(data: &[u8], with_secret: bool) {
    let secret = with_secret.then(|| crate::auth::JobSecret::from_bytes(&[7; 32]).expect("valid"));
    let mut conn = crate::auth::Duplex::new(data);
    let context = auth_context("fuzz", "w");
    let _ = check_hello(&mut conn, (0, 4), "fuzz", "w", secret.as_ref(), &context);
}

fn io_fail(peer: usize, e: std::io::Error) -> PeerError {
    let kind = match e.kind() {
        ErrorKind::ConnectionReset
        | ErrorKind::BrokenPipe
        | ErrorKind::ConnectionAborted
        | ErrorKind::UnexpectedEof => FailKind::Closed,
        _ => FailKind::Io(e.to_string()),
    };
    PeerError { peer, kind }
}

fn stream(peers: &[Option<TcpStream>], peer: usize) -> Result<&TcpStream, PeerError> {
    peers
        .get(peer)
        .and_then(|s| s.as_ref())
        .ok_or(PeerError { peer, kind: FailKind::Io("no connection to this rank".into()) })
}

impl Transport for TcpMesh {
    fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, Recv<'_>)>,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let (send_peer, send_buf) = send.unwrap_or((usize::MAX, &[]));
        let (recv_peer, mut recv) = recv.unwrap_or((usize::MAX, Recv::Copy(&mut [])));
        let recv_len = recv.len();
        if send_buf.is_empty() && recv_len == 0 {
            return Ok(());
        }
        let send_stream =
            if send_buf.is_empty() { None } else { Some(stream(&self.peers, send_peer)?) };
        let recv_stream = if recv_len == 0 { None } else { Some(stream(&self.peers, recv_peer)?) };
        // Reduce-receives land in a small scratch that stays in cache: read, reduce the whole
        // elements, keep a partial element's bytes at the front, repeat.
        let scratch = &mut self.scratch;
        if matches!(recv, Recv::Reduce { .. }) && scratch.len() < SCRATCH {
            scratch.resize(SCRATCH, 0);
        }
        let (mut sent, mut got, mut reduced, mut fill) = (0usize, 0usize, 0usize, 0usize);
        let mut last_progress = Instant::now();
        loop {
            let mut progress = false;
            if let Some(mut s) = send_stream {
                if sent < send_buf.len() {
                    match s.write(&send_buf[sent..]) {
                        Ok(0) => return Err(PeerError { peer: send_peer, kind: FailKind::Closed }),
                        Ok(n) => {
                            sent += n;
                            progress = true;
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::WouldBlock | ErrorKind::Interrupted
                            ) => {}
                        Err(e) => return Err(io_fail(send_peer, e)),
                    }
                }
            }
            if let Some(mut s) = recv_stream {
                if got < recv_len {
                    let target = match &mut recv {
                        Recv::Copy(b) => &mut b[got..],
                        Recv::Reduce { .. } => {
                            let want = (recv_len - got).min(SCRATCH - fill);
                            &mut scratch[fill..fill + want]
                        }
                    };
                    match s.read(target) {
                        Ok(0) => return Err(PeerError { peer: recv_peer, kind: FailKind::Closed }),
                        Ok(n) => {
                            got += n;
                            progress = true;
                            if let Recv::Reduce { dst, elem, f } = &mut recv {
                                fill += n;
                                let whole = fill / *elem * *elem;
                                if whole > 0 {
                                    f(&mut dst[reduced..reduced + whole], &scratch[..whole]);
                                    reduced += whole;
                                    scratch.copy_within(whole..fill, 0);
                                    fill -= whole;
                                }
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::WouldBlock | ErrorKind::Interrupted
                            ) => {}
                        Err(e) => return Err(io_fail(recv_peer, e)),
                    }
                }
            }
            if sent == send_buf.len() && got == recv_len {
                return Ok(());
            }
            if progress {
                last_progress = Instant::now();
                continue;
            }
            let idle = last_progress.elapsed();
            if idle >= timeout {
                let peer = if got < recv_len { recv_peer } else { send_peer };
                return Err(PeerError { peer, kind: FailKind::Timeout(timeout) });
            }
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2);
            if let (Some(s), true) = (send_stream, sent < send_buf.len()) {
                fds.push(libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLOUT, revents: 0 });
            }
            if let (Some(s), true) = (recv_stream, got < recv_len) {
                let fd = s.as_raw_fd();
                match fds.iter_mut().find(|p| p.fd == fd) {
                    Some(p) => p.events |= libc::POLLIN,
                    None => fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 }),
                }
            }
            let wait_ms = (timeout - idle).as_millis().clamp(1, 200) as libc::c_int;
            // SAFETY: `fds` is a valid array of pollfd of the given length.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        }
    }

    fn abort(&mut self) {
        for s in self.peers.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
