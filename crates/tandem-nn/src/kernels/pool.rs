//! `max_pool2d` on CPU f32 tensors with the argmax kept for backward.
//!
//! Why: candle's `max_pool2d` backward scales the gradient wrongly (candle-core 0.11.1: it
//! multiplies by the window's fraction of maxima instead of routing to the maximum), and the
//! reshape-and-reduce workaround runs strided reductions plus an equality mask in backward.
//! Here forward records each output's source index; backward adds the gradient there (the
//! first maximum of a window wins ties, as in PyTorch).
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::with_f32_slice;

#[derive(Clone, Copy, Debug)]
struct Pool {
    kernel: usize,
    stride: usize,
}

impl Pool {
    fn out(&self, size: usize) -> usize {
        (size - self.kernel) / self.stride + 1
    }

    /// For one plane: each output's value and the index of its maximum within the plane.
    fn plane(&self, x: &[f32], w: usize, y: &mut [f32], arg: &mut [u32]) {
        if self.kernel == 2 && self.stride == 2 {
            Self::plane_2x2(x, w, y, arg)
        } else {
            self.plane_any(x, w, y, arg)
        }
    }

    /// [`Pool::plane`] for any window and stride.
    fn plane_any(&self, x: &[f32], w: usize, y: &mut [f32], arg: &mut [u32]) {
        let wo = self.out(w);
        for (o, (y, arg)) in y.iter_mut().zip(arg.iter_mut()).enumerate() {
            let (oy, ox) = (o / wo, o % wo);
            let (mut best, mut at) = (f32::NEG_INFINITY, (oy * self.stride) * w + ox * self.stride);
            for ky in 0..self.kernel {
                let row = (oy * self.stride + ky) * w + ox * self.stride;
                for (kx, &v) in x[row..row + self.kernel].iter().enumerate() {
                    // PyTorch's rule: a larger value or any NaN takes the window (the last NaN).
                    if v > best || v.is_nan() {
                        (best, at) = (v, row + kx);
                    }
                }
            }
            (*y, *arg) = (best, at as u32);
        }
    }

    /// [`Pool::plane`] for the common 2x2 window at stride 2, row pair by row pair without
    /// index arithmetic per output; the same winner (the first maximum, or the last NaN).
    fn plane_2x2(x: &[f32], w: usize, y: &mut [f32], arg: &mut [u32]) {
        let wo = (w - 2) / 2 + 1;
        for (oy, (y, arg)) in y.chunks_exact_mut(wo).zip(arg.chunks_exact_mut(wo)).enumerate() {
            let top = 2 * oy * w;
            let (r0, r1) = (&x[top..top + w], &x[top + w..top + 2 * w]);
            for (ox, (y, arg)) in y.iter_mut().zip(arg.iter_mut()).enumerate() {
                let c = 2 * ox;
                let v = [r0[c], r0[c + 1], r1[c], r1[c + 1]];
                let at = [top + c, top + c + 1, top + w + c, top + w + c + 1];
                let (mut best, mut i) = (v[0], 0);
                for (k, &vk) in v.iter().enumerate().skip(1) {
                    if vk > best {
                        (best, i) = (vk, k);
                    }
                }
                if v.iter().any(|v| v.is_nan()) {
                    i = v.iter().rposition(|v| v.is_nan()).unwrap_or(0);
                    best = v[i];
                }
                (*y, *arg) = (best, at[i] as u32);
            }
        }
    }

    fn forward(&self, x: &[f32], (planes, h, w): (usize, usize, usize)) -> (Vec<f32>, Vec<u32>) {
        let per_out = self.out(h) * self.out(w);
        let mut y = vec![0f32; planes * per_out];
        let mut arg = vec![0u32; planes * per_out];
        y.par_chunks_mut(per_out)
            .zip(arg.par_chunks_mut(per_out))
            .zip(x.par_chunks(h * w))
            .for_each(|((y, arg), x)| self.plane(x, w, y, arg));
        (y, arg)
    }
}

