//! PowerSGD gradient compression (Vogels et al. 2019; PyTorch's `powerSGD_hook`) as a DDP comm
//! hook. Each gradient of 2+ dimensions, viewed as an `n × m` matrix `M` (first dimension by the
//! rest), is sent as two thin factors: `P = M·Q` (`n × r`), all-reduced and orthonormalised,
//! then `Q = Mᵀ·P` (`m × r`), all-reduced; every rank uses `P·Qᵀ / world` — `r(n+m)` numbers on
//! the wire instead of `nm`. What the approximation misses is kept per parameter and added to
//! the next step's gradient (error feedback), and `Q` is reused as the next step's starting
//! point (warm start). Vectors (biases) and matrices too small to gain `min_compression_rate`
//! are all-reduced as they are, and the first `start_iter` steps are plain all-reduce (as in
//! PyTorch, letting training settle first). Written here rather than taken from a crate: no
//! Rust crate implements it; the small matrix products are plain loops.
use std::collections::HashMap;
use std::sync::Mutex;

use crate::comm_hooks::{BucketParam, CommHook, GradBucket};
use tandem_comm::Collectives;
use tandem_comm::CommSource;

#[derive(Clone, Copy, Debug)]
pub struct PowerSgdOptions {
    /// Rank `r` of the approximation (PyTorch's `matrix_approximation_rank`).
    pub rank: usize,
    /// Steps of plain all-reduce before compression starts (`start_powerSGD_iter`).
    pub start_iter: u64,
    /// Compress a matrix only when `nm / (r(n+m))` is at least this (`min_compression_rate`).
    pub min_compression_rate: f64,
    /// Keep what the approximation missed and add it to the next gradient.
    pub error_feedback: bool,
    /// Seed of the random initial `Q`s (the same on every rank).
    pub seed: u64,
}

impl Default for PowerSgdOptions {
    fn default() -> Self {
        // PyTorch's defaults except start_iter (1000 there): tandem's runs are short.
        PowerSgdOptions {
            rank: 2,
            start_iter: 10,
            min_compression_rate: 2.0,
            error_feedback: true,
            seed: 0,
        }
    }
}

/// Per-parameter state: the warm-started `Q` (`m × r`, row-major) and the error.
struct ParamState {
    q: Vec<f32>,
    error: Vec<f32>,
}

pub struct PowerSgd {
    opts: PowerSgdOptions,
    state: Mutex<(u64, HashMap<usize, ParamState>)>,
}

impl PowerSgd {
    pub fn new(opts: PowerSgdOptions) -> Self {
        PowerSgd { opts, state: Mutex::new((0, HashMap::new())) }
    }

    /// `(n, m)` when `p` is compressed, else `None`.
    fn matrix(&self, p: &BucketParam) -> Option<(usize, usize)> {
        if p.shape.len() < 2 {
            return None;
        }
        let n = p.shape[0];
        let m = p.numel() / n.max(1);
        let r = self.opts.rank.min(n).min(m);
        let rate = (n * m) as f64 / (r * (n + m)).max(1) as f64;
        (r > 0 && rate >= self.opts.min_compression_rate).then_some((n, m))
    }
}

impl CommHook for PowerSgd {
    fn name(&self) -> &str {
        "powersgd"
    }

