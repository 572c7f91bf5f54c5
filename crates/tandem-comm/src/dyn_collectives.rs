//! The collectives tensor code needs (Ddp's reducer, SyncBatchNorm, the differentiable
//! all_gather, ZeRO), as a small object-safe trait ([`Collectives`]), so that code does not
//! depend on which group carries the bytes. Implemented for [`ProcessGroup`](crate::ProcessGroup)
//! (the real thing), for [`LocalGroup`], an in-process group of threads used by unit tests and
//! as a reference, and for [`SingleProcess`], a world of one.
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use half::{bf16, f16};

/// A failure reported by a group behind [`Collectives`], kept opaque so callers stay
/// independent of which backend carried it.
pub type CommSource = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What Ddp, the collective layers and ZeRO ask of a process group. All calls are blocking collectives: every rank must make
/// the same calls in the same order.
pub trait Collectives: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Element-wise average over all ranks, in place.
    fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<(), CommSource>;
    /// Element-wise sum over all ranks, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommSource>;
    /// Element-wise sum in half precision (what the fp16 compression hook sends). Groups that
    /// cannot reduce 16-bit floats keep the default, an error naming the hook's need.
    fn all_reduce_sum_f16(&self, _buf: &mut [f16]) -> Result<(), CommSource> {
        Err("this process group has no f16 all-reduce (needed by the fp16 comm hook)".into())
    }
    /// Element-wise sum in bfloat16 (what the bf16 compression hook sends).
    fn all_reduce_sum_bf16(&self, _buf: &mut [bf16]) -> Result<(), CommSource> {
        Err("this process group has no bf16 all-reduce (needed by the bf16 comm hook)".into())
    }
    /// Overwrites `buf` on every rank with `root`'s.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommSource>;
    /// Every rank's bytes, indexed by rank.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource>;
    /// Which world the group is in: a live group (`crate::live`) counts its regroups; a fixed
    /// group stays at 0. State that every rank built together (Ddp's bucket layout) is built
    /// again when it changes, since a rank that joined has only its fresh copy.
    fn generation(&self) -> u64 {
        0
    }
    /// The NCCL communicator that reduces CUDA gradients on the device, if the group has one;
    /// without it CUDA gradients are staged through host memory and reduced by the group.
    #[cfg(feature = "nccl")]
    fn nccl(&self) -> Option<crate::nccl::NcclComm> {
        None
    }
}

impl Collectives for crate::ProcessGroup {
    fn rank(&self) -> usize {
        crate::ProcessGroup::rank(self)
    }
    fn size(&self) -> usize {
        crate::ProcessGroup::size(self)
    }
    fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        Ok(self.all_reduce(buf, crate::ReduceOp::Avg)?)
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        Ok(self.all_reduce(buf, crate::ReduceOp::Sum)?)
    }
    fn all_reduce_sum_f16(&self, buf: &mut [f16]) -> Result<(), CommSource> {
        Ok(self.all_reduce(buf, crate::ReduceOp::Sum)?)
    }
    fn all_reduce_sum_bf16(&self, buf: &mut [bf16]) -> Result<(), CommSource> {
        Ok(self.all_reduce(buf, crate::ReduceOp::Sum)?)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommSource> {
        Ok(crate::ProcessGroup::broadcast(self, buf, root)?)
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        Ok(crate::ProcessGroup::all_gather_bytes(self, bytes)?)
    }
    #[cfg(feature = "nccl")]
    fn nccl(&self) -> Option<crate::nccl::NcclComm> {
        self.nccl_comm()
    }
}

