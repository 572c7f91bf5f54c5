//! DDP communication hooks (PyTorch's `DistributedDataParallel.register_comm_hook`): what
//! happens to each flat gradient bucket between "every gradient of this bucket is ready" and
//! "the optimizer reads the averaged gradients". The default is a plain all-reduce average.
//! [`Fp16Compress`] and [`Bf16Compress`] halve the bytes on the wire, as PyTorch's
//! `fp16_compress_hook` / `bf16_compress_hook` do: cast the bucket to the 16-bit type, divide by
//! the world size, all-reduce (sum) in that type, cast back.
//! [`crate::powersgd::PowerSgd`] sends low-rank approximations with error feedback. Your own hook implements
//! [`CommHook`]; it runs on the reducer's communication thread, bucket by bucket in launch order,
//! and must make the same collective calls on every rank.
use std::sync::Arc;

use half::{bf16, f16};

use tandem_comm::Collectives;
use tandem_comm::CommSource;

/// One bucket handed to a hook (PyTorch's `GradBucket`).
pub struct GradBucket<'a> {
    /// The bucket's position in launch order (0 is launched first).
    pub index: usize,
    /// This rank's gradients on entry; what every rank uses on return (normally the average).
    pub buffer: &'a mut [f32],
    /// The parameters whose gradients the buffer holds (PyTorch's `bucket.parameters()`).
    pub params: &'a [BucketParam],
}

/// Where one parameter's gradient sits in a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketParam {
    /// The parameter's index in the model's parameter order (stable across bucket rebuilds).
    pub index: usize,
    /// First element in the bucket buffer.
    pub offset: usize,
    pub shape: Vec<usize>,
}

impl BucketParam {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A communication hook. `reduce` is a collective: every rank calls it for the same buckets in
/// the same order.
pub trait CommHook: Send + Sync {
    /// Shown in errors, and compared across ranks when the hook is registered.
    fn name(&self) -> &str;
    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource>;
    /// What this hook does to a bucket, when CUDA gradients can do it on the GPU with NCCL
    /// instead of calling [`CommHook::reduce`] on host memory. `None` (the default): the
    /// gradients are staged through the host and `reduce` runs there.
    fn on_device(&self) -> Option<DeviceWire> {
        None
    }
}

/// A built-in hook's reduction on the GPU: the bucket all-reduced as f32 (the average), or
/// compressed to a 16-bit type as [`Fp16Compress`] and [`Bf16Compress`] do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceWire {
    F32,
    F16,
    Bf16,
}

/// The default: all-reduce average in f32.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceAvg;

impl CommHook for AllReduceAvg {
    fn name(&self) -> &str {
        "allreduce"
    }
    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource> {
        comm.all_reduce_avg(bucket.buffer)
    }
    fn on_device(&self) -> Option<DeviceWire> {
        Some(DeviceWire::F32)
    }
}

/// fp16 compression: half the bytes; values beyond ±65504 become infinite and tiny ones lose
/// precision, as with PyTorch's hook.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp16Compress;

impl CommHook for Fp16Compress {
    fn name(&self) -> &str {
        "fp16"
    }
    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource> {
        compressed(comm, bucket.buffer, f16::from_f32, f16::to_f32, |c, w| c.all_reduce_sum_f16(w))
    }
    fn on_device(&self) -> Option<DeviceWire> {
        Some(DeviceWire::F16)
    }
}

/// Cast to the wire type, divide by the world size (in that type, as PyTorch's hooks do),
/// all-reduce the sum in that type, cast back.
fn compressed<W: Copy>(
    comm: &dyn Collectives,
    buffer: &mut [f32],
    to_wire: fn(f32) -> W,
    from_wire: fn(W) -> f32,
    sum: impl Fn(&dyn Collectives, &mut [W]) -> Result<(), CommSource>,
) -> Result<(), CommSource> {
    let n = comm.size() as f32;
    let mut wire: Vec<W> = buffer.iter().map(|&g| to_wire(from_wire(to_wire(g)) / n)).collect();
    sum(comm, &mut wire)?;
    buffer.iter_mut().zip(&wire).for_each(|(g, &w)| *g = from_wire(w));
    Ok(())
}

