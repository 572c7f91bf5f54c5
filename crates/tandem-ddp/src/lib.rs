//! tandem-ddp: DistributedDataParallel and DataParallel on candle, optimizers, schedulers.
//! The gradient reducer itself is engine-agnostic (named flat buffers in ready order).
