//! `DataLoader`: batches of a rank's sampler order, loaded by background prefetch workers and
//! collated into candle tensors. The batch order depends only on (seed, epoch, rank) — workers
//! change when a batch is built, never which batch comes next — and the loader tracks how many
//! samples it handed out so a checkpoint can resume mid-epoch.
//!
//! Workers are plain threads with one bounded channel each (batch k goes to worker k % W and is
//! read back from that worker's channel), which keeps the output in order without reordering
//! buffers; crossbeam/rayon would add a dependency for no gain here.
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};

use crate::sampler::{DistributedSampler, SamplerState};
use crate::{DataError, Dataset};

/// A collated batch: `x` is (B, input_dim) f32, `y` is (B,) u32 class labels (candle's
/// `cross_entropy` takes u32 targets), both on the loader's device; `labels` are `y`'s values
/// on the host (reading `y` back from a GPU would wait for the device). `indices` are the
/// dataset indices the rows came from, in row order.
#[derive(Debug, Clone)]
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
    pub labels: Vec<u32>,
    pub indices: Vec<usize>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.indices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// Options as in `torch.utils.data.DataLoader`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderOptions {
    pub batch_size: usize,
    /// Drop the last batch of an epoch when it is smaller than `batch_size`.
    pub drop_last: bool,
    /// Background threads building batches; 0 builds them on the caller's thread.
    pub num_workers: usize,
    /// Batches each worker may have ready ahead of the consumer.
    pub prefetch_factor: usize,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self { batch_size: 1, drop_last: false, num_workers: 0, prefetch_factor: 2 }
    }
}

impl LoaderOptions {
    pub fn new(batch_size: usize) -> Self {
        Self { batch_size, ..Self::default() }
    }
    fn validate(&self) -> Result<(), DataError> {
        if self.batch_size == 0 {
            return Err(DataError::ZeroArgument { what: "batch_size" });
        }
        if self.num_workers > 0 && self.prefetch_factor == 0 {
            return Err(DataError::ZeroArgument { what: "prefetch_factor" });
        }
        Ok(())
    }
}

/// Gathers `indices` from `dataset` into a batch on the CPU.
pub fn collate<D: Dataset + ?Sized>(
    dataset: &D,
    indices: &[usize],
) -> Result<(Tensor, Tensor), DataError> {
    let c = collate_values(dataset, indices)?;
    let b = c.labels.len();
    Ok((
        Tensor::from_vec(c.x, (b, c.dim), &Device::Cpu)?,
        Tensor::from_vec(c.labels, b, &Device::Cpu)?,
    ))
}

/// A batch's values on the host, before they become tensors on the loader's device.
struct Collated {
    x: Vec<f32>,
    dim: usize,
    labels: Vec<u32>,
}

fn collate_values<D: Dataset + ?Sized>(
    dataset: &D,
    indices: &[usize],
) -> Result<Collated, DataError> {
    let dim = dataset.input_dim();
    let num_classes = dataset.num_classes();
    let mut x = Vec::with_capacity(indices.len() * dim);
    let mut y = Vec::with_capacity(indices.len());
    for &index in indices {
        let ex = dataset.get(index)?;
        if ex.features.len() != dim {
            return Err(DataError::FeatureLength { index, got: ex.features.len(), expected: dim });
        }
        if ex.label < 0 || ex.label as u64 >= num_classes as u64 || ex.label > u32::MAX as i64 {
            return Err(DataError::LabelOutOfRange { index, label: ex.label, num_classes });
        }
        x.extend_from_slice(&ex.features);
        y.push(ex.label as u32);
    }
    Ok(Collated { x, dim, labels: y })
}

type Built = Result<Collated, DataError>;

/// Where batches go: tensors on the CPU (or a device through candle's copy), or a GPU through
/// tandem-cuda's pinned staging and copy stream (`cuda` builds).
enum Placer {
    Candle(Device),
    #[cfg(feature = "cuda")]
    Cuda(tandem_cuda::upload::Uploader),
}

impl Placer {
    fn new(device: &Device) -> Result<Self, DataError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            return Ok(Placer::Cuda(tandem_cuda::upload::Uploader::new(d)?));
        }
        Ok(Placer::Candle(device.clone()))
    }

    fn place(&mut self, c: Collated) -> Result<(Tensor, Tensor, Vec<u32>), DataError> {
        let b = c.labels.len();
        match self {
            Placer::Candle(dev) => {
                let x = Tensor::from_vec(c.x, (b, c.dim), &Device::Cpu)?.to_device(dev)?;
                let y = Tensor::from_slice(&c.labels, b, &Device::Cpu)?.to_device(dev)?;
                Ok((x, y, c.labels))
            }
            #[cfg(feature = "cuda")]
            Placer::Cuda(up) => {
                let x = up.upload_f32(&c.x, (b, c.dim))?;
                let y = Tensor::from_slice(&c.labels, b, &Device::Cuda(up.device().clone()))?;
                Ok((x, y, c.labels))
            }
        }
    }
}

