//! The job secret, and the challenge–response every tandem connection starts with (the stores,
//! the collective mesh) and the tag that proves a shared-memory segment was made by the job.
//!
//! Both sides prove knowledge of the secret with HMAC-SHA256 over fresh 32-byte nonces from
//! both sides, the side's role and what the connection is for (so no proof can be replayed to
//! another side, another connection or another protocol); the secret itself never crosses the
//! wire. The server proves first, so a client never sends a proof to an impostor. What is
//! protected and what is not (bytes after the handshake travel in the clear): docs/security.md.
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::frame::{read_frame_at_most, write_frame, Dec, Enc, FrameError, MAX_HANDSHAKE_FRAME};
use crate::CommError;

/// The variable naming the job's secret file (`--secret-file` sets it for the workers too).
pub const SECRET_FILE_VAR: &str = "TANDEM_SECRET_FILE";
/// The variable a launcher passes its workers the secret in (hex), when it generated one itself
/// (single-node jobs) or read it from a file.
pub const SECRET_VAR: &str = "TANDEM_SECRET";
pub const NONCE_LEN: usize = 32;
const PROOF_LEN: usize = 32;
const MIN_SECRET: usize = 16;
const MAX_SECRET: usize = 4096;
/// A frame's first byte: "prove yourself" (the server's nonce and its own proof follow).
pub(crate) const CHALLENGE: u8 = 9;

/// A job's shared secret: at least 16 bytes. Never printed (its `Debug` says only that it is
/// one).
#[derive(Clone)]
pub struct JobSecret(Arc<[u8]>);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

/// Which side of a handshake a proof is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Server,
    Client,
}

/// Fresh random bytes for one handshake.
pub fn nonce() -> Result<[u8; NONCE_LEN], CommError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| CommError::Random(e.to_string()))?;
    Ok(n)
}

impl JobSecret {
    /// 32 fresh random bytes (what a single-node `tandem run` makes for its workers).
    pub fn generate() -> Result<JobSecret, CommError> {
        Ok(JobSecret(Arc::from(&nonce()?[..])))
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<JobSecret, CommError> {
        if bytes.len() < MIN_SECRET || bytes.len() > MAX_SECRET {
            return Err(CommError::SecretInvalid(format!(
                "{} bytes; a secret has {MIN_SECRET} to {MAX_SECRET}",
                bytes.len()
            )));
        }
        Ok(JobSecret(Arc::from(bytes)))
    }

    /// Reads a secret file: refused when anyone but its owner may read or write it (like ssh's
    /// keys), when it holds fewer than 16 bytes, or more than 4096. A trailing newline is not
    /// part of the secret (so `echo`/`openssl rand -hex 32 > file` work).
    pub fn read_file(path: &Path) -> Result<JobSecret, CommError> {
        use std::os::unix::fs::PermissionsExt;
        let fail =
            |reason: String| CommError::SecretFile { path: path.display().to_string(), reason };
        let file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
        let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
        if !meta.is_file() {
            return Err(fail("is not a regular file".into()));
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(fail(format!(
                "mode {mode:o} lets other users read it; make it private: chmod 600 {}",
                path.display()
            )));
        }
        let mut bytes = Vec::new();
        file.take(MAX_SECRET as u64 + 2)
            .read_to_end(&mut bytes)
            .map_err(|e| fail(e.to_string()))?;
        while matches!(bytes.last(), Some(b'\n' | b'\r')) {
            bytes.pop();
        }
        JobSecret::from_bytes(&bytes).map_err(|e| fail(e.to_string()))
    }

    pub fn from_hex(text: &str) -> Result<JobSecret, CommError> {
        let text = text.trim();
        if !text.len().is_multiple_of(2) || text.len() > 2 * MAX_SECRET {
            return Err(CommError::SecretInvalid("not an even number of hex digits".into()));
        }
        let bytes = (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| CommError::SecretInvalid("not hex".into()))?;
        JobSecret::from_bytes(&bytes)
    }

    /// For passing to the workers in [`SECRET_VAR`].
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The job's secret from the environment: [`SECRET_VAR`] (hex, from a launcher), else the
    /// file [`SECRET_FILE_VAR`] names; `None` when neither is set.
    pub fn from_env() -> Result<Option<JobSecret>, CommError> {
        JobSecret::from_vars(|var| std::env::var(var).ok())
    }

    /// [`JobSecret::from_env`] over any variable lookup (the one place the two variables are
    /// read; `tandem_comm::init` passes its own view of the environment).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<JobSecret>, CommError> {
        if let Some(hex) = var(SECRET_VAR) {
            return JobSecret::from_hex(&hex).map(Some).map_err(|e| CommError::SecretVar {
                var: SECRET_VAR,
                reason: format!("{e} (a launcher sets it)"),
            });
        }
        match var(SECRET_FILE_VAR) {
            Some(path) if !path.is_empty() => JobSecret::read_file(Path::new(&path)).map(Some),
            _ => Ok(None),
        }
    }

