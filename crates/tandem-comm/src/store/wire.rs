//! The store's wire format, shared by its server and client: the handshake's magic, the
//! operation and reply codes, the server's limits, and the context a store proof is bound to.
//! Every frame is `frame.rs`'s length-prefixed frame; a request is an op code, its key, then its
//! operands (`Enc`); a reply a code, then its value.

use std::time::Duration;

pub(super) const MAGIC: &[u8] = b"tandem-store/2";
/// Open connections a server serves at once (each has a thread); more are closed at once.
pub(super) const MAX_CONNECTIONS: usize = 1024;
/// Keys a server holds.
pub(super) const MAX_KEYS: usize = 1 << 20;
/// Bytes of keys and values a server holds.
pub(super) const MAX_STORED_BYTES: usize = 256 << 20;
/// The longest a GET or WAIT may ask the server to wait (a client asking for more is clamped:
/// it learns of the timeout and asks again, or reports it).
pub(super) const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_WAIT: u8 = 3;
pub(super) const OP_ADD: u8 = 4;
pub(super) const OP_CAS: u8 = 5;
pub(super) const OP_DELETE: u8 = 6;
pub(super) const OP_SET_OWNED: u8 = 7;
pub(super) const R_OK: u8 = 0;
pub(super) const R_REFUSED: u8 = 1;
pub(super) const R_TIMEOUT: u8 = 2;
pub(super) const R_ERROR: u8 = 3;

/// The protocol a store speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreWire {
    /// tandem's own (`tandem run`, rank 0 of a tandem job): run-id handshake, owned keys.
    Tandem,
    /// PyTorch's `TCPStore` (torchrun's agent store): see `store/torch.rs`.
    Torch,
    /// An etcd v3 cluster (feature `etcd`): see `store/etcd.rs`.
    Etcd,
}

/// The longest a connection waits for the server's first answer: a server that speaks another
/// protocol stays silent, and a rank must not wait the whole init timeout to learn that.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// The context every store proof is bound to (a mesh proof cannot stand in for it).
pub(super) fn auth_context(run_id: &str) -> String {
    format!("store/{run_id}")
}