struct Worker {
    rx: Receiver<Built>,
    handle: Option<JoinHandle<()>>,
}

/// Iterates batches over a fixed list of index groups, optionally with prefetch workers.
/// Stops after the first error. Dropping it early stops and joins the workers.
pub struct BatchIter<D: Dataset + ?Sized + 'static> {
    dataset: Arc<D>,
    groups: Arc<Vec<Vec<usize>>>,
    next: usize,
    placer: Placer,
    workers: Vec<Worker>,
    failed: bool,
}

impl<D: Dataset + ?Sized + 'static> BatchIter<D> {
    /// Splits `indices` into batches of `options.batch_size` (the short tail dropped with
    /// `drop_last`) and starts the workers.
    pub fn new(
        dataset: Arc<D>,
        indices: &[usize],
        options: &LoaderOptions,
        device: Device,
    ) -> Result<Self, DataError> {
        options.validate()?;
        let mut groups: Vec<Vec<usize>> =
            indices.chunks(options.batch_size).map(<[usize]>::to_vec).collect();
        if options.drop_last && groups.last().is_some_and(|g| g.len() < options.batch_size) {
            groups.pop();
        }
        let groups = Arc::new(groups);
        let num_workers = options.num_workers.min(groups.len());
        let mut workers = Vec::with_capacity(num_workers);
        for w in 0..num_workers {
            let (tx, rx) = sync_channel::<Built>(options.prefetch_factor);
            let (dataset, groups) = (Arc::clone(&dataset), Arc::clone(&groups));
            let handle = std::thread::Builder::new()
                .name(format!("tandem-data-worker-{w}"))
                .spawn(move || {
                    for group in groups.iter().skip(w).step_by(num_workers) {
                        // A send error means the iterator was dropped: stop quietly.
                        if tx.send(collate_values(&*dataset, group)).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| DataError::WorkerDied {
                    worker: w,
                    detail: Some(format!("could not start: {e}")),
                })?;
            workers.push(Worker { rx, handle: Some(handle) });
        }
        let placer = Placer::new(&device)?;
        Ok(Self { dataset, groups, next: 0, placer, workers, failed: false })
    }

    /// Batches this iterator yields in total.
    pub fn num_batches(&self) -> usize {
        self.groups.len()
    }

    fn build(&mut self, k: usize) -> Built {
        if self.workers.is_empty() {
            return collate_values(&*self.dataset, &self.groups[k]);
        }
        let w = k % self.workers.len();
        self.workers[w].rx.recv().map_err(|_| {
            let detail = self.workers[w]
                .handle
                .take()
                .and_then(|h| h.join().err())
                .map(|p| panic_message(&*p));
            DataError::WorkerDied { worker: w, detail }
        })?
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".to_string())
}

impl<D: Dataset + ?Sized + 'static> Iterator for BatchIter<D> {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.next >= self.groups.len() {
            return None;
        }
        let k = self.next;
        self.next += 1;
        let built = self.build(k).and_then(|c| self.placer.place(c));
        match built {
            Ok((x, y, labels)) => Some(Ok(Batch { x, y, labels, indices: self.groups[k].clone() })),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

impl<D: Dataset + ?Sized + 'static> Drop for BatchIter<D> {
    fn drop(&mut self) {
        // Dropping the receivers makes any blocked `send` fail, so every worker returns.
        for worker in self.workers.drain(..) {
            let Worker { rx, handle } = worker;
            drop(rx);
            if let Some(h) = handle {
                let _ = h.join();
            }
        }
    }
}

/// A training data loader for one rank: its `DistributedSampler` order in batches.
///
/// Position tracking: every yielded batch advances the sampler's `consumed` count, so
/// [`state`](Self::state) taken inside the loop resumes right after the last batch the caller
/// received. When an epoch is iterated to the end the state moves on to (epoch + 1, 0): a
/// checkpoint taken between epochs resumes at the next epoch, and a loop that forgets
/// `set_epoch` still gets a fresh order each epoch (PyTorch silently repeats it).
pub struct DataLoader<D: Dataset + ?Sized + 'static> {
    dataset: Arc<D>,
    sampler: Mutex<DistributedSampler>,
    options: LoaderOptions,
    device: Device,
}

