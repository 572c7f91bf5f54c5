//! [`ProcessGroup::self_check`]: a job's collectives checked end to end on every rank, each
//! result against what it must be (`tandem check` runs it under any launcher).
use super::{P2POp, ProcessGroup};
use crate::{CommError, ReduceOp};

impl ProcessGroup {
    /// Checks the group's collectives give exact results (a collective on every rank): sum,
    /// average and max all-reduces of an 8 MiB buffer of an odd length (several pieces of the
    /// hierarchical path on a multi-host group), then reduce, all_to_all_single with uneven
    /// splits, a ring shift by batch_isend_irecv, all_gather_object and monitored_barrier.
    /// A wrong result is [`CommError::WrongResult`] naming the call and the element.
    pub fn self_check(&self) -> Result<(), CommError> {
        check_large(self)?;
        check_more(self)
    }
}

fn wrong(op: &str, what: String) -> CommError {
    CommError::WrongResult { op: op.to_string(), what }
}

/// Sum, average and max of an 8 MiB f32 buffer whose values depend on the rank and the index;
/// all exact in f32, so any wrong element is a bug, not rounding.
fn check_large(pg: &ProcessGroup) -> Result<(), CommError> {
    // 8 MiB + 3 elements: several pipeline pieces of the hierarchical all-reduce, the last one
    // tiny, and a length no local group size divides.
    const LEN: usize = (1 << 21) + 3;
    let (rank, size) = (pg.rank() as f32, pg.size() as f32);
    let value = |i: usize| rank + (i % 7) as f32;
    let ranks_sum = size * (size - 1.0) / 2.0;
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let mut buf: Vec<f32> = (0..LEN).map(value).collect();
        pg.all_reduce(&mut buf, op)?;
        for (i, &got) in buf.iter().enumerate() {
            let k = (i % 7) as f32;
            let want = match op {
                ReduceOp::Sum => ranks_sum + size * k,
                ReduceOp::Avg => (ranks_sum + size * k) / size,
                _ => size - 1.0 + k,
            };
            if got != want {
                let what = format!("element {i} is {got}, expected {want}");
                return Err(wrong(&format!("8 MiB all_reduce({op:?})"), what));
            }
        }
    }
    Ok(())
}

/// reduce, all_to_all_single with uneven splits (some empty), a ring shift by
/// batch_isend_irecv, all_gather_object and monitored_barrier, with results every rank checks.
fn check_more(pg: &ProcessGroup) -> Result<(), CommError> {
    let (r, n) = (pg.rank(), pg.size());
    let mut v = vec![r as i64 + 1; 1001];
    pg.reduce(&mut v, ReduceOp::Sum, n - 1)?;
    let want = if r == n - 1 { (n * (n + 1) / 2) as i64 } else { r as i64 + 1 };
    if v.iter().any(|x| *x != want) {
        return Err(wrong("reduce", format!("{} instead of {want}", v[0])));
    }
    // Rank f sends (f + t) % 3 elements of value 100 f + t to rank t.
    let ins: Vec<usize> = (0..n).map(|t| (r + t) % 3).collect();
    let outs: Vec<usize> = (0..n).map(|f| (f + r) % 3).collect();
    let input: Vec<i64> = (0..n).flat_map(|t| vec![(100 * r + t) as i64; (r + t) % 3]).collect();
    let mut output = vec![-1i64; outs.iter().sum()];
    pg.all_to_all_single(&input, &mut output, Some(&ins), Some(&outs))?;
    let want: Vec<i64> = (0..n).flat_map(|f| vec![(100 * f + r) as i64; (f + r) % 3]).collect();
    if output != want {
        return Err(wrong("all_to_all_single", format!("{output:?} instead of {want:?}")));
    }
    if n > 1 {
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let ops = vec![
            P2POp::isend(vec![r as f32; 1 << 18], right),
            P2POp::irecv(vec![-1f32; 1 << 18], left),
        ];
        let done = pg.batch_isend_irecv(ops).wait()?;
        if done[1].buf.iter().any(|x| *x != left as f32) {
            let what = format!("got {} from rank {left}", done[1].buf[0]);
            return Err(wrong("batch_isend_irecv", what));
        }
    }
    let names = pg.all_gather_object(&format!("rank {r}"))?;
    if names.iter().enumerate().any(|(q, s)| *s != format!("rank {q}")) {
        return Err(wrong("all_gather_object", format!("{names:?}")));
    }
    pg.monitored_barrier(None)
}
