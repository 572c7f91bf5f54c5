//! The two tile sizes: F(2x2, 3x3) (a 4x4 input tile, 16 products per 2x2 outputs) and
//! F(4x4, 3x3) (a 6x6 input tile, 36 products per 4x4 outputs: 2.25 a pixel instead of 4), the
//! latter for the forward only (see `backward`). Each is its transforms' 1-D forms (Lavin and
//! Gray's matrices; the points 0, ±1, ±2 and ∞ for the larger tile); a 2-D transform applies
//! one to a tile's columns, then to the rows of the result.
//!
//! The kernels loop over `LANES` channels with the same arithmetic in each, so that the
//! compiler turns each lane loop into vector instructions; callers inline them into a
//! [`vectorized_kernel!`](crate::vectorized_kernel).
use super::{Lanes, LANES};

/// A Winograd tile size F(M x M, 3x3) and its forward's transforms, on `LANES` channels at
/// once. Tiles sit in bands: rows of a padded image `row_len` floats apart, `LANES` channels
/// per column.
pub(super) trait Tile {
    /// Outputs along a tile's side.
    const M: usize;
    /// Inputs along a tile's side.
    const ALPHA: usize = Self::M + 2;
    /// Positions of a transformed tile.
    const XI: usize = Self::ALPHA * Self::ALPHA;

    /// `Bᵀ·d·B` of the input tile whose top-left value is column `col` of the band's first
    /// row, into `out[ξ]`.
    fn input_tile(band: &[f32], row_len: usize, col: usize, out: &mut [Lanes]);
    /// `Aᵀ·m·A`: the outputs of a transformed tile, written to band rows `0..M`, columns
    /// `col..col + M`.
    fn output_tile(m: &[Lanes], band: &mut [f32], row_len: usize, col: usize);
    /// `G·g·Gᵀ` of `LANES` 3x3 filters (`g[k][lane]`: value `k` in row-major order), into
    /// `u[ξ]`.
    fn transform_filters(g: &[Lanes; 9], u: &mut [Lanes]);
}

/// A tile size the gradients are computed by: the adjoints of its forward's transforms.
pub(super) trait TileBackward: Tile {
    /// `A·g·Aᵀ` of the output gradients at band rows `0..M`, columns `col..col + M`.
    fn output_grad_tile(band: &[f32], row_len: usize, col: usize, out: &mut [Lanes]);
    /// `B·v·Bᵀ`: an input tile's gradient, added onto band rows `0..ALPHA`, columns
    /// `col..col + ALPHA`.
    fn input_grad_tile(v: &[Lanes], band: &mut [f32], row_len: usize, col: usize);
    /// `Gᵀ·u·G` of one filter from its transformed values `u(ξ)`: its 3x3 values.
    fn inverse_filter(u: impl Fn(usize) -> f32) -> [f32; 9];
}

/// The lanes at column `col` of a band row.
#[inline(always)]
fn lanes_at(band: &[f32], col: usize) -> &Lanes {
    band[col * LANES..(col + 1) * LANES].try_into().expect("LANES values")
}

/// A separable 2-D transform of an `R x C` tile `x(r, c)`: `cols` applied to every column,
/// then `rows` to every row of that, each result value handed to `put(p, q, value)`.
#[inline(always)]
fn separable<const R: usize, const C: usize, const P: usize, const Q: usize>(
    x: impl Fn(usize, usize) -> f32,
    cols: impl Fn([f32; R]) -> [f32; P],
    rows: impl Fn([f32; C]) -> [f32; Q],
    mut put: impl FnMut(usize, usize, f32),
) {
    let col: [[f32; P]; C] = std::array::from_fn(|c| cols(std::array::from_fn(|r| x(r, c))));
    let by_row: [[f32; C]; P] = std::array::from_fn(|p| std::array::from_fn(|c| col[c][p]));
    for (p, row) in by_row.into_iter().enumerate() {
        for (q, v) in rows(row).into_iter().enumerate() {
            put(p, q, v);
        }
    }
}

