//! Shared-memory transport for ranks on one host. One file in /dev/shm per group, created by
//! group rank 0, mapped by every rank, and unlinked as soon as all have mapped it (so nothing is
//! left behind, even after a crash). It holds a header (per-rank pid and abort flag) and one
//! single-producer/single-consumer byte ring per ordered pair of ranks. A transfer streams
//! through the ring in pieces, so the receiver copies (or reduces) while the sender still
//! writes. Waits spin, then yield, then sleep, and check the timeout, the peer's abort flag and
//! whether the peer process is still alive. Hand-written: no crate offers cross-process rings
//! with these failure semantics.
use super::{FailKind, PeerError, Recv, Transport};
use crate::auth::JobSecret;
use crate::error::CommError;
use crate::store::Store;
use memmap2::MmapMut;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const MAGIC: u64 = 0x7461_6e64_656d_7368; // "tandemsh"
/// Bytes per ring. Small enough to stay in cache, large enough to keep both sides busy. Large
/// groups get smaller rings (n² of them exist; only touched pages of the file use memory).
fn ring_size(n: usize) -> usize {
    if n <= 16 {
        1 << 20
    } else {
        256 << 10
    }
}
/// Largest copy between two position updates: lets the consumer start early.
const PIECE: usize = 128 << 10;
const CTRL: usize = 128;

fn header_size(n: usize) -> usize {
    (64 + 64 * n).div_ceil(4096) * 4096
}

fn total_size(n: usize) -> usize {
    header_size(n) + n * n * (CTRL + ring_size(n))
}

fn align8(x: usize) -> usize {
    (x + 7) & !7
}

pub(crate) struct ShmTransport {
    _map: MmapMut,
    base: *mut u8,
    rank: usize,
    size: usize,
    pids: Vec<libc::pid_t>,
    ring: usize,
    piece: usize,
}

// SAFETY: `base` points into `_map`, which the struct owns and which lives as long as it does.
// Cross-process/thread access to the shared bytes goes through atomics (positions, flags) with
// release/acquire ordering; each ring byte range is written by one side only while owned by it.
unsafe impl Send for ShmTransport {}

impl ShmTransport {
    fn atomic(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset is 8-aligned and within the mapping (callers use layout helpers).
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }
    fn rank_block(&self, r: usize) -> usize {
        64 + 64 * r
    }
    fn pid_of(&self, r: usize) -> &AtomicU64 {
        self.atomic(self.rank_block(r))
    }
    fn abort_of(&self, r: usize) -> &AtomicU64 {
        self.atomic(self.rank_block(r) + 8)
    }
    /// Rank r's doorbell: bumped (and futex-woken if r sleeps) whenever a ring r waits on moves.
    fn bell_of(&self, r: usize) -> &AtomicU32 {
        // SAFETY: 4-byte aligned, inside rank r's header block.
        unsafe { &*(self.base.add(self.rank_block(r) + 16) as *const AtomicU32) }
    }
    fn sleeping_of(&self, r: usize) -> &AtomicU32 {
        // SAFETY: as above.
        unsafe { &*(self.base.add(self.rank_block(r) + 20) as *const AtomicU32) }
    }
    fn ring_bell(&self, r: usize) {
        // SeqCst pairs with the sleeper's SeqCst store of `sleeping` then load of the bell:
        // either we see it sleeping and wake it, or its futex_wait sees the new bell value.
        self.bell_of(r).fetch_add(1, Ordering::SeqCst);
        if self.sleeping_of(r).load(Ordering::SeqCst) != 0 {
            futex_wake(self.bell_of(r));
        }
    }
    fn ring(&self, from: usize, to: usize) -> usize {
        header_size(self.size) + (from * self.size + to) * (CTRL + self.ring)
    }
    fn peer_gone(&self, peer: usize) -> bool {
        if self.abort_of(peer).load(Ordering::Acquire) != 0 {
            return true;
        }
        let pid = self.pids[peer];
        if pid <= 0 {
            return false;
        }
        // SAFETY: kill with signal 0 only checks for existence.
        if unsafe { libc::kill(pid, 0) } != 0 {
            return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        }
        // A killed peer stays a zombie until its parent reaps it, and kill(pid, 0) succeeds on
        // zombies: without this check a rank started by hand would wait out the whole timeout.
        is_dead_process(pid)
    }
}

/// True when `/proc/<pid>/stat` shows a zombie (`Z`) or dead (`X`) process.
fn is_dead_process(pid: libc::pid_t) -> bool {
    crate::procfs::ProcStat::read(pid).is_some_and(|s| s.is_dead())
}

/// Spin this long without progress before sleeping on the doorbell: a running partner answers
/// within microseconds, and yielding instead could hand the core away for a whole time slice.
const SPIN: Duration = Duration::from_micros(50);
/// A futex sleep is cut at this length to re-check the peer's liveness and the timeout.
const NAP: Duration = Duration::from_millis(10);