    fn reduce(&self, comm: &dyn Collectives, bucket: GradBucket<'_>) -> Result<(), CommSource> {
        let mut guard = self.state.lock().map_err(|_| "PowerSGD state poisoned")?;
        let (steps, states) = &mut *guard;
        // One bucket per call; count steps on bucket 0, which every step launches.
        if bucket.index == 0 {
            *steps += 1;
        }
        if *steps <= self.opts.start_iter {
            return comm.all_reduce_avg(bucket.buffer);
        }
        let world = comm.size() as f32;
        let buf = bucket.buffer;
        let (compressed, plain): (Vec<&BucketParam>, Vec<&BucketParam>) =
            bucket.params.iter().partition(|p| self.matrix(p).is_some());

        // Error feedback first, on every compressed gradient.
        for p in &compressed {
            let st = states.entry(p.index).or_insert_with(|| {
                let (n, m) = self.matrix(p).unwrap_or((0, 0));
                let r = self.opts.rank.min(n).min(m);
                ParamState { q: gaussian(m * r, self.opts.seed ^ p.index as u64), error: vec![] }
            });
            let g = &mut buf[p.offset..p.offset + p.numel()];
            if self.opts.error_feedback && st.error.len() == g.len() {
                g.iter_mut().zip(&st.error).for_each(|(x, e)| *x += e);
            }
        }
        // Uncompressed gradients travel together.
        let mut flat: Vec<f32> =
            plain.iter().flat_map(|p| buf[p.offset..p.offset + p.numel()].to_vec()).collect();
        if !flat.is_empty() {
            comm.all_reduce_avg(&mut flat)?;
            let mut at = 0;
            for p in &plain {
                buf[p.offset..p.offset + p.numel()].copy_from_slice(&flat[at..at + p.numel()]);
                at += p.numel();
            }
        }
        if compressed.is_empty() {
            return Ok(());
        }
        let dims: Vec<(usize, usize, usize)> = compressed
            .iter()
            .map(|p| {
                let (n, m) = self.matrix(p).unwrap_or((1, 1));
                (n, m, self.opts.rank.min(n).min(m))
            })
            .collect();
        // P = M·Q for every matrix, all-reduced (sum) in one buffer, then orthonormalised.
        let mut ps: Vec<f32> = Vec::new();
        for (p, &(n, m, r)) in compressed.iter().zip(&dims) {
            let mat = &buf[p.offset..p.offset + n * m];
            ps.extend(matmul(mat, &states[&p.index].q, n, m, r));
        }
        comm.all_reduce_sum(&mut ps)?;
        let mut at = 0;
        for &(n, _, r) in &dims {
            orthonormalise_columns(&mut ps[at..at + n * r], n, r);
            at += n * r;
        }
        // Q = Mᵀ·P, all-reduced (sum); the approximation is P·Qᵀ / world.
        let mut qs: Vec<f32> = Vec::new();
        let mut at = 0;
        for (p, &(n, m, r)) in compressed.iter().zip(&dims) {
            let mat = &buf[p.offset..p.offset + n * m];
            qs.extend(matmul_tn(mat, &ps[at..at + n * r], n, m, r));
            at += n * r;
        }
        comm.all_reduce_sum(&mut qs)?;
        let (mut pa, mut qa) = (0, 0);
        for (p, &(n, m, r)) in compressed.iter().zip(&dims) {
            let (pm, qm) = (&ps[pa..pa + n * r], &qs[qa..qa + m * r]);
            let st = states.get_mut(&p.index).ok_or("PowerSGD state vanished")?;
            let g = &mut buf[p.offset..p.offset + n * m];
            let local = if self.opts.error_feedback { g.to_vec() } else { Vec::new() };
            for i in 0..n {
                for j in 0..m {
                    let v: f32 = (0..r).map(|k| pm[i * r + k] * qm[j * r + k]).sum();
                    g[i * m + j] = v / world;
                }
            }
            if self.opts.error_feedback {
                st.error = local.iter().zip(g.iter()).map(|(l, a)| l - a).collect();
            }
            // Warm start: this step's Q (the sum over ranks) seeds the next.
            st.q.copy_from_slice(qm);
            pa += n * r;
            qa += m * r;
        }
        Ok(())
    }
}

/// `a (n×m) · b (m×r)`, row-major.
fn matmul(a: &[f32], b: &[f32], n: usize, m: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * r];
    for i in 0..n {
        let row = &a[i * m..(i + 1) * m];
        for (j, &x) in row.iter().enumerate() {
            let brow = &b[j * r..(j + 1) * r];
            for k in 0..r {
                out[i * r + k] += x * brow[k];
            }
        }
    }
    out
}

/// `aᵀ (m×n) · p (n×r)`, row-major, for `a` of `n×m`.
fn matmul_tn(a: &[f32], p: &[f32], n: usize, m: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * r];
    for i in 0..n {
        let row = &a[i * m..(i + 1) * m];
        let prow = &p[i * r..(i + 1) * r];
        for (j, &x) in row.iter().enumerate() {
            for k in 0..r {
                out[j * r + k] += x * prow[k];
            }
        }
    }
    out
}

/// Gram-Schmidt on the `r` columns of `p` (`n×r`, row-major); a column that vanishes becomes
/// zero instead of NaN (PyTorch adds an epsilon for the same reason).
fn orthonormalise_columns(p: &mut [f32], n: usize, r: usize) {
    for c in 0..r {
        for prev in 0..c {
            let dot: f32 = (0..n).map(|i| p[i * r + c] * p[i * r + prev]).sum();
            for i in 0..n {
                p[i * r + c] -= dot * p[i * r + prev];
            }
        }
        let norm = (0..n).map(|i| p[i * r + c] * p[i * r + c]).sum::<f32>().sqrt();
        let scale = if norm > 1e-8 { 1.0 / norm } else { 0.0 };
        for i in 0..n {
            p[i * r + c] *= scale;
        }
    }
}