/// Implements [`Tile`] for a size from its forward's 1-D transforms (`bt`: Bᵀ·d, `at`: Aᵀ·m,
/// `g`: G·g), `$m` outputs and `$alpha` inputs a side.
macro_rules! tile_from_1d {
    ($tile:ty, $m:literal, $alpha:literal) => {
        impl Tile for $tile {
            const M: usize = $m;

            #[inline(always)]
            fn input_tile(band: &[f32], row_len: usize, col: usize, out: &mut [Lanes]) {
                let out: &mut [Lanes; $alpha * $alpha] = out.try_into().expect("a tile");
                let d: [&Lanes; $alpha * $alpha] = std::array::from_fn(|xi| {
                    lanes_at(&band[(xi / $alpha) * row_len..], col + xi % $alpha)
                });
                for l in 0..LANES {
                    separable(
                        |r, c| d[r * $alpha + c][l],
                        Self::bt,
                        Self::bt,
                        |p, q, v| out[p * $alpha + q][l] = v,
                    );
                }
            }

            #[inline(always)]
            fn output_tile(m: &[Lanes], band: &mut [f32], row_len: usize, col: usize) {
                let m: &[Lanes; $alpha * $alpha] = m.try_into().expect("a tile");
                let mut y = [[[0f32; LANES]; $m]; $m];
                for l in 0..LANES {
                    separable(
                        |k, c| m[k * $alpha + c][l],
                        Self::at,
                        Self::at,
                        |r, c, v| y[r][c][l] = v,
                    );
                }
                for (r, values) in y.iter().enumerate() {
                    band[r * row_len + col * LANES..][..$m * LANES]
                        .copy_from_slice(values.as_flattened());
                }
            }

            #[inline(always)]
            fn transform_filters(g: &[Lanes; 9], u: &mut [Lanes]) {
                let u: &mut [Lanes; $alpha * $alpha] = u.try_into().expect("a tile");
                for l in 0..LANES {
                    separable(
                        |r, c| g[r * 3 + c][l],
                        Self::g,
                        Self::g,
                        |k, j, v| u[k * $alpha + j][l] = v,
                    );
                }
            }
        }
    };
}

/// Implements [`TileBackward`] for a size from the adjoints of its 1-D transforms (`b`: B·v,
/// `a`: A·g, `gt`: Gᵀ·u).
macro_rules! tile_backward_from_1d {
    ($tile:ty, $m:literal, $alpha:literal) => {
        impl TileBackward for $tile {
            #[inline(always)]
            fn output_grad_tile(band: &[f32], row_len: usize, col: usize, out: &mut [Lanes]) {
                let out: &mut [Lanes; $alpha * $alpha] = out.try_into().expect("a tile");
                let g: [&Lanes; $m * $m] =
                    std::array::from_fn(|rc| lanes_at(&band[(rc / $m) * row_len..], col + rc % $m));
                for l in 0..LANES {
                    separable(
                        |r, c| g[r * $m + c][l],
                        Self::a,
                        Self::a,
                        |k, j, v| out[k * $alpha + j][l] = v,
                    );
                }
            }

            #[inline(always)]
            fn input_grad_tile(v: &[Lanes], band: &mut [f32], row_len: usize, col: usize) {
                let v: &[Lanes; $alpha * $alpha] = v.try_into().expect("a tile");
                let mut d = [[[0f32; LANES]; $alpha]; $alpha];
                for l in 0..LANES {
                    separable(
                        |k, c| v[k * $alpha + c][l],
                        Self::b,
                        Self::b,
                        |r, c, x| d[r][c][l] = x,
                    );
                }
                for (r, values) in d.iter().enumerate() {
                    let cells = &mut band[r * row_len + col * LANES..][..$alpha * LANES];
                    cells.iter_mut().zip(values.as_flattened()).for_each(|(c, x)| *c += x);
                }
            }

            #[inline(always)]
            fn inverse_filter(u: impl Fn(usize) -> f32) -> [f32; 9] {
                let mut g = [0f32; 9];
                separable(|k, j| u(k * $alpha + j), Self::gt, Self::gt, |r, c, v| g[r * 3 + c] = v);
                g
            }
        }
    };
}

/// F(2x2, 3x3).
pub(super) struct F2;

impl F2 {
    /// Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
    #[inline(always)]
    fn bt([d0, d1, d2, d3]: [f32; 4]) -> [f32; 4] {
        [d0 - d2, d1 + d2, d2 - d1, d1 - d3]
    }

    #[inline(always)]
    fn b([v0, v1, v2, v3]: [f32; 4]) -> [f32; 4] {
        [v0, v1 - v2 + v3, v1 + v2 - v0, -v3]
    }