impl<T: Collectives + ?Sized> Collectives for Arc<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        (**self).all_reduce_avg(buf)
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        (**self).all_reduce_sum(buf)
    }
    fn all_reduce_sum_f16(&self, buf: &mut [f16]) -> Result<(), CommSource> {
        (**self).all_reduce_sum_f16(buf)
    }
    fn all_reduce_sum_bf16(&self, buf: &mut [bf16]) -> Result<(), CommSource> {
        (**self).all_reduce_sum_bf16(buf)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommSource> {
        (**self).broadcast(buf, root)
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        (**self).all_gather_bytes(bytes)
    }
    fn generation(&self) -> u64 {
        (**self).generation()
    }
    #[cfg(feature = "nccl")]
    fn nccl(&self) -> Option<crate::nccl::NcclComm> {
        (**self).nccl()
    }
}

/// An in-process "process group": `LocalGroup::new(n)` returns one handle per rank, each to be
/// moved to its own thread. Collectives rendezvous through shared memory with a timeout, so a
/// rank that never arrives produces an error instead of a hang. Sums run in rank order, so
/// every rank gets bit-identical results.
#[derive(Clone)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<LocalShared>,
}

struct LocalShared {
    size: usize,
    timeout: Duration,
    slots: Mutex<Vec<Vec<u8>>>,
    barrier: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl LocalGroup {
    pub fn new(size: usize) -> Vec<LocalGroup> {
        Self::with_timeout(size, Duration::from_secs(60))
    }

    /// Runs `f` on `size` threads, one per rank of a new group, and returns their results in
    /// rank order. A rank that panics fails the call (after the others end: each collective is
    /// bounded by the group's timeout).
    pub fn run<R: Send + 'static>(
        size: usize,
        f: impl Fn(Arc<dyn Collectives>) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let f = Arc::new(f);
        let handles: Vec<_> = Self::new(size)
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(Arc::new(g)))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join().unwrap_or_else(|_| panic!("rank {r} of the local group panicked"))
            })
            .collect()
    }

    pub fn with_timeout(size: usize, timeout: Duration) -> Vec<LocalGroup> {
        let shared = Arc::new(LocalShared {
            size,
            timeout,
            slots: Mutex::new(vec![Vec::new(); size]),
            barrier: Mutex::new((0, 0)),
            cv: Condvar::new(),
        });
        (0..size).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }

    fn barrier(&self) -> Result<(), CommSource> {
        let s = &self.shared;
        let mut g = s.barrier.lock().map_err(|_| "local group poisoned")?;
        let gen = g.1;
        g.0 += 1;
        if g.0 == s.size {
            g.0 = 0;
            g.1 += 1;
            s.cv.notify_all();
            return Ok(());
        }
        let (g, res) =
            s.cv.wait_timeout_while(g, s.timeout, |st| st.1 == gen)
                .map_err(|_| "local group poisoned")?;
        drop(g);
        if res.timed_out() {
            return Err(format!(
                "LocalGroup rank {}: timed out after {:?} waiting for the other ranks",
                self.rank, s.timeout
            )
            .into());
        }
        Ok(())
    }

    /// Sum of 2-byte floats in rank order, rounding after every addition (as a ring of half
    /// precision adds does).
    fn half_sum<T: bytemuck::Pod>(
        &self,
        buf: &mut [T],
        from_bytes: fn([u8; 2]) -> T,
        to_f32: fn(T) -> f32,
        from_f32: fn(f32) -> T,
    ) -> Result<(), CommSource> {
        let all = self.exchange(bytemuck::cast_slice(buf))?;
        for (r, bytes) in all.iter().enumerate() {
            if bytes.len() != buf.len() * 2 {
                return Err(format!(
                    "rank {r} contributed {} bytes, expected {}",
                    bytes.len(),
                    buf.len() * 2
                )
                .into());
            }
            for (d, c) in buf.iter_mut().zip(bytes.chunks_exact(2)) {
                let v = from_bytes([c[0], c[1]]);
                *d = if r == 0 { v } else { from_f32(to_f32(*d) + to_f32(v)) };
            }
        }
        Ok(())
    }

    /// Deposit my bytes, wait for all, read everyone's, wait again so slots can be reused.
    fn exchange(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        {
            let mut slots = self.shared.slots.lock().map_err(|_| "local group poisoned")?;
            slots[self.rank] = mine.to_vec();
        }
        self.barrier()?;
        let all = self.shared.slots.lock().map_err(|_| "local group poisoned")?.clone();
        self.barrier()?;
        Ok(all)
    }
}

fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
}

impl Collectives for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        let all = self.exchange(bytemuck::cast_slice(buf))?;
        buf.iter_mut().for_each(|v| *v = 0.0);
        for (r, bytes) in all.iter().enumerate() {
            if bytes.len() != buf.len() * 4 {
                return Err(format!(
                    "rank {r} contributed {} bytes, expected {}",
                    bytes.len(),
                    buf.len() * 4
                )
                .into());
            }
            for (d, s) in buf.iter_mut().zip(f32s(bytes)) {
                *d += s;
            }
        }
        Ok(())
    }
    fn all_reduce_avg(&self, buf: &mut [f32]) -> Result<(), CommSource> {
        self.all_reduce_sum(buf)?;
        let n = self.shared.size as f32;
        buf.iter_mut().for_each(|v| *v /= n);
        Ok(())
    }
    fn all_reduce_sum_f16(&self, buf: &mut [f16]) -> Result<(), CommSource> {
        self.half_sum(buf, |b| f16::from_bits(u16::from_ne_bytes(b)), f16::to_f32, f16::from_f32)
    }
    fn all_reduce_sum_bf16(&self, buf: &mut [bf16]) -> Result<(), CommSource> {
        self.half_sum(buf, |b| bf16::from_bits(u16::from_ne_bytes(b)), bf16::to_f32, bf16::from_f32)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommSource> {
        let all = self.exchange(bytemuck::cast_slice(buf))?;
        let src = all.get(root).ok_or_else(|| format!("broadcast root {root} out of range"))?;
        if src.len() != buf.len() * 4 {
            return Err(format!(
                "broadcast: root sent {} bytes, expected {}",
                src.len(),
                buf.len() * 4
            )
            .into());
        }
        for (d, s) in buf.iter_mut().zip(f32s(src)) {
            *d = s;
        }
        Ok(())
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        self.exchange(bytes)
    }
}

/// A world of one: every collective is the identity. What `Ddp` uses outside a launcher.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Collectives for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_avg(&self, _: &mut [f32]) -> Result<(), CommSource> {
        Ok(())
    }
    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<(), CommSource> {
        Ok(())
    }
    fn all_reduce_sum_f16(&self, _: &mut [f16]) -> Result<(), CommSource> {
        Ok(())
    }
    fn all_reduce_sum_bf16(&self, _: &mut [bf16]) -> Result<(), CommSource> {
        Ok(())
    }
    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<(), CommSource> {
        Ok(())
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommSource> {
        Ok(vec![bytes.to_vec()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_group_all_reduce_broadcast_gather() {
        let groups = LocalGroup::new(3);
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let r = g.rank() as f32;
                    let mut a = vec![r, 2.0 * r];
                    g.all_reduce_avg(&mut a).unwrap();
                    let mut b = vec![r + 10.0];
                    g.broadcast(&mut b, 2).unwrap();
                    let all = g.all_gather_bytes(&[g.rank() as u8]).unwrap();
                    (a, b, all)
                })
            })
            .collect();
        for h in hs {
            let (a, b, all) = h.join().unwrap();
            assert_eq!(a, vec![1.0, 2.0]);
            assert_eq!(b, vec![12.0]);
            assert_eq!(all, vec![vec![0u8], vec![1], vec![2]]);
        }
    }

    #[test]
    fn local_group_times_out_instead_of_hanging() {
        let mut groups = LocalGroup::with_timeout(2, Duration::from_millis(100));
        let g0 = groups.remove(0);
        let err = g0.all_reduce_avg(&mut [1.0]).unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
    }
}
