//! The engine-agnostic gradient reducer. It knows parameters only as names and element counts
//! and gradients only as `&[f32]` handed over as they become ready; it packs them into flat
//! buckets, hands every full bucket to a communication thread (so all-reduce overlaps the rest of
//! backward) and gives back averaged gradients. Buckets are launched strictly in bucket order on
//! every rank, so collectives line up across ranks whatever order gradients arrive in.
//!
//! After the first synchronised iteration, buckets are rebuilt in the order gradients actually
//! arrived (rank 0's order, broadcast so every rank agrees), as PyTorch's reducer does.
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::bucket::{assign_buckets, BucketPlan};
use crate::comm_hooks::{AllReduceAvg, BucketParam, CommHook, GradBucket};
use crate::error::{DdpError, Result};
use tandem_comm::Collectives;
use tandem_comm::CommSource;

#[derive(Clone, Copy, Debug)]
pub struct ReducerConfig {
    pub first_bucket_bytes: usize,
    pub bucket_bytes: usize,
    pub find_unused_parameters: bool,
    /// Rebuild buckets in gradient arrival order after the first iteration.
    pub rebuild_buckets: bool,
}

struct Bucket {
    params: Vec<usize>,
    /// `None` while the buffer is away at the communication thread. While a synced backward
    /// fills it, the Vec is empty with `len` elements of capacity: slots are written in
    /// arrival order into the spare capacity and the length is set once all are written, so
    /// the buffer never needs zeroing first.
    data: Option<Vec<f32>>,
    /// Elements of the full bucket.
    len: usize,
    pending: usize,
    /// Its parameters' places and shapes, handed to the comm hook with every launch.
    layout: Arc<[BucketParam]>,
}

struct Job {
    bucket: usize,
    data: Vec<f32>,
    params: Arc<[BucketParam]>,
    hook: Arc<dyn CommHook>,
}

type Done = (usize, Vec<f32>, std::result::Result<(), CommSource>);

/// An averaged bucket buffer and the (parameter index, offset) pairs it holds.
pub type ReducedBucket = (Vec<f32>, Vec<(usize, usize)>);

