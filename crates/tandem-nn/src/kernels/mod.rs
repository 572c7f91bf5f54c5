//! CPU kernels for convolutional nets, written here because candle's CPU path is the
//! bottleneck (see each module) and no crate offers trainable conv kernels on plain slices. The
//! matrix products are `gemm`'s (the crate candle itself uses); what is ours is the data layout
//! around them and the backward passes.
pub mod batch_norm;
pub mod conv2d;
mod matmul;
pub mod pool;
pub mod prelu;
pub mod relu;
pub mod winograd;

/// Runs `f` on the tensor's data as one contiguous f32 slice, copying only when the tensor is
/// strided or not on the CPU.
pub fn with_f32_slice<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    if t.dtype() != candle_core::DType::F32 {
        candle_core::bail!("expected an f32 tensor, got {:?}", t.dtype())
    }
    if t.device().is_cpu() {
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// Independent accumulators of a sum (two AVX-512 registers of f64).
const SUM_LANES: usize = 16;

/// `(Σ f(v)[0], Σ f(v)[1])` over the values of the slices `v` (all of one length) in f64,
/// over [`SUM_LANES`] independent accumulators so that the loop vectorises (one f64 chain per
/// element was the kernel's slowest part). f64 because the sums of a BatchNorm's backward
/// cancel (Σ gy over a channel is often ~0 while its terms are not).
#[inline(always)]
pub(crate) fn lane_sums<const K: usize>(
    v: [&[f32]; K],
    f: impl Fn([f32; K]) -> [f32; 2],
) -> (f64, f64) {
    let len = v[0].len();
    let (mut a, mut b) = ([0f64; SUM_LANES], [0f64; SUM_LANES]);
    let whole = len / SUM_LANES * SUM_LANES;
    for at in (0..whole).step_by(SUM_LANES) {
        let c: [&[f32; SUM_LANES]; K] =
            std::array::from_fn(|k| v[k][at..at + SUM_LANES].try_into().expect("SUM_LANES values"));
        for l in 0..SUM_LANES {
            let [p, q] = f(std::array::from_fn(|k| c[k][l]));
            a[l] += p as f64;
            b[l] += q as f64;
        }
    }
    let tail = (whole..len).map(|i| f(std::array::from_fn(|k| v[k][i])));
    tail.fold((a.iter().sum::<f64>(), b.iter().sum::<f64>()), |(ta, tb), [p, q]| {
        (ta + p as f64, tb + q as f64)
    })
}