/// Standard normal numbers from a seed (splitmix64 + Box-Muller): the same on every rank.
fn gaussian(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut next = move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..len)
        .map(|_| {
            let (u1, u2) = (next().max(1e-300), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_comm::LocalGroup;

    /// Runs one PowerSGD reduce of a bucket holding a `n×m` matrix and a vector on 2 ranks.
    fn reduce2(opts: PowerSgdOptions, steps: usize, n: usize, m: usize) -> Vec<Vec<Vec<f32>>> {
        let hs: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let hook = PowerSgd::new(opts);
                    let params = [
                        BucketParam { index: 0, offset: 0, shape: vec![n, m] },
                        BucketParam { index: 1, offset: n * m, shape: vec![3] },
                    ];
                    let rank = g.rank() as f32;
                    (0..steps)
                        .map(|s| {
                            let mut buf: Vec<f32> = (0..n * m + 3)
                                .map(|i| ((i * 7 + s * 3) % 11) as f32 * 0.1 + rank)
                                .collect();
                            let bucket = GradBucket { index: 0, buffer: &mut buf, params: &params };
                            hook.reduce(&g, bucket).unwrap();
                            buf
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Equal up to f32 rounding of the two-rank average.
    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-6, "element {i}: {g} vs {w}");
        }
    }

    fn exact_average(n: usize, m: usize, s: usize) -> Vec<f32> {
        (0..n * m + 3).map(|i| ((i * 7 + s * 3) % 11) as f32 * 0.1 + 0.5).collect()
    }

    #[test]
    fn full_rank_powersgd_is_the_exact_average() {
        // r = min(n, m): P spans the column space, so P·Pᵀ·M = M.
        let opts = PowerSgdOptions {
            rank: 4,
            start_iter: 0,
            min_compression_rate: 0.0,
            ..Default::default()
        };
        let out = reduce2(opts, 2, 4, 9);
        for (s, (mine, theirs)) in out[0].iter().zip(&out[1]).enumerate() {
            assert_eq!(mine, theirs, "ranks disagree");
            for (got, want) in mine.iter().zip(exact_average(4, 9, s)) {
                assert!((got - want).abs() < 1e-4, "step {s}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn low_rank_is_approximate_and_error_feedback_keeps_the_sum() {
        let (n, m, steps) = (6, 8, 12);
        let opts = PowerSgdOptions {
            rank: 1,
            start_iter: 0,
            min_compression_rate: 0.0,
            ..Default::default()
        };
        let out = reduce2(opts, steps, n, m);
        // Each step is only an approximation of the matrix part...
        let first_gap: f32 = out[0][0][..n * m]
            .iter()
            .zip(exact_average(n, m, 0))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(first_gap > 1e-2, "rank 1 of a rank-6 matrix cannot be exact ({first_gap})");
        // ...the vector is exact...
        assert_close(&out[0][0][n * m..], &exact_average(n, m, 0)[n * m..]);
        // ...and with error feedback, what was applied over the steps tracks the sum of the true
        // averages far better than one step's error (the residual is carried, not lost).
        let mut applied = vec![0f32; n * m];
        let mut truth = vec![0f32; n * m];
        for (s, step) in out[0].iter().enumerate() {
            applied.iter_mut().zip(step).for_each(|(a, g)| *a += g);
            truth.iter_mut().zip(exact_average(n, m, s)).for_each(|(t, g)| *t += g);
        }
        let drift: f32 = applied.iter().zip(&truth).map(|(a, t)| (a - t).abs()).fold(0.0, f32::max);
        assert!(drift < first_gap * 3.0, "accumulated drift {drift} vs one-step gap {first_gap}");
        let no_feedback = PowerSgdOptions { error_feedback: false, ..opts };
        let plain = reduce2(no_feedback, steps, n, m);
        let mut applied_nf = vec![0f32; n * m];
        for step in &plain[0] {
            applied_nf.iter_mut().zip(step).for_each(|(a, g)| *a += g);
        }
        let drift_nf: f32 =
            applied_nf.iter().zip(&truth).map(|(a, t)| (a - t).abs()).fold(0.0, f32::max);
        assert!(drift < drift_nf, "error feedback did not help: {drift} vs {drift_nf}");
    }

    #[test]
    fn warm_up_steps_and_small_matrices_are_plain_all_reduce() {
        let opts = PowerSgdOptions { rank: 1, start_iter: 2, ..Default::default() };
        let out = reduce2(opts, 3, 6, 8);
        assert_close(&out[0][0], &exact_average(6, 8, 0));
        assert_close(&out[0][1], &exact_average(6, 8, 1));
        let gap = out[0][2].iter().zip(exact_average(6, 8, 2)).map(|(a, b)| (a - b).abs());
        assert!(gap.fold(0f32, f32::max) > 1e-2, "step 3 should be compressed");
        // 2×2 at rank 1 compresses 4 numbers into 4: below min_compression_rate, sent whole.
        let small = reduce2(PowerSgdOptions { start_iter: 0, ..opts }, 1, 2, 2);
        assert_close(&small[0][0], &exact_average(2, 2, 0));
    }
}