fn futex_wait(word: &AtomicU32, expected: u32, max: Duration) {
    let ts = libc::timespec {
        tv_sec: max.as_secs() as libc::time_t,
        tv_nsec: max.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, 4-byte aligned u32 inside the shared mapping; FUTEX_WAIT (not
    // private: the word is shared between processes) returns at once if it no longer holds
    // `expected`, on a wake, a signal, or after `ts`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above; wakes every waiter on the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

impl Transport for ShmTransport {
    fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, Recv<'_>)>,
        timeout: Duration,
    ) -> Result<(), PeerError> {
        let (send_peer, send_buf) = send.unwrap_or((usize::MAX, &[]));
        let (recv_peer, mut recv) = recv.unwrap_or((usize::MAX, Recv::Copy(&mut [])));
        let (slen, rlen) = (send_buf.len(), recv.len());
        let (s8, r8) = (align8(slen), align8(rlen));
        let ring = self.ring;
        let piece = self.piece;
        for (peer, len) in [(send_peer, slen), (recv_peer, rlen)] {
            if len > 0 && (peer >= self.size || peer == self.rank) {
                return Err(PeerError {
                    peer,
                    kind: FailKind::Io("no channel to this rank".into()),
                });
            }
        }
        let (mut sent, mut got) = (0usize, 0usize);
        let out = if s8 > 0 { self.ring(self.rank, send_peer) } else { 0 };
        let inp = if r8 > 0 { self.ring(recv_peer, self.rank) } else { 0 };
        let mut idle = 0u32;
        let mut sleepy = false;
        let mut last_progress = Instant::now();
        let mut peer_gone_seen = false;
        let result = loop {
            if sent >= s8 && got >= r8 {
                break Ok(());
            }
            // After spinning and yielding, arm the doorbell before the last look at the rings.
            let armed = if sleepy {
                let bell = self.bell_of(self.rank).load(Ordering::SeqCst);
                self.sleeping_of(self.rank).store(1, Ordering::SeqCst);
                Some(bell)
            } else {
                None
            };
            let mut progress = false;
            if sent < s8 {
                let (wpos, rpos) = (self.atomic(out), self.atomic(out + 64));
                let w = wpos.load(Ordering::Relaxed) as usize;
                let free = ring - (w - rpos.load(Ordering::Acquire) as usize);
                let n = free.min(s8 - sent).min(piece).min(ring - w % ring);
                if n > 0 {
                    let real = n.min(slen.saturating_sub(sent));
                    // SAFETY: [w % ring, +n) lies in this ring's data area, which the consumer
                    // does not read until we publish the new write position below.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            send_buf.as_ptr().add(sent),
                            self.base.add(out + CTRL + w % ring),
                            real,
                        )
                    };
                    wpos.store((w + n) as u64, Ordering::Release);
                    self.ring_bell(send_peer);
                    sent += n;
                    progress = true;
                }
            }
            if got < r8 {
                let (wpos, rpos) = (self.atomic(inp), self.atomic(inp + 64));
                let r = rpos.load(Ordering::Relaxed) as usize;
                let avail = wpos.load(Ordering::Acquire) as usize - r;
                let mut n = avail.min(r8 - got).min(piece).min(ring - r % ring);
                let mut real = n.min(rlen.saturating_sub(got));
                if let Recv::Reduce { elem, .. } = &recv {
                    let whole = real / *elem * *elem;
                    if whole < real {
                        // Never consume part of an element.
                        real = whole;
                        n = whole;
                    }
                }
                if n > 0 {
                    // SAFETY: the producer published these bytes (acquire above) and will not
                    // overwrite them until we publish the new read position.
                    let src = unsafe {
                        std::slice::from_raw_parts(self.base.add(inp + CTRL + r % ring), real)
                    };
                    match &mut recv {
                        Recv::Copy(dst) => dst[got..got + real].copy_from_slice(src),
                        Recv::Reduce { dst, f, .. } => f(&mut dst[got..got + real], src),
                    }
                    rpos.store((r + n) as u64, Ordering::Release);
                    self.ring_bell(recv_peer);
                    got += n;
                    progress = true;
                }
            }
            if progress {
                if armed.is_some() {
                    self.sleeping_of(self.rank).store(0, Ordering::SeqCst);
                }
                idle = 0;
                sleepy = false;
                last_progress = Instant::now();
                continue;
            }
            idle = idle.wrapping_add(1);
            match armed {
                Some(bell) => {
                    futex_wait(self.bell_of(self.rank), bell, NAP);
                    self.sleeping_of(self.rank).store(0, Ordering::SeqCst);
                }
                None => std::hint::spin_loop(),
            }
            if idle.is_multiple_of(16) && last_progress.elapsed() >= SPIN {
                sleepy = true;
            }
            if armed.is_some() || idle.is_multiple_of(1024) {
                let waiting_on = if got < r8 { recv_peer } else { send_peer };
                if self.peer_gone(waiting_on) {
                    // Bytes it wrote before leaving are visible now: take them first, and fail
                    // only if the next pass still makes no progress.
                    if peer_gone_seen {
                        break Err(PeerError { peer: waiting_on, kind: FailKind::Closed });
                    }
                    peer_gone_seen = true;
                    continue;
                }
                if last_progress.elapsed() >= timeout {
                    break Err(PeerError { peer: waiting_on, kind: FailKind::Timeout(timeout) });
                }
            }
        };
        result
    }

    fn abort(&mut self) {
        self.abort_of(self.rank).store(1, Ordering::SeqCst);
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.ring_bell(r);
        }
    }
}