    fn mac(&self, label: &str, context: &str, first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for part in [label.as_bytes(), context.as_bytes(), first, second] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// `role`'s proof for a connection about `context`: over the peer's nonce, then its own.
    pub(crate) fn proof(
        &self,
        role: Role,
        context: &str,
        theirs: &[u8],
        mine: &[u8],
    ) -> [u8; PROOF_LEN] {
        self.mac(role.label(), context, theirs, mine).finalize().into_bytes().into()
    }

    /// Checks (in constant time) that `proof` is `role`'s proof; `challenger` is the nonce the
    /// checking side sent, `responder` the other side's.
    pub(crate) fn verify(
        &self,
        role: Role,
        context: &str,
        challenger: &[u8],
        responder: &[u8],
        proof: &[u8],
    ) -> bool {
        self.mac(role.label(), context, challenger, responder).verify_slice(proof).is_ok()
    }

    /// A tag binding `parts` to this job (the shared-memory segment's header).
    pub(crate) fn tag(&self, context: &str, parts: &[u8]) -> [u8; PROOF_LEN] {
        self.mac("tandem-auth/tag", context, parts, &[]).finalize().into_bytes().into()
    }
}

impl Role {
    fn label(self) -> &'static str {
        match self {
            Role::Server => "tandem-auth/server",
            Role::Client => "tandem-auth/client",
        }
    }
}

/// How a handshake failed (the caller turns it into its own error or log line).
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The peer's proof was wrong, missing or malformed.
    BadProof,
    /// The server asked for a proof and this side has no secret.
    SecretRequired,
    /// This side has a secret and the server did not ask for a proof: it is not this job's (a
    /// client never trusts an unauthenticated server with its job).
    ServerUnauthenticated,
    Io(FrameError),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::BadProof => f.write_str("it did not prove it holds this job's secret"),
            Refusal::SecretRequired => write!(
                f,
                "it requires the job's secret and this process has none (set {SECRET_FILE_VAR} \
                 or --secret-file)"
            ),
            Refusal::ServerUnauthenticated => f.write_str(
                "it runs without a job secret while this process has one (a server of another \
                 job, or one started without the secret)",
            ),
            Refusal::Io(FrameError::Io(e)) => write!(f, "{e}"),
            Refusal::Io(FrameError::TooLarge(n)) => write!(f, "it sent a {n}-byte frame"),
        }
    }
}

/// Server side, after reading a hello that carried `client_nonce`: challenges the client and
/// checks its answer. The caller then sends its own acceptance.
pub(crate) fn challenge<S: Read + Write>(
    stream: &mut S,
    secret: &JobSecret,
    context: &str,
    client_nonce: &[u8],
) -> Result<(), Refusal> {
    if client_nonce.len() != NONCE_LEN {
        return Err(Refusal::BadProof);
    }
    let mine = nonce().map_err(|e| Refusal::Io(FrameError::Io(std::io::Error::other(e))))?;
    let proof = secret.proof(Role::Server, context, client_nonce, &mine);
    write_frame(stream, &Enc::default().u8(CHALLENGE).bytes(&mine).bytes(&proof).0)
        .map_err(|e| Refusal::Io(FrameError::Io(e)))?;
    let answer = read_frame_at_most(stream, MAX_HANDSHAKE_FRAME).map_err(Refusal::Io)?;
    let theirs = Dec(&answer).bytes().ok_or(Refusal::BadProof)?;
    if secret.verify(Role::Client, context, &mine, client_nonce, theirs) {
        Ok(())
    } else {
        Err(Refusal::BadProof)
    }
}