/// The op keeps the forward's argmax for its backward (PyTorch keeps the indices likewise)
/// instead of scanning the input again.
struct MaxPool(Pool, std::sync::Mutex<Option<Vec<u32>>>);

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "tandem-max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (&[n, c, h, w], CpuStorage::F32(v), Some((a, b))) =
            (l.dims(), s, l.contiguous_offsets())
        else {
            candle_core::bail!("max_pool2d: contiguous f32 [N, C, H, W] only, got {:?}", l.dims())
        };
        let (y, arg) = self.0.forward(&v[a..b], (n * c, h, w));
        *self.1.lock().unwrap_or_else(|e| e.into_inner()) = Some(arg);
        Ok((CpuStorage::F32(y), Shape::from((n, c, self.0.out(h), self.0.out(w)))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, gy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (n, c, h, w) = x.dims4()?;
        let kept = self.1.lock().unwrap_or_else(|e| e.into_inner()).take();
        let arg = match kept {
            Some(arg) => arg,
            None => with_f32_slice(x, |x| self.0.forward(x, (n * c, h, w)))?.1,
        };
        let per_out = self.0.out(h) * self.0.out(w);
        let gx = with_f32_slice(&gy.contiguous()?, |gy| {
            let mut gx = vec![0f32; n * c * h * w];
            gx.par_chunks_mut(h * w)
                .zip(gy.par_chunks(per_out).zip(arg.par_chunks(per_out)))
                .for_each(|(gx, (gy, arg))| {
                    for (&g, &at) in gy.iter().zip(arg) {
                        gx[at as usize] += g;
                    }
                });
            gx
        })?;
        Ok(Some(Tensor::from_vec(gx, x.shape(), x.device())?))
    }
}

/// `torch.nn.functional.max_pool2d(x, kernel, stride)` (no padding) for `x: [N, C, H, W]`,
/// with the kernel above on CPU f32 tensors and candle's pooling elsewhere.
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize) -> candle_core::Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    if kernel == 0 || stride == 0 || kernel > h || kernel > w {
        candle_core::bail!(
            "max_pool2d: kernel {kernel}, stride {stride} do not fit a {h}x{w} input"
        )
    }
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        x.contiguous()?.apply_op1(MaxPool(Pool { kernel, stride }, Default::default()))
    } else {
        x.max_pool2d_with_stride(kernel, stride)
    }
}

