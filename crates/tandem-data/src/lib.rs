//! tandem-data: DistributedSampler with torch-exact shard order, datasets and the DataLoader.
//! Knows nothing of models, optimizers or checkpoint files.
