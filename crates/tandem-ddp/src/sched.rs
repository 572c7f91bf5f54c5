//! Learning-rate schedulers with state.
