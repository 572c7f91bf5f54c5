//! Where each rank's rows of a parameter are, as FSDP2's `Shard(0)` places them: the first
//! dimension cut in `ceil(rows / world)`-row chunks, rank `r` holding chunk `r` (the last ranks
//! fewer rows, or none), every chunk padded to the full chunk size on the wire so that
//! all-gather and reduce-scatter move equal blocks. The padding exists only in the buffers of
//! those collectives; a shard is exactly its rows.
use std::ops::Range;

/// The rows of a parameter of shape `dims` that rank `rank` of `world` holds, as FSDP2's
/// `Shard(0)` places them (`ceil(rows / world)`-row chunks; a scalar is one row).
pub fn shard_rows(dims: &[usize], rank: usize, world: usize) -> Range<usize> {
    ShardLayout::new(dims, rank, world).my_rows()
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ShardLayout {
    /// The parameter's full shape (a scalar counts as one row of one element).
    pub dims: Vec<usize>,
    rows: usize,
    row_len: usize,
    chunk: usize,
    rank: usize,
    world: usize,
}

impl ShardLayout {
    pub fn new(dims: &[usize], rank: usize, world: usize) -> ShardLayout {
        let rows = dims.first().copied().unwrap_or(1);
        let row_len = dims.iter().skip(1).product();
        ShardLayout {
            dims: dims.to_vec(),
            rows,
            row_len,
            chunk: rows.div_ceil(world.max(1)),
            rank,
            world,
        }
    }

    /// Rank `r`'s rows of the full parameter.
    pub fn rows_of(&self, r: usize) -> Range<usize> {
        (r * self.chunk).min(self.rows)..((r + 1) * self.chunk).min(self.rows)
    }

    /// This rank's rows.
    pub fn my_rows(&self) -> Range<usize> {
        self.rows_of(self.rank)
    }

    /// The shape of this rank's shard.
    pub fn shard_dims(&self) -> Vec<usize> {
        let mut d = vec![self.my_rows().len()];
        d.extend(self.dims.iter().skip(1));
        d
    }

    pub fn full_len(&self) -> usize {
        self.rows * self.row_len
    }

    pub fn shard_len(&self) -> usize {
        self.my_rows().len() * self.row_len
    }

    /// One rank's block on the wire: a chunk of rows, padding included.
    pub fn padded_len(&self) -> usize {
        self.chunk * self.row_len
    }

    /// This rank's rows of `full` (a full parameter or gradient, row-major).
    pub fn my_part<'a>(&self, full: &'a [f32]) -> &'a [f32] {
        let r = self.my_rows();
        &full[r.start * self.row_len..r.end * self.row_len]
    }

    /// Appends this rank's `shard` and its padding to an all-gather input.
    pub fn pack_shard(&self, shard: &[f32], out: &mut Vec<f32>) {
        out.extend_from_slice(shard);
        out.resize(out.len() + self.padded_len() - shard.len(), 0.0);
    }

    /// Writes a full gradient into a reduce-scatter input: rank `r`'s rows at `offset` of its
    /// block of `stride` elements (the padding stays as it is, zero).
    pub fn pack_full(&self, full: &[f32], stride: usize, offset: usize, input: &mut [f32]) {
        for r in 0..self.world {
            let rows = self.rows_of(r);
            let src = &full[rows.start * self.row_len..rows.end * self.row_len];
            let at = r * stride + offset;
            input[at..at + src.len()].copy_from_slice(src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch.chunk's split: 5 rows on 3 ranks are 2, 2, 1; 4 rows on 3 ranks are 2, 2, 0; 2 rows
    /// on 3 ranks 1, 1, 0.
    #[test]
    fn rows_split_as_torch_chunk_splits_them() {
        let rows = |n: usize, w: usize| -> Vec<usize> {
            (0..w).map(|r| ShardLayout::new(&[n, 3], r, w).my_rows().len()).collect()
        };
        assert_eq!(rows(5, 3), [2, 2, 1]);
        assert_eq!(rows(4, 3), [2, 2, 0]);
        assert_eq!(rows(2, 3), [1, 1, 0]);
        assert_eq!(rows(37, 2), [19, 18]);
        assert_eq!(ShardLayout::new(&[4, 3], 2, 3).shard_dims(), [0, 3]);
        assert_eq!(ShardLayout::new(&[], 0, 2).shard_dims(), [1]);
    }

    /// Every rank's padded shard, concatenated by rank (an all-gather's output), is the
    /// parameter followed by the padding, for uneven splits: truncated, it is the parameter. A
    /// gradient packed for reduce-scatter, beside another parameter's, puts each rank's rows in
    /// its block.
    #[test]
    fn shards_gather_back_to_the_parameter_and_gradients_scatter_by_rank() {
        let world = 3;
        let full: Vec<f32> = (0..10).map(|i| i as f32).collect(); // 5 × 2
        let other = [100f32, 101.0]; // a 2-element parameter packed first
        let l = |r| ShardLayout::new(&[5, 2], r, world);
        let o = |r| ShardLayout::new(&[2], r, world);
        for (dims, values) in
            [(vec![5, 2], &full[..]), (vec![2], &other[..]), (vec![4, 2], &full[..8])]
        {
            let mut gathered = Vec::new();
            for r in 0..world {
                let l = ShardLayout::new(&dims, r, world);
                l.pack_shard(l.my_part(values), &mut gathered);
            }
            assert_eq!(gathered.len(), world * ShardLayout::new(&dims, 0, world).padded_len());
            gathered.truncate(values.len());
            assert_eq!(gathered, values, "{dims:?} on {world} ranks");
        }
        let stride = o(0).padded_len() + l(0).padded_len();
        let mut input = vec![0f32; world * stride];
        l(0).pack_full(&full, stride, o(0).padded_len(), &mut input);
        let block = |r: usize| &input[r * stride + 1..r * stride + stride];
        assert_eq!(block(0), [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(block(2), [8.0, 9.0, 0.0, 0.0]);
    }
}
