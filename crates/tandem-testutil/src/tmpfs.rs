//! A disk that can be made full: a tmpfs of a given size mounted for one test (root only), its
//! free bytes, and a filler that takes them.
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted at a directory, unmounted (lazily) when dropped.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (`64k`, `256m`) at `at`, creating the directory. `None` when
    /// not root or mount(8) refuses (containers without CAP_SYS_ADMIN).
    pub fn mount(at: &Path, size: &str) -> Option<Tmpfs> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        std::fs::create_dir_all(at).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tandem-test"])
            .arg(at)
            .status();
        ok.ok()?.success().then(|| Tmpfs(at.to_path_buf()))
    }

    /// Whether this process may mount a tmpfs (tried once, on a scratch directory).
    pub fn can_mount() -> bool {
        let Ok(dir) = tempfile::tempdir() else { return false };
        Tmpfs::mount(&dir.path().join("probe"), "64k").is_some()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Free bytes on the filesystem holding `p`.
pub fn free_bytes(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct we pass; the path is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above: `c` is a valid C string and `st` a writable statvfs.
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// Creates `file` taking all but `leave` of the free bytes of its filesystem (allocated, so a
/// tmpfs counts them). Removing the file frees them again.
pub fn fill(file: &Path, leave: u64) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let dir = file.parent().unwrap_or(Path::new("."));
    let free = free_bytes(dir).ok_or_else(std::io::Error::last_os_error)?;
    let f = std::fs::File::create(file)?;
    let len = free.saturating_sub(leave);
    if len == 0 {
        return Ok(());
    }
    // SAFETY: posix_fallocate on a file descriptor this function owns; no memory is passed.
    match unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) } {
        0 | libc::ENOSPC => Ok(()),
        rc => Err(std::io::Error::from_raw_os_error(rc)),
    }
}
