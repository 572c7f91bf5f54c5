//! The rendezvous key-value store (PyTorch's `TCPStore`): a server thread in rank 0 (or the
//! launcher) and clients in every rank. Operations: set, get (waits for the key), wait for keys,
//! add, compare-and-set, delete — each bounded by a timeout. A key set with `set_owned` lives as
//! long as the connection that set it (a ZooKeeper-style ephemeral node): launchers use it to see
//! at once that another node's launcher died, since the kernel closes a dead process's sockets.
//!
//! Every connection starts with a handshake: the run id, and — when the server holds the job's
//! secret — a challenge–response both ways (`auth.rs`); a stranger is closed at once and
//! logged with its address, and learns nothing of the job. The server is bounded: frames (see
//! `frame::MAX_FRAME`), connections, keys and stored bytes are capped, a connection that has not
//! finished its handshake within [`HANDSHAKE_LIMIT`] is closed, waits are clamped, and accept
//! errors (out of descriptors) back off instead of spinning.
//!
//! The same client also speaks to PyTorch's `TCPStore` (`torch.rs`) and, with the `etcd`
//! feature, keeps its keys on an etcd v3 cluster instead of any rank's memory (`etcd.rs`).
mod client;
#[cfg(feature = "etcd")]
mod etcd;
mod server;
mod torch;
mod wire;

pub use client::Store;
pub use server::{fuzz_store_session, StoreServer, SERVER_ID_KEY};
pub use wire::{StoreWire, HANDSHAKE_LIMIT};