/// Average pooling windows of one spatial dimension: output `o` averages inputs `start..end`.
/// PyTorch's rules: fixed windows for `avg_pool2d(kernel, stride)` (no padding), and for
/// `adaptive_avg_pool2d(out)` start = floor(o·in/out), end = ceil((o+1)·in/out).
fn windows(size: usize, spec: AvgSpec) -> Vec<(usize, usize)> {
    match spec {
        AvgSpec::Fixed { kernel, stride } => {
            (0..(size - kernel) / stride + 1).map(|o| (o * stride, o * stride + kernel)).collect()
        }
        AvgSpec::Adaptive { out } => {
            (0..out).map(|o| (o * size / out, ((o + 1) * size).div_ceil(out))).collect()
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum AvgSpec {
    Fixed { kernel: usize, stride: usize },
    Adaptive { out: usize },
}

struct AvgPool {
    rows: Vec<(usize, usize)>,
    cols: Vec<(usize, usize)>,
}

impl AvgPool {
    fn new(h: usize, w: usize, spec: (AvgSpec, AvgSpec)) -> Self {
        AvgPool { rows: windows(h, spec.0), cols: windows(w, spec.1) }
    }

    fn out_len(&self) -> usize {
        self.rows.len() * self.cols.len()
    }
}

struct AvgPoolOp(AvgSpec, AvgSpec);

impl CustomOp1 for AvgPoolOp {
    fn name(&self) -> &'static str {
        "tandem-avg-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (&[n, c, h, w], CpuStorage::F32(v), Some((a, b))) =
            (l.dims(), s, l.contiguous_offsets())
        else {
            candle_core::bail!("avg_pool2d: contiguous f32 [N, C, H, W] only, got {:?}", l.dims())
        };
        let pool = AvgPool::new(h, w, (self.0, self.1));
        let mut y = vec![0f32; n * c * pool.out_len()];
        y.par_chunks_mut(pool.out_len()).zip(v[a..b].par_chunks(h * w)).for_each(|(y, x)| {
            let mut o = 0;
            for &(r0, r1) in &pool.rows {
                for &(c0, c1) in &pool.cols {
                    let mut sum = 0f32;
                    for r in r0..r1 {
                        sum += x[r * w + c0..r * w + c1].iter().sum::<f32>();
                    }
                    y[o] = sum / ((r1 - r0) * (c1 - c0)) as f32;
                    o += 1;
                }
            }
        });
        Ok((CpuStorage::F32(y), Shape::from((n, c, pool.rows.len(), pool.cols.len()))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, gy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (n, c, h, w) = x.dims4()?;
        let pool = AvgPool::new(h, w, (self.0, self.1));
        let gx = with_f32_slice(&gy.contiguous()?, |gy| {
            let mut gx = vec![0f32; n * c * h * w];
            gx.par_chunks_mut(h * w).zip(gy.par_chunks(pool.out_len())).for_each(|(gx, gy)| {
                let mut o = 0;
                for &(r0, r1) in &pool.rows {
                    for &(c0, c1) in &pool.cols {
                        let share = gy[o] / ((r1 - r0) * (c1 - c0)) as f32;
                        for r in r0..r1 {
                            gx[r * w + c0..r * w + c1].iter_mut().for_each(|g| *g += share);
                        }
                        o += 1;
                    }
                }
            });
            gx
        })?;
        Ok(Some(Tensor::from_vec(gx, x.shape(), x.device())?))
    }
}

fn avg_pool(x: &Tensor, spec: (AvgSpec, AvgSpec)) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        return x.contiguous()?.apply_op1(AvgPoolOp(spec.0, spec.1));
    }
    candle_core::bail!(
        "avg pooling kernels run on CPU f32 tensors; got {:?} on {:?}",
        x.dtype(),
        x.device()
    )
}

/// `torch.nn.functional.avg_pool2d(x, kernel, stride)` (no padding) for `x: [N, C, H, W]`.
pub fn avg_pool2d(x: &Tensor, kernel: usize, stride: usize) -> candle_core::Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    if kernel == 0 || stride == 0 || kernel > h || kernel > w {
        candle_core::bail!(
            "avg_pool2d: kernel {kernel}, stride {stride} do not fit a {h}x{w} input"
        )
    }
    let s = AvgSpec::Fixed { kernel, stride };
    avg_pool(x, (s, s))
}

/// `torch.nn.functional.adaptive_avg_pool2d(x, (oh, ow))` for `x: [N, C, H, W]`
/// (`(1, 1)` is global average pooling).
pub fn adaptive_avg_pool2d(x: &Tensor, (oh, ow): (usize, usize)) -> candle_core::Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    if oh == 0 || ow == 0 || oh > h || ow > w {
        candle_core::bail!("adaptive_avg_pool2d: output {oh}x{ow} does not fit a {h}x{w} input")
    }
    avg_pool(x, (AvgSpec::Adaptive { out: oh }, AvgSpec::Adaptive { out: ow }))
}

#[cfg(test)]
mod tests {
    use super::Pool;

    /// The 2x2 fast path picks what the general scan picks, on odd sizes (the last row and
    /// column left out), ties (the first maximum) and NaNs (the last NaN, as PyTorch).
    #[test]
    fn the_two_by_two_path_equals_the_general_scan() {
        let pool = Pool { kernel: 2, stride: 2 };
        for (h, w) in [(7, 9), (8, 8), (2, 3)] {
            let mut x: Vec<f32> = (0..h * w).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
            x[1] = f32::NAN;
            x[w] = f32::NAN;
            if h > 2 {
                x[2 * w + 2..2 * w + 4].fill(9.0);
            }
            let n = pool.out(h) * pool.out(w);
            let (mut y1, mut a1) = (vec![0f32; n], vec![0u32; n]);
            let (mut y2, mut a2) = (vec![0f32; n], vec![0u32; n]);
            Pool::plane_2x2(&x, w, &mut y1, &mut a1);
            pool.plane_any(&x, w, &mut y2, &mut a2);
            assert_eq!(a1, a2, "{h}x{w}: argmax differs");
            assert_eq!(a1[0] as usize, w, "{h}x{w}: the last NaN of the window wins");
            let same = y1.iter().zip(&y2).all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
            assert!(same, "{h}x{w}: values differ");
        }
    }
}