/// Client side: `reply` is the server's first answer to a hello that carried `my_nonce`. With a
/// challenge, checks the server's proof and answers it, returning `None` (the server's verdict
/// comes next); otherwise returns the reply for the caller to read (`Some`), after refusing an
/// unauthenticated server when this side has a secret.
pub(crate) fn answer<'r, S: Read + Write>(
    stream: &mut S,
    secret: Option<&JobSecret>,
    context: &str,
    my_nonce: &[u8],
    reply: &'r [u8],
) -> Result<Option<&'r [u8]>, Refusal> {
    if reply.first() != Some(&CHALLENGE) {
        return match secret {
            Some(_) if reply.first() == Some(&0) => Err(Refusal::ServerUnauthenticated),
            _ => Ok(Some(reply)),
        };
    }
    let secret = secret.ok_or(Refusal::SecretRequired)?;
    let mut d = Dec(&reply[1..]);
    let (theirs, proof) =
        (d.bytes().ok_or(Refusal::BadProof)?, d.bytes().ok_or(Refusal::BadProof)?);
    if theirs.len() != NONCE_LEN || !secret.verify(Role::Server, context, my_nonce, theirs, proof) {
        return Err(Refusal::BadProof);
    }
    let mine = secret.proof(Role::Client, context, theirs, my_nonce);
    write_frame(stream, &Enc::default().bytes(&mine).0)
        .map_err(|e| Refusal::Io(FrameError::Io(e)))?;
    Ok(None)
}

/// A connection in memory for the fuzz targets: reads come from the given bytes, writes are
/// collected (and dropped).
#[doc(hidden)]
pub struct Duplex {
    input: std::io::Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Duplex {
    pub fn new(input: &[u8]) -> Duplex {
        Duplex { input: std::io::Cursor::new(input.to_vec()), output: Vec::new() }
    }

    pub fn halves(&mut self) -> (&mut std::io::Cursor<Vec<u8>>, &mut Vec<u8>) {
        (&mut self.input, &mut self.output)
    }
}

impl Read for Duplex {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Duplex {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one reader of TANDEM_SECRET and TANDEM_SECRET_FILE: the launcher's hex first, then
    /// the file, else none; a bad value names the variable.
    #[test]
    fn the_secret_comes_from_the_launcher_s_hex_else_the_file() {
        let hex = secret(7).to_hex();
        let from = |pairs: Vec<(&'static str, String)>| {
            JobSecret::from_vars(|v| pairs.iter().find(|(k, _)| *k == v).map(|(_, x)| x.clone()))
        };
        let got = from(vec![(SECRET_VAR, hex.clone())]).unwrap().unwrap();
        assert_eq!(got.to_hex(), hex);
        assert!(from(vec![]).unwrap().is_none());
        assert!(from(vec![(SECRET_FILE_VAR, String::new())]).unwrap().is_none());
        let e = from(vec![(SECRET_VAR, "zz".into())]).unwrap_err().to_string();
        assert!(e.contains(SECRET_VAR) && e.contains("a launcher sets it"), "{e}");
        let e = from(vec![(SECRET_FILE_VAR, "/nonexistent/job.secret".into())]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/job.secret"), "{e}");
    }

    fn secret(b: u8) -> JobSecret {
        JobSecret::from_bytes(&[b; 32]).unwrap()
    }

    #[test]
    fn proofs_depend_on_role_context_nonces_and_secret() {
        let (a, b) = (secret(1), secret(2));
        let (n1, n2) = ([1u8; 32], [2u8; 32]);
        let p = a.proof(Role::Server, "store", &n1, &n2);
        assert!(a.verify(Role::Server, "store", &n1, &n2, &p));
        assert!(!a.verify(Role::Client, "store", &n1, &n2, &p), "role");
        assert!(!a.verify(Role::Server, "mesh", &n1, &n2, &p), "context");
        assert!(!a.verify(Role::Server, "store", &n2, &n1, &p), "nonce order");
        assert!(!b.verify(Role::Server, "store", &n1, &n2, &p), "secret");
        assert!(!a.verify(Role::Server, "store", &n1, &n2, &p[..31]), "truncated");
    }

    #[test]
    fn secret_files_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = JobSecret::read_file(&path).unwrap_err().to_string();
        assert!(e.contains("chmod 600") && e.contains("mode 644"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = JobSecret::read_file(&path).unwrap();
        assert_eq!(&*s.0, b"0123456789abcdef0123", "the newline is not part of it");
        std::fs::write(&path, "short").unwrap();
        let e = JobSecret::read_file(&path).unwrap_err().to_string();
        assert!(e.contains("5 bytes"), "{e}");
        assert_eq!(format!("{s:?}"), "JobSecret(..)");
    }

    #[test]
    fn hex_round_trips_and_bad_hex_is_refused() {
        let s = JobSecret::generate().unwrap();
        assert_eq!(&*JobSecret::from_hex(&s.to_hex()).unwrap().0, &*s.0);
        assert!(JobSecret::from_hex("zz").is_err());
        assert!(JobSecret::from_hex("abc").is_err());
    }
}