impl<D: Dataset + ?Sized + 'static> DataLoader<D> {
    pub fn new(
        dataset: Arc<D>,
        sampler: DistributedSampler,
        options: LoaderOptions,
        device: Device,
    ) -> Result<Self, DataError> {
        options.validate()?;
        if sampler.dataset_len() != dataset.len() {
            return Err(DataError::SamplerDatasetMismatch {
                sampler_len: sampler.dataset_len(),
                dataset_len: dataset.len(),
            });
        }
        Ok(Self { dataset, sampler: Mutex::new(sampler), options, device })
    }

    fn sampler_lock(&self) -> MutexGuard<'_, DistributedSampler> {
        // The sampler holds plain numbers; a panic elsewhere cannot leave it half-updated.
        self.sampler.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }
    pub fn options(&self) -> &LoaderOptions {
        &self.options
    }
    /// A copy of the sampler as it is now (epoch and position included).
    pub fn sampler(&self) -> DistributedSampler {
        self.sampler_lock().clone()
    }
    pub fn epoch(&self) -> u64 {
        self.sampler_lock().epoch()
    }
    /// See [`DistributedSampler::set_epoch`]: a new epoch restarts at 0, the same one keeps
    /// the position.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler_lock().set_epoch(epoch);
    }
    pub fn state(&self) -> SamplerState {
        self.sampler_lock().state()
    }
    pub fn load_state(&mut self, state: &SamplerState) -> Result<(), DataError> {
        self.sampler_lock().load_state(state)
    }
    /// See [`DistributedSampler::reshard`]: this loader's share of another world, from `state`.
    pub fn reshard(
        &mut self,
        rank: usize,
        num_replicas: usize,
        state: &SamplerState,
    ) -> Result<(), DataError> {
        self.sampler_lock().reshard(rank, num_replicas, state)
    }

    /// Batches in a full epoch of this rank.
    pub fn len(&self) -> usize {
        self.batches_of(self.sampler_lock().len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Batches left in the current epoch (all of them at its start).
    pub fn batches_left(&self) -> usize {
        self.batches_of(self.remaining_indices().len())
    }

    /// Batches `n` samples make (a short last one dropped with `drop_last`).
    fn batches_of(&self, n: usize) -> usize {
        if self.options.drop_last {
            n / self.options.batch_size
        } else {
            n.div_ceil(self.options.batch_size)
        }
    }

    /// The rest of the epoch, with the same number of batches on every rank (an epoch resumed
    /// from another world size may need it: see `DistributedSampler::remaining_in_batches`).
    fn remaining_indices(&self) -> Vec<usize> {
        self.sampler_lock().remaining_in_batches(self.options.batch_size, self.options.drop_last)
    }

    /// The rest of the current epoch, batch by batch.
    pub fn iter(&self) -> Result<EpochIter<'_, D>, DataError> {
        let epoch = self.epoch();
        let remaining = self.remaining_indices();
        let inner = BatchIter::new(
            Arc::clone(&self.dataset),
            &remaining,
            &self.options,
            self.device.clone(),
        )?;
        Ok(EpochIter { loader: self, inner, epoch, finished: false })
    }
}

/// One epoch (or what is left of it) of a [`DataLoader`].
pub struct EpochIter<'a, D: Dataset + ?Sized + 'static> {
    loader: &'a DataLoader<D>,
    inner: BatchIter<D>,
    epoch: u64,
    finished: bool,
}

impl<D: Dataset + ?Sized + 'static> EpochIter<'_, D> {
    pub fn num_batches(&self) -> usize {
        self.inner.num_batches()
    }
}

impl<D: Dataset + ?Sized + 'static> Iterator for EpochIter<'_, D> {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        match self.inner.next() {
            Some(Ok(batch)) => {
                let mut sampler = self.loader.sampler_lock();
                // A sample repeated to even out the batch count is not part of the share.
                let left = sampler.epoch_len().saturating_sub(sampler.consumed());
                let advanced = sampler.advance(batch.len().min(left));
                drop(sampler);
                if let Err(e) = advanced {
                    self.finished = true;
                    return Some(Err(e));
                }
                Some(Ok(batch))
            }
            Some(Err(e)) => {
                self.finished = true;
                Some(Err(e))
            }
            None => {
                self.finished = true;
                let mut s = self.loader.sampler_lock();
                if s.epoch() == self.epoch {
                    s.set_epoch(self.epoch.saturating_add(1));
                }
                None
            }
        }
    }
}