/// bf16 compression: half the bytes, f32's range, 8 bits of mantissa.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16Compress;

impl CommHook for Bf16Compress {
    fn name(&self) -> &str {
        "bf16"
    }
    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource> {
        compressed(comm, bucket.buffer, bf16::from_f32, bf16::to_f32, |c, w| {
            c.all_reduce_sum_bf16(w)
        })
    }
    fn on_device(&self) -> Option<DeviceWire> {
        Some(DeviceWire::Bf16)
    }
}

/// The built-in hooks by name, as `tandem train --comm-hook` spells them.
pub fn builtin(name: &str) -> Option<Arc<dyn CommHook>> {
    match name {
        "none" | "allreduce" => Some(Arc::new(AllReduceAvg)),
        "fp16" => Some(Arc::new(Fp16Compress)),
        "bf16" => Some(Arc::new(Bf16Compress)),
        "powersgd" => Some(Arc::new(crate::powersgd::PowerSgd::new(
            crate::powersgd::PowerSgdOptions::default(),
        ))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_comm::LocalGroup;

    fn run3(hook: Arc<dyn CommHook>, per_rank: fn(usize) -> Vec<f32>) -> Vec<Vec<f32>> {
        let hs: Vec<_> = LocalGroup::new(3)
            .into_iter()
            .map(|g| {
                let hook = hook.clone();
                std::thread::spawn(move || {
                    let mut buf = per_rank(g.rank());
                    let params = [BucketParam { index: 0, offset: 0, shape: vec![buf.len()] }];
                    hook.reduce(&g, GradBucket { index: 0, buffer: &mut buf, params: &params })
                        .unwrap();
                    buf
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn grads(rank: usize) -> Vec<f32> {
        vec![
            0.1 * rank as f32 + 0.3,
            -1.5e-3 * (rank + 1) as f32,
            1000.37 + 1.13 * rank as f32,
            3e-8,
        ]
    }

    #[test]
    fn compressed_average_is_the_average_to_the_wire_type_precision() {
        let exact: Vec<f32> =
            (0..4).map(|i| (0..3).map(|r| grads(r)[i]).sum::<f32>() / 3.0).collect();
        for (hook, rel) in [(builtin("fp16").unwrap(), 2e-3), (builtin("bf16").unwrap(), 1.6e-2)] {
            let out = run3(hook.clone(), grads);
            assert!(out.iter().all(|o| o == &out[0]), "{}: ranks disagree", hook.name());
            for (i, (&got, &want)) in out[0].iter().zip(&exact).enumerate().take(3) {
                let err = ((got - want) / want).abs();
                assert!(err < rel, "{} element {i}: {got} vs {want} (rel {err})", hook.name());
                // And not exact: the compression really happened.
                assert_ne!(got, want, "{} element {i} is exact: no compression?", hook.name());
            }
        }
        // 3e-8 is below fp16's smallest subnormal (6e-8) once divided by 3: it flushes to 0,
        // as PyTorch's fp16 hook does; bf16 keeps f32's exponent range.
        assert_eq!(run3(builtin("fp16").unwrap(), grads)[0][3], 0.0);
        assert!(run3(builtin("bf16").unwrap(), grads)[0][3] > 2.9e-8);
    }

    #[test]
    fn the_default_hook_is_the_plain_average() {
        let out = run3(builtin("none").unwrap(), grads);
        let direct = run3(Arc::new(AllReduceAvg), grads);
        assert_eq!(out, direct);
        assert!(builtin("topk").is_none());
        assert_eq!(builtin("powersgd").unwrap().name(), "powersgd");
    }
}
