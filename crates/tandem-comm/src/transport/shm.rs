//! Shared-memory transport (being written).
use crate::error::CommError;
use crate::store::Store;
use std::time::Duration;

pub(crate) struct ShmTransport;

impl super::Transport for ShmTransport {
    fn exchange(
        &mut self,
        _send: Option<(usize, &[u8])>,
        _recv: Option<(usize, super::Recv<'_>)>,
        _timeout: Duration,
    ) -> Result<(), super::PeerError> {
        unreachable!()
    }
    fn abort(&mut self) {}
}

pub(crate) fn setup(
    _store: &Store,
    _group: &str,
    _rank: usize,
    _size: usize,
    _run_id: &str,
    _timeout: Duration,
) -> Result<Result<ShmTransport, String>, CommError> {
    Ok(Err("not implemented yet".into()))
}
