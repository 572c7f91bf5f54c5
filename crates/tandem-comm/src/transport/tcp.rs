//! TCP transport: a full mesh of sockets between the ranks of a group (rank i connects to every
//! lower rank; addresses are published in the store), non-blocking, with send and receive
//! driven together by `poll(2)` so a ring step overlaps both directions. Every connection starts
//! with a handshake carrying the run id and group; strangers are refused.
use super::{FailKind, PeerError, Recv, Transport};
use crate::error::CommError;
use crate::frame::{read_frame, write_frame, Dec, Enc};
use crate::store::Store;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const MAGIC: &[u8] = b"tandem-mesh/1";
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

/// Builds the mesh for group `group` (store key prefix) of `size` ranks.
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
        let hello = Enc::default().bytes(MAGIC).str(run_id).str(group).u64(rank as u64).0;
        write_frame(&mut s, &hello).map_err(|e| rv(format!("handshake with rank {peer}: {e}")))?;
        let reply = read_frame(&mut s)
            .map_err(|e| rv(format!("handshake with rank {peer} at {addr}: {e:?}")))?;
        if reply.first() != Some(&0) {
            return Err(rv(format!(
                "rank {peer} at {addr} refused the connection: {}",
                Dec(reply.get(1..).unwrap_or(&[])).str().unwrap_or_default()
            )));
        }
        *slot = Some(s);
    }

    listener.set_nonblocking(true).map_err(|e| rv(e.to_string()))?;
    let mut missing = size - rank - 1;
    while missing > 0 {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false).map_err(|e| rv(e.to_string()))?;
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100));
                s.set_read_timeout(Some(left)).map_err(|e| rv(e.to_string()))?;
                let Ok(hello) = read_frame(&mut s) else {
                    continue;
                };
                let mut d = Dec(&hello);
                let (magic, theirs, their_group, their_rank) =
                    (d.bytes(), d.str(), d.str(), d.u64());
                let refuse = |s: &mut TcpStream, why: String| {
                    tracing::warn!("mesh {group}: refused connection from {from}: {why}");
                    let _ = write_frame(s, &Enc::default().u8(1).str(&why).0);
                };
                if magic != Some(MAGIC)
                    || theirs.as_deref() != Some(run_id)
                    || their_group.as_deref() != Some(group)
                {
                    refuse(&mut s, format!("expected run {run_id:?} group {group:?}, got run {theirs:?} group {their_group:?}"));
                    continue;
                }
                let r = their_rank.unwrap_or(u64::MAX) as usize;
                if r <= rank || r >= size || peers[r].is_some() {
                    refuse(&mut s, format!("unexpected rank {r}"));
                    continue;
                }
                write_frame(&mut s, &Enc::default().u8(0).0)
                    .map_err(|e| rv(format!("handshake with rank {r}: {e}")))?;
                peers[r] = Some(s);
                missing -= 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let who: Vec<usize> =
                        (rank + 1..size).filter(|&r| peers[r].is_none()).collect();
                    return Err(rv(format!("ranks {who:?} did not connect within {timeout:?}")));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(rv(format!("accept: {e}"))),
        }
    }
    for s in peers.iter().flatten() {
        s.set_read_timeout(None).map_err(|e| rv(e.to_string()))?;
        s.set_nonblocking(true).map_err(|e| rv(e.to_string()))?;
        tune(s).map_err(|e| rv(e.to_string()))?;
    }
    Ok(TcpMesh { peers, scratch: Vec::new() })
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