/// Removes the file when dropped (rank 0 unlinks once everyone mapped it, or on failure).
struct Unlink(Option<std::path::PathBuf>);

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
        .take(64)
        .collect()
}

/// Where a group's segments live, and how their names start: a rank opens nothing else.
const SEGMENT_PREFIX: &str = "/dev/shm/tandem-";

/// Bytes 24..56 of the header: the job's tag over the segment's name, nonce and size, so a rank
/// attaches only to a segment made by a process holding the job's secret (zero without one).
fn segment_tag(secret: Option<&JobSecret>, path: &str, nonce: u64, n: usize) -> [u8; 32] {
    let parts = format!("{path}\n{nonce}\n{n}");
    secret.map_or([0; 32], |s| s.tag("shm", parts.as_bytes()))
}

fn create(
    path: &std::path::Path,
    n: usize,
    nonce: u64,
    secret: Option<&JobSecret>,
) -> Result<MmapMut, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        // Only this user's processes may map the job's gradients (whatever the umask says).
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    // From here on a failure must not leave the file behind.
    let cleanup = |why: String| {
        let _ = std::fs::remove_file(path);
        why
    };
    file.set_len(total_size(n) as u64)
        .map_err(|e| cleanup(format!("cannot size {}: {e}", path.display())))?;
    // SAFETY: the file was just created by us; other processes only map it, and all shared
    // access goes through the atomics/rings described in the module comment.
    let mut map = unsafe { MmapMut::map_mut(&file) }
        .map_err(|e| cleanup(format!("cannot map {}: {e}", path.display())))?;
    map[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    map[8..16].copy_from_slice(&nonce.to_le_bytes());
    map[16..24].copy_from_slice(&(n as u64).to_le_bytes());
    let tag = segment_tag(secret, &path.display().to_string(), nonce, n);
    map[24..56].copy_from_slice(&tag);
    Ok(map)
}

fn open(path: &str, n: usize, nonce: u64, secret: Option<&JobSecret>) -> Result<MmapMut, String> {
    use std::os::unix::fs::MetadataExt;
    let name = path.strip_prefix(SEGMENT_PREFIX).unwrap_or("/");
    if name.contains('/') || name.is_empty() {
        return Err(format!("rank 0 named {path:?}, not a segment under {SEGMENT_PREFIX}*"));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {path}: {e}"))?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{path} belongs to uid {} with mode {:o}: not a private segment of this user",
            meta.uid(),
            meta.mode() & 0o777
        ));
    }
    let len = meta.len();
    if len != total_size(n) as u64 {
        return Err(format!("{path} has {len} bytes, expected {}", total_size(n)));
    }
    // SAFETY: see `create`.
    let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("cannot map {path}: {e}"))?;
    let word = |o: usize| u64::from_le_bytes(map[o..o + 8].try_into().unwrap_or([0; 8]));
    if word(0) != MAGIC || word(8) != nonce || word(16) != n as u64 {
        return Err(format!("{path} is not this group's segment (another host's /dev/shm?)"));
    }
    if map[24..56] != segment_tag(secret, path, nonce, n) {
        return Err(format!("{path} was not made by a holder of this job's secret"));
    }
    Ok(map)
}