    /// Aᵀ = [1 1 1 0; 0 1 -1 -1].
    #[inline(always)]
    fn at([m0, m1, m2, m3]: [f32; 4]) -> [f32; 2] {
        [m0 + m1 + m2, m1 - m2 - m3]
    }

    #[inline(always)]
    fn a([g0, g1]: [f32; 2]) -> [f32; 4] {
        [g0, g0 + g1, g0 - g1, -g1]
    }

    /// G = [1 0 0; ½ ½ ½; ½ -½ ½; 0 0 1].
    #[inline(always)]
    fn g([g0, g1, g2]: [f32; 3]) -> [f32; 4] {
        [g0, 0.5 * (g0 + g1 + g2), 0.5 * (g0 - g1 + g2), g2]
    }

    #[inline(always)]
    fn gt([u0, u1, u2, u3]: [f32; 4]) -> [f32; 3] {
        let (s, t) = (0.5 * (u1 + u2), 0.5 * (u1 - u2));
        [u0 + s, t, s + u3]
    }
}

tile_from_1d!(F2, 2, 4);
tile_backward_from_1d!(F2, 2, 4);

/// F(4x4, 3x3).
pub(super) struct F4;

impl F4 {
    /// Bᵀ = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
    /// 0 4 0 -5 0 1].
    #[inline(always)]
    fn bt([d0, d1, d2, d3, d4, d5]: [f32; 6]) -> [f32; 6] {
        let (p, q) = (d4 - 4.0 * d2, d3 - 4.0 * d1);
        let (s, t) = (d4 - d2, 2.0 * (d3 - d1));
        [4.0 * d0 - 5.0 * d2 + d4, p + q, p - q, s + t, s - t, 4.0 * d1 - 5.0 * d3 + d5]
    }

    /// Aᵀ = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1].
    #[inline(always)]
    fn at([m0, m1, m2, m3, m4, m5]: [f32; 6]) -> [f32; 4] {
        let (sum12, diff12, sum34, diff34) = (m1 + m2, m1 - m2, m3 + m4, m3 - m4);
        [m0 + sum12 + sum34, diff12 + 2.0 * diff34, sum12 + 4.0 * sum34, diff12 + 8.0 * diff34 + m5]
    }

    /// G = [¼ 0 0; -⅙ -⅙ -⅙; -⅙ ⅙ -⅙; 1/24 1/12 ⅙; 1/24 -1/12 ⅙; 0 0 1].
    #[inline(always)]
    fn g([g0, g1, g2]: [f32; 3]) -> [f32; 6] {
        let (outer, middle) = (-(g0 + g2) / 6.0, g1 / 6.0);
        let (outer4, middle4) = (g0 / 24.0 + g2 / 6.0, g1 / 12.0);
        [0.25 * g0, outer - middle, outer + middle, outer4 + middle4, outer4 - middle4, g2]
    }
}

tile_from_1d!(F4, 4, 6);

#[cfg(test)]
mod tests {
    use super::*;

    /// Each 1-D pair the gradients use is a transform and its exact adjoint:
    /// ⟨T·x, y⟩ = ⟨x, Tᵀ·y⟩.
    #[test]
    fn every_backward_transform_is_its_forward_transforms_adjoint() {
        fn dot<const N: usize>(a: [f32; N], b: [f32; N]) -> f64 {
            a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum()
        }
        fn check<const I: usize, const O: usize>(
            what: &str,
            f: fn([f32; I]) -> [f32; O],
            adjoint: fn([f32; O]) -> [f32; I],
        ) {
            let x: [f32; I] = std::array::from_fn(|i| 0.3 + i as f32 * 0.7 - (i * i) as f32 * 0.1);
            let y: [f32; O] = std::array::from_fn(|i| 1.1 - i as f32 * 0.45 + (i % 2) as f32);
            let (lhs, rhs) = (dot(f(x), y), dot(x, adjoint(y)));
            assert!((lhs - rhs).abs() < 1e-5 * lhs.abs().max(1.0), "{what}: {lhs} vs {rhs}");
        }
        check("F2 Bᵀ", F2::bt, F2::b);
        check("F2 Aᵀ", F2::at, F2::a);
        check("F2 G", F2::g, F2::gt);
    }
}
