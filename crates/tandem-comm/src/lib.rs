//! tandem-comm: the rendezvous store, process-group initialisation and CPU collectives
//! (TCP ring and shared memory). Owns bytes, dtypes and ranks; knows nothing of tensors,
//! candle, models or checkpoints.