/// Sets up the transport. The outer error is a rendezvous failure (store); the inner one means
/// shared memory cannot be used (every rank gets the same verdict, so all can fall back).
pub(crate) fn setup(
    store: &Store,
    group: &str,
    rank: usize,
    size: usize,
    run_id: &str,
    timeout: Duration,
) -> Result<Result<ShmTransport, String>, CommError> {
    let key = format!("{group}/shm");
    let mut unlink = Unlink(None);
    let mapped: Result<MmapMut, String> = if rank == 0 {
        let nonce = {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)
        };
        let path = std::path::PathBuf::from(format!(
            "{SEGMENT_PREFIX}{}-{}-{}-{nonce:x}",
            sanitize(run_id),
            std::process::id(),
            sanitize(group)
        ));
        let made = create(&path, size, nonce, store.secret());
        if made.is_ok() {
            unlink.0 = Some(path.clone());
        }
        match &made {
            Ok(_) => store.set(&key, format!("{}\n{nonce}", path.display()).as_bytes())?,
            Err(e) => store.set(&key, format!("!{e}").as_bytes())?,
        }
        made
    } else {
        let v = String::from_utf8_lossy(&store.get(&key)?).to_string();
        match v.strip_prefix('!') {
            Some(why) => Err(format!("rank 0: {why}")),
            None => {
                let (path, nonce) = v.split_once('\n').unwrap_or((&v, "0"));
                open(path, size, nonce.parse().unwrap_or(0), store.secret())
            }
        }
    };
    let mine = match &mapped {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("!{e}"),
    };
    store.set(&format!("{group}/shm_ok/{rank}"), mine.as_bytes())?;
    let keys: Vec<String> = (0..size).map(|r| format!("{group}/shm_ok/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    store.wait_timeout(&refs, timeout)?;
    let mut verdict = Ok(());
    for (r, k) in keys.iter().enumerate() {
        let v = String::from_utf8_lossy(&store.get(k)?).to_string();
        if let Some(why) = v.strip_prefix('!') {
            verdict = Err(format!("rank {r}: {why}"));
            break;
        }
    }
    drop(unlink); // everyone has mapped it (or gave up): the name is no longer needed
    let mut map = match (verdict, mapped) {
        (Ok(()), Ok(map)) => map,
        (Err(e), _) | (Ok(()), Err(e)) => return Ok(Err(e)),
    };
    let base = map.as_mut_ptr();
    let mut t = ShmTransport {
        _map: map,
        base,
        rank,
        size,
        pids: vec![0; size],
        ring: ring_size(size),
        piece: PIECE,
    };
    t.pid_of(rank).store(std::process::id() as u64, Ordering::Release);
    // Everyone must have written its pid before anyone reads them.
    store.set(&format!("{group}/shm_pid/{rank}"), b"1")?;
    let keys: Vec<String> = (0..size).map(|r| format!("{group}/shm_pid/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    store.wait_timeout(&refs, timeout)?;
    t.pids = (0..size).map(|r| t.pid_of(r).load(Ordering::Acquire) as libc::pid_t).collect();
    Ok(Ok(t))
}

#[cfg(test)]
mod liveness_tests {
    use super::is_dead_process;

    #[test]
    fn a_zombie_child_counts_as_dead_and_a_live_one_does_not() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id() as libc::pid_t;
        assert!(!is_dead_process(pid), "a sleeping child is alive");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Not reaped yet: it becomes a zombie.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !is_dead_process(pid) {
            assert!(std::time::Instant::now() < deadline, "killed child never showed as a zombie");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!is_dead_process(pid), "a reaped pid has no /proc entry");
        assert!(!is_dead_process(std::process::id() as libc::pid_t), "this process is alive");
    }
}

#[cfg(test)]
mod attach_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn secret(b: u8) -> JobSecret {
        JobSecret::from_bytes(&[b; 32]).unwrap()
    }

    /// A segment is created 0600 whatever the umask, carries the job's tag, and a rank attaches
    /// only to a private segment under /dev/shm/tandem-* whose tag proves the job's secret.
    #[test]
    fn only_private_tagged_segments_of_this_job_are_attached() {
        if !std::path::Path::new("/dev/shm").is_dir() {
            eprintln!("skipped: no /dev/shm here");
            return;
        }
        let path = format!("{SEGMENT_PREFIX}attach-test-{}", std::process::id());
        let p = std::path::Path::new(&path);
        let _ = std::fs::remove_file(p);
        let ours = secret(1);
        drop(create(p, 2, 42, Some(&ours)).unwrap());
        let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(open(&path, 2, 42, Some(&ours)).is_ok());
        let e = open(&path, 2, 42, Some(&secret(2))).err().unwrap();
        assert!(e.contains("holder of this job's secret"), "{e}");
        let e = open(&path, 2, 42, None).err().unwrap();
        assert!(e.contains("holder of this job's secret"), "{e}");
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = open(&path, 2, 42, Some(&ours)).err().unwrap();
        assert!(e.contains("not a private segment"), "{e}");
        std::fs::remove_file(p).unwrap();
        for elsewhere in ["/etc/passwd", "/dev/shm/other", "/dev/shm/tandem-../../etc/passwd"] {
            let e = open(elsewhere, 2, 42, Some(&ours)).err().unwrap();
            assert!(e.contains("not a segment under"), "{elsewhere}: {e}");
        }
    }
}
