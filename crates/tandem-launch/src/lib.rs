//! tandem-launch: a torchrun-compatible supervisor that spawns, watches, restarts and stops the
//! worker processes of one node. Knows nothing of collectives or training: it only sets the
//! environment that `tandem_comm::init` reads.