pub struct Reducer {
    names: Vec<String>,
    numels: Vec<usize>,
    /// Parameter shapes for comm hooks (flat `[numel]` unless set).
    shapes: Vec<Vec<usize>>,
    cfg: ReducerConfig,
    comm: Arc<dyn Collectives>,
    buckets: Vec<Bucket>,
    /// (bucket, offset in its buffer) of each parameter.
    loc: Vec<(usize, usize)>,
    ready: Vec<bool>,
    locally_used: Vec<bool>,
    globally_used: Vec<bool>,
    arrival: Vec<usize>,
    next_launch: usize,
    in_flight: usize,
    sync: bool,
    rebuilt: bool,
    /// Local gradients accumulated by `no_sync` backwards, folded into the next synced one.
    accum: Vec<Option<Vec<f32>>>,
    /// Under `Ddp::join`: the rank whose bucket order counts (the first still-active rank; 0
    /// otherwise) and the factor turning the world average into the active ranks' average.
    root: usize,
    scale: f32,
    hook: Arc<dyn CommHook>,
    /// No hook was registered: buckets are plainly averaged.
    default_hook: bool,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl Reducer {
    pub fn new(
        names: Vec<String>,
        numels: Vec<usize>,
        comm: Arc<dyn Collectives>,
        cfg: ReducerConfig,
    ) -> Result<Self> {
        let n = names.len();
        let (job_tx, job_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<Done>();
        let thread_comm = comm.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ddp-comm-r{}", comm.rank()))
            .spawn(move || {
                for mut job in job_rx {
                    let bucket = GradBucket {
                        index: job.bucket,
                        buffer: &mut job.data,
                        params: &job.params,
                    };
                    let r = job.hook.reduce(&*thread_comm, bucket);
                    if done_tx.send((job.bucket, job.data, r)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| DdpError::comm("spawn communication thread", comm.rank(), e))?;
        let reverse: Vec<usize> = (0..n).rev().collect();
        let shapes = numels.iter().map(|&n| vec![n]).collect();
        let mut r = Reducer {
            names,
            numels,
            shapes,
            cfg,
            comm,
            buckets: Vec::new(),
            loc: vec![(0, 0); n],
            ready: vec![false; n],
            locally_used: vec![false; n],
            globally_used: vec![true; n],
            arrival: Vec::with_capacity(n),
            next_launch: 0,
            in_flight: 0,
            sync: true,
            rebuilt: !cfg.rebuild_buckets,
            accum: vec![None; n],
            root: 0,
            scale: 1.0,
            hook: Arc::new(AllReduceAvg),
            default_hook: true,
            jobs: Some(job_tx),
            done: done_rx,
            thread: Some(thread),
        };
        r.install_plans(assign_buckets(
            &reverse,
            &r.numels,
            cfg.first_bucket_bytes,
            cfg.bucket_bytes,
        ));
        Ok(r)
    }

    /// Replaces what each bucket goes through (default: all-reduce average). Takes effect from
    /// the next bucket launched.
    pub fn set_comm_hook(&mut self, hook: Arc<dyn CommHook>) {
        self.hook = hook;
        self.default_hook = false;
    }

    /// True until a comm hook is registered.
    pub fn has_default_hook(&self) -> bool {
        self.default_hook
    }

    /// `DdpOptions::find_unused_parameters`.
    #[cfg(feature = "cuda")]
    pub fn finds_unused(&self) -> bool {
        self.cfg.find_unused_parameters
    }

    /// What the hook does to a bucket on the GPU, when it can be done there.
    #[cfg(feature = "cuda")]
    pub fn device_wire(&self) -> Option<crate::DeviceWire> {
        self.hook.on_device()
    }

    /// The parameters' shapes, handed to comm hooks (PowerSGD needs the matrices).
    pub fn set_param_shapes(&mut self, shapes: Vec<Vec<usize>>) -> Result<()> {
        if shapes.len() != self.numels.len() {
            return Err(DdpError::InvalidOption {
                what: "param shapes",
                why: format!("{} shapes for {} parameters", shapes.len(), self.numels.len()),
            });
        }
        for (i, s) in shapes.iter().enumerate() {
            let n: usize = s.iter().product();
            if self.numels[i] != n {
                return Err(DdpError::InvalidOption {
                    what: "param shapes",
                    why: format!("parameter {i}: shape {s:?} does not match its element count"),
                });
            }
        }
        self.shapes = shapes;
        for b in 0..self.buckets.len() {
            self.buckets[b].layout = self.layout(&self.buckets[b].params);
        }
        Ok(())
    }

    fn install_plans(&mut self, plans: Vec<BucketPlan>) {
        self.buckets.clear();
        for (b, plan) in plans.into_iter().enumerate() {
            let mut off = 0;
            for &p in &plan.params {
                self.loc[p] = (b, off);
                off += self.numels[p];
            }
            let layout = self.layout(&plan.params);
            self.buckets.push(Bucket {
                pending: plan.params.len(),
                params: plan.params,
                data: Some(Vec::with_capacity(off)),
                len: off,
                layout,
            });
        }
    }

    /// Where each of `params` sits in its bucket, with its shape (`loc` must be set).
    fn layout(&self, params: &[usize]) -> Arc<[BucketParam]> {
        params
            .iter()
            .map(|&p| BucketParam {
                index: p,
                offset: self.loc[p].1,
                shape: self.shapes[p].clone(),
            })
            .collect()
    }

    /// Current bucket layout (parameter indices per bucket), for tests and diagnostics.
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Whether `no_sync` steps left local gradients waiting to be added to the next sync step.
    pub fn has_accumulated(&self) -> bool {
        self.accum.iter().any(Option::is_some)
    }

    /// Whether the current step all-reduces (false inside `no_sync`).
    pub fn is_sync(&self) -> bool {
        self.sync
    }

    /// Set by `Ddp::join` for each step: `root` is the authoritative rank (bucket order comes
    /// from it), `scale` multiplies the world-averaged gradients (world size / active ranks when
    /// dividing by the active ranks; 1 otherwise).
    pub fn set_join_step(&mut self, root: usize, scale: f32) {
        self.root = root;
        self.scale = scale;
    }

    /// A joined rank's part in a synchronised step it has no data for: a zero gradient for
    /// every parameter, bucket by bucket in the order the active ranks launch theirs, the
    /// used-parameter all-reduce (nothing used here) and the one-time bucket rebuild — the same
    /// collectives an active rank's `mark_ready`/`finalize`/`after_step` make. The results are
    /// discarded.
    pub fn shadow_step(&mut self) -> Result<()> {
        self.prepare_for_backward(true);
        self.accum.iter_mut().for_each(|a| *a = None);
        let order: Vec<usize> = self.buckets.iter().flat_map(|b| b.params.clone()).collect();
        for p in order {
            self.ready[p] = true;
            self.arrival.push(p);
            self.place(p, None)?;
        }
        self.wait_in_flight()?;
        if self.cfg.find_unused_parameters {
            let mut used = vec![0f32; self.names.len()];
            self.comm.all_reduce_sum(&mut used).map_err(|e| {
                DdpError::comm("all_reduce(sum) of the used-parameter map", self.comm.rank(), e)
            })?;
        }
        drop(self.take_reduced());
        self.after_step()
    }

    /// Back to the bucket layout of a new reducer (reverse parameter order), with the
    /// one-time rebuild after the next synced step pending again: what every rank of a live
    /// world does when it regroups, so that a rank that just joined (whose reducer is new) and
    /// the others agree on every bucket and on the rebuild's broadcast.
    pub fn reset_layout(&mut self) {
        let _ = self.wait_in_flight();
        let reverse: Vec<usize> = (0..self.names.len()).rev().collect();
        let plans = assign_buckets(
            &reverse,
            &self.numels,
            self.cfg.first_bucket_bytes,
            self.cfg.bucket_bytes,
        );
        self.install_plans(plans);
        self.rebuilt = !self.cfg.rebuild_buckets;
        self.arrival.clear();
    }

    /// Start a backward: `sync = false` inside `no_sync` (gradients accumulate locally).
    pub fn prepare_for_backward(&mut self, sync: bool) {
        // A backward that failed midway may have left buckets at the comm thread.
        let _ = self.wait_in_flight();
        self.sync = sync;
        self.ready.iter_mut().for_each(|r| *r = false);
        self.locally_used.iter_mut().for_each(|r| *r = false);
        self.globally_used.iter_mut().for_each(|r| *r = true);
        self.arrival.clear();
        self.next_launch = 0;
        for bucket in &mut self.buckets {
            bucket.pending = bucket.params.len();
            match &mut bucket.data {
                // Kept from a no_sync or failed step: refill from empty.
                Some(data) => data.clear(),
                // Handed out by `take_reduced` last step.
                None => bucket.data = Some(Vec::with_capacity(bucket.len)),
            }
        }
    }

    /// Parameter `idx`'s local gradient is complete.
    /// Parameter `idx`'s name.
    pub fn param_name(&self, idx: usize) -> String {
        self.names.get(idx).cloned().unwrap_or_else(|| format!("#{idx}"))
    }

    /// Whether parameter `idx`'s gradient arrived this step.
    pub fn is_ready(&self, idx: usize) -> bool {
        self.ready.get(idx).copied().unwrap_or(false)
    }

    pub fn mark_ready(&mut self, idx: usize, grad: &[f32]) -> Result<()> {
        if idx >= self.names.len() || grad.len() != self.numels[idx] {
            return Err(DdpError::GradientLength {
                index: idx,
                name: self.names.get(idx).cloned().unwrap_or_else(|| "<out of range>".into()),
                got: grad.len(),
                expected: self.numels.get(idx).copied().unwrap_or(0),
            });
        }
        if self.ready[idx] {
            return Err(DdpError::DoubleReady { name: self.names[idx].clone() });
        }
        self.ready[idx] = true;
        self.locally_used[idx] = true;
        self.arrival.push(idx);
        if !self.sync {
            match &mut self.accum[idx] {
                Some(acc) => acc.iter_mut().zip(grad).for_each(|(a, g)| *a += g),
                slot => *slot = Some(grad.to_vec()),
            }
            return Ok(());
        }
        self.place(idx, Some(grad))
    }

    /// Copy `grad` (+ any no_sync accumulation; zeros when `grad` is None) into its bucket slot.
    fn place(&mut self, idx: usize, grad: Option<&[f32]>) -> Result<()> {
        let (b, off) = self.loc[idx];
        let n = self.numels[idx];
        let acc = self.accum[idx].take();
        let bucket = &mut self.buckets[b];
        let data = bucket.data.as_mut().ok_or(DdpError::CommThreadGone)?;
        debug_assert!(data.is_empty() && data.capacity() >= bucket.len);
        let dst = &mut data.spare_capacity_mut()[off..off + n];
        let copy = |dst: &mut [std::mem::MaybeUninit<f32>], src: &[f32]| {
            // SAFETY: `dst` and `src` are both `n` f32s long and cannot overlap (`src` is a
            // caller's slice or `acc`, `dst` this bucket's spare capacity).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    dst.as_mut_ptr().cast::<f32>(),
                    src.len(),
                )
            }
        };
        match (grad, acc) {
            (Some(g), None) => copy(dst, g),
            (Some(g), Some(a)) => dst.iter_mut().zip(g.iter().zip(&a)).for_each(|(d, (g, a))| {
                d.write(g + a);
            }),
            (None, Some(a)) => copy(dst, &a),
            (None, None) => dst.iter_mut().for_each(|d| {
                d.write(0.0);
            }),
        }
        bucket.pending -= 1;
        if bucket.pending == 0 {
            // SAFETY: every parameter of the bucket has been placed exactly once (`ready`
            // guards repeats), and their slots tile [0, len): all `len` elements are written.
            unsafe { data.set_len(bucket.len) };
        }
        self.launch_ready_buckets()
    }

    fn launch_ready_buckets(&mut self) -> Result<()> {
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].pending == 0 {
            let b = self.next_launch;
            let data = self.buckets[b].data.take().ok_or(DdpError::CommThreadGone)?;
            let tx = self.jobs.as_ref().ok_or(DdpError::CommThreadGone)?;
            let hook = self.hook.clone();
            let params = self.buckets[b].layout.clone();
            tx.send(Job { bucket: b, data, params, hook }).map_err(|_| DdpError::CommThreadGone)?;
            self.in_flight += 1;
            self.next_launch += 1;
        }
        Ok(())
    }

    fn wait_in_flight(&mut self) -> Result<()> {
        let mut first_err = None;
        while self.in_flight > 0 {
            let (b, data, r) = self.done.recv().map_err(|_| DdpError::CommThreadGone)?;
            self.in_flight -= 1;
            let mut data = data;
            if self.scale != 1.0 {
                data.iter_mut().for_each(|v| *v *= self.scale);
            }
            self.buckets[b].data = Some(data);
            if let Err(e) = r {
                first_err.get_or_insert(DdpError::comm(
                    "the communication hook of a gradient bucket",
                    self.comm.rank(),
                    e,
                ));
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// End of backward: deal with parameters that got no gradient, wait for every bucket, and
    /// (once) rebuild buckets in arrival order. Afterwards `grad(i)` gives the results.
    pub fn finalize(&mut self) -> Result<()> {
        let missing: Vec<usize> = (0..self.names.len()).filter(|&i| !self.ready[i]).collect();
        if !self.sync {
            // Unused parameters simply accumulate nothing in a no_sync step.
            return Ok(());
        }
        if !missing.is_empty() && !self.cfg.find_unused_parameters {
            // Let the buckets already launched finish so the comm thread is idle, then report.
            self.wait_in_flight()?;
            return Err(DdpError::UnusedParameters {
                rank: self.comm.rank(),
                names: missing.iter().map(|&i| self.names[i].clone()).collect(),
            });
        }
        for &i in &missing {
            self.ready[i] = true;
            self.arrival.push(i);
            self.place(i, None)?;
        }
        self.wait_in_flight()?;
        if self.cfg.find_unused_parameters {
            // As PyTorch: a parameter no rank used keeps "no gradient" rather than a zero one,
            // so optimizers skip it instead of applying momentum/weight decay.
            let mut used: Vec<f32> =
                self.locally_used.iter().map(|&u| if u { 1.0 } else { 0.0 }).collect();
            self.comm.all_reduce_sum(&mut used).map_err(|e| {
                DdpError::comm("all_reduce(sum) of the used-parameter map", self.comm.rank(), e)
            })?;
            for (g, u) in self.globally_used.iter_mut().zip(&used) {
                *g = *u > 0.0;
            }
        }
        Ok(())
    }

    /// The gradient of parameter `idx` after `finalize`: averaged over the world in a synced
    /// step, the local accumulation in a `no_sync` step; `None` when there is none.
    pub fn grad(&self, idx: usize) -> Option<&[f32]> {
        if idx >= self.names.len() {
            return None;
        }
        if !self.sync {
            return self.accum[idx].as_deref();
        }
        if !self.globally_used[idx] {
            return None;
        }
        let (b, off) = self.loc[idx];
        // A bucket left incomplete by a failed step is empty: no gradient rather than a panic.
        self.buckets[b].data.as_deref().and_then(|d| d.get(off..off + self.numels[idx]))
    }

    /// After `finalize` of a synchronised step: hands over the averaged bucket buffers without
    /// copying, each with the (parameter, offset) pairs it holds; globally unused parameters are
    /// left out. Fresh buffers are allocated at the next `prepare_for_backward`.
    pub fn take_reduced(&mut self) -> Vec<ReducedBucket> {
        if !self.sync {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(self.buckets.len());
        for bucket in &mut self.buckets {
            let Some(data) = bucket.data.take() else { continue };
            let params = bucket
                .params
                .iter()
                .filter(|&&p| self.globally_used[p])
                .map(|&p| (p, self.loc[p].1))
                .collect();
            out.push((data, params));
        }
        out
    }

    /// Called after the caller has read the gradients of a synced step: rebuild the buckets in
    /// arrival order once (a collective: every rank calls it after the same step).
    pub fn after_step(&mut self) -> Result<()> {
        if !self.sync || self.rebuilt {
            return Ok(());
        }
        self.rebuilt = true;
        let mut order: Vec<f32> = self.arrival.iter().map(|&i| i as f32).collect();
        self.comm
            .broadcast(&mut order, self.root)
            .map_err(|e| DdpError::comm("broadcast of the bucket order", self.comm.rank(), e))?;
        let order: Vec<usize> = order.iter().map(|&f| f as usize).collect();
        let mut seen = vec![false; self.names.len()];
        if order.len() != self.names.len()
            || order.iter().any(|&i| i >= seen.len() || std::mem::replace(&mut seen[i], true))
        {
            return Err(DdpError::BucketOrder { got: order.len(), expected: self.names.len() });
        }
        let plans = assign_buckets(
            &order,
            &self.numels,
            self.cfg.first_bucket_bytes,
            self.cfg.bucket_bytes,
        );
        self.install_plans(plans);
        Ok(())
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_comm::LocalGroup;

    fn cfg(find_unused: bool) -> ReducerConfig {
        ReducerConfig {
            first_bucket_bytes: 8,
            bucket_bytes: 8,
            find_unused_parameters: find_unused,
            rebuild_buckets: true,
        }
    }

    fn run2<F, T>(f: F) -> Vec<T>
    where
        F: Fn(Arc<dyn Collectives>) -> T + Send + Sync + 'static + Clone,
        T: Send + 'static,
    {
        LocalGroup::run(2, f)
    }

    #[test]
    fn averages_over_ranks_and_rebuilds_in_arrival_order() {
        let out = run2(|comm| {
            let r = comm.rank() as f32;
            let mut red = Reducer::new(
                vec!["a".into(), "b".into(), "c".into()],
                vec![2, 2, 2],
                comm,
                cfg(false),
            )
            .unwrap();
            assert_eq!(red.bucket_params(), vec![vec![2], vec![1], vec![0]]);
            red.prepare_for_backward(true);
            // Arrival order 0, 2, 1: bucket 0 (param 2) launches only after param 2 arrives.
            red.mark_ready(0, &[r, r]).unwrap();
            red.mark_ready(2, &[2.0 + r, 0.0]).unwrap();
            red.mark_ready(1, &[10.0 * r, 1.0]).unwrap();
            red.finalize().unwrap();
            let g: Vec<Vec<f32>> = (0..3).map(|i| red.grad(i).unwrap().to_vec()).collect();
            red.after_step().unwrap();
            (g, red.bucket_params())
        });
        for (g, plans) in out {
            assert_eq!(g, vec![vec![0.5, 0.5], vec![5.0, 1.0], vec![2.5, 0.0]]);
            assert_eq!(plans, vec![vec![0], vec![2], vec![1]]);
        }
    }

    #[test]
    fn no_sync_accumulates_into_next_synced_step() {
        let out = run2(|comm| {
            let r = comm.rank() as f32;
            let mut red = Reducer::new(vec!["w".into()], vec![1], comm, cfg(false)).unwrap();
            red.prepare_for_backward(false);
            red.mark_ready(0, &[r]).unwrap();
            red.finalize().unwrap();
            let local = red.grad(0).unwrap().to_vec();
            red.prepare_for_backward(true);
            red.mark_ready(0, &[1.0]).unwrap();
            red.finalize().unwrap();
            (local, red.grad(0).unwrap().to_vec())
        });
        assert_eq!(out[0], (vec![0.0], vec![1.5]));
        assert_eq!(out[1], (vec![1.0], vec![1.5]));
    }

    #[test]
    fn unused_parameter_is_named_or_zero_filled() {
        let out = run2(|comm| {
            let mut red = Reducer::new(
                vec!["used".into(), "head.weight".into()],
                vec![1, 1],
                comm.clone(),
                cfg(false),
            )
            .unwrap();
            red.prepare_for_backward(true);
            red.mark_ready(0, &[1.0]).unwrap();
            let err = red.finalize().unwrap_err().to_string();
            drop(red);
            let mut red = Reducer::new(
                vec!["used".into(), "head.weight".into()],
                vec![1, 1],
                comm.clone(),
                cfg(true),
            )
            .unwrap();
            red.prepare_for_backward(true);
            red.mark_ready(0, &[1.0]).unwrap();
            // rank 1 uses "head.weight", rank 0 does not: it counts as zero on rank 0.
            if comm.rank() == 1 {
                red.mark_ready(1, &[4.0]).unwrap();
            }
            red.finalize().unwrap();
            let head = red.grad(1).map(|g| g.to_vec());
            // Next step nobody uses it: no gradient at all.
            red.prepare_for_backward(true);
            red.mark_ready(0, &[1.0]).unwrap();
            red.finalize().unwrap();
            (err, head, red.grad(1).is_none())
        });
        for (err, head, globally_unused_is_none) in out {
            assert!(
                err.contains("head.weight") && err.contains("find_unused_parameters: true"),
                "{err}"
            );
            assert_eq!(head, Some(vec![2.0]));
            assert!(globally_unused_is_none);
        }
    }

    /// A step that failed midway (an unused parameter) leaves a half-filled bucket: reading it
    /// gives no gradient instead of uninitialised values, and the next step refills every
    /// bucket from scratch with the right averages.
    #[test]
    fn a_failed_step_leaves_no_stale_or_uninitialised_gradients() {
        let out = run2(|comm| {
            let r = comm.rank() as f32;
            let big =
                ReducerConfig { first_bucket_bytes: 1 << 20, bucket_bytes: 1 << 20, ..cfg(false) };
            let mut red =
                Reducer::new(vec!["a".into(), "b".into()], vec![3, 2], comm, big).unwrap();
            red.prepare_for_backward(true);
            red.mark_ready(1, &[9.0, 9.0]).unwrap();
            assert!(red.finalize().is_err());
            let after_failure = (red.grad(0).is_none(), red.grad(1).is_none());
            red.prepare_for_backward(true);
            red.mark_ready(1, &[r, 2.0 * r]).unwrap();
            red.mark_ready(0, &[1.0, r, 3.0]).unwrap();
            red.finalize().unwrap();
            (after_failure, red.grad(0).unwrap().to_vec(), red.grad(1).unwrap().to_vec())
        });
        for (after_failure, a, b) in out {
            assert_eq!(after_failure, (true, true));
            assert_eq!(a, vec![1.0, 0.5, 3.0]);
            assert_eq!(b, vec![0.5, 1.0]);
        }
    }

    #[test]
    fn a_gradient_of_the_wrong_length_is_named_as_such() {
        let comm: Arc<dyn Collectives> = Arc::new(tandem_comm::SingleProcess);
        let mut red = Reducer::new(vec!["fc.weight".into()], vec![6], comm, cfg(false)).unwrap();
        red.prepare_for_backward(true);
        match red.mark_ready(0, &[1.0; 4]) {
            Err(DdpError::GradientLength { index: 0, name, got: 4, expected: 6 }) => {
                assert_eq!(name, "fc.weight")
            }
            other => panic!("expected GradientLength, got {other:?}"),
        }
    }
}
