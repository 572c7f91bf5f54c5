//! `tandem check`: run under a launcher (tandem run, torchrun, srun, mpirun). Every rank joins
//! the process group, all-reduces its rank, checks the sum is n(n-1)/2, then all-reduces a
//! 8 MiB buffer (sum, average and max of rank-dependent values, an odd length; large enough to
//! take the hierarchical path on multi-host groups), then the collectives past the core (reduce,
//! all_to_all with uneven splits, a batched P2P ring shift, an object all-gather and a
//! monitored barrier), and prints
//! `rank R/W local L/LW sum=S allreduce=flat|hierarchical ok`. The test-only options make it the launcher's end-to-end
//! worker: fail with a given code on one rank, fail on the first attempt only, linger.
use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Context};
use tandem::comm::ReduceOp;

/// Variables a launcher sets, printed by `--print-env`.
const LAUNCHER_VARS: [&str; 12] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
    "RAYON_NUM_THREADS",
];

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Dtype {
    I64,
    F64,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Element type of the all-reduce.
    #[arg(long, value_enum, default_value = "i64")]
    dtype: Dtype,

    /// Also print the launcher's variables (RANK, MASTER_PORT, ...) as one JSON line.
    #[arg(long = "print-env")]
    print_env: bool,

    /// After the check, rank R exits with CODE (testing a launcher's failure handling).
    #[arg(long = "exit-code-on-rank", value_name = "R:CODE", value_parser = parse_rank_code)]
    exit_code_on_rank: Option<(usize, i32)>,

    /// After the check, every rank exits 1 when TORCHELASTIC_RESTART_COUNT is 0 (testing restarts).
    #[arg(long = "fail-on-first-attempt")]
    fail_on_first_attempt: bool,

    /// Seconds to wait after the check before the final barrier and exit.
    #[arg(long = "sleep-secs", value_name = "SECS", default_value_t = 0.0)]
    sleep_secs: f64,
}

fn parse_rank_code(s: &str) -> Result<(usize, i32), String> {
    let (r, c) = s.split_once(':').ok_or_else(|| format!("`{s}` is not R:CODE (e.g. 1:3)"))?;
    let r = r.trim().parse().map_err(|_| format!("`{r}` in `{s}` is not a rank"))?;
    let c = c.trim().parse().map_err(|_| format!("`{c}` in `{s}` is not an exit code"))?;
    Ok((r, c))
}

fn launcher_env_json() -> String {
    let vars: BTreeMap<&str, Option<String>> =
        LAUNCHER_VARS.iter().map(|&k| (k, std::env::var(k).ok())).collect();
    serde_json::to_string(&vars).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.print_env {
        println!("{}", launcher_env_json());
    }
    let sleep = Duration::try_from_secs_f64(args.sleep_secs).with_context(|| {
        format!("--sleep-secs: `{}` is not a number of seconds", args.sleep_secs)
    })?;
    let pg = tandem::comm::init().context("joining the process group")?;
    let (rank, size) = (pg.rank(), pg.size());
    let expected = size * size.saturating_sub(1) / 2;
    let sum = match args.dtype {
        Dtype::I64 => {
            let mut buf = [rank as i64];
            pg.all_reduce(&mut buf, ReduceOp::Sum).context("all_reduce of the ranks")?;
            buf[0].to_string()
        }
        Dtype::F64 => {
            let mut buf = [rank as f64];
            pg.all_reduce(&mut buf, ReduceOp::Sum).context("all_reduce of the ranks")?;
            buf[0].to_string()
        }
    };
    let algorithm = if pg.is_hierarchical() { "hierarchical" } else { "flat" };
    let head = format!(
        "rank {rank}/{size} local {}/{} sum={sum} allreduce={algorithm}",
        pg.local_rank(),
        pg.local_size()
    );
    if sum != expected.to_string() {
        println!("{head} MISMATCH (expected {expected})");
        bail!("rank {rank}: all_reduce sum {sum} != {expected} = n(n-1)/2 for n = {size}");
    }
    if let Err(why) = check_large(&pg).and_then(|()| check_more(&pg)) {
        println!("{head} MISMATCH ({why})");
        bail!("rank {rank}: {why}");
    }
    println!("{head} ok");

    if let Some((r, code)) = args.exit_code_on_rank {
        if r == rank {
            eprintln!("rank {rank}: exiting with code {code} as asked by --exit-code-on-rank");
            return Ok(code);
        }
    }
    if args.fail_on_first_attempt
        && std::env::var("TORCHELASTIC_RESTART_COUNT").as_deref() == Ok("0")
    {
        eprintln!("rank {rank}: failing on the first attempt as asked by --fail-on-first-attempt");
        return Ok(1);
    }
    std::thread::sleep(sleep);
    pg.barrier().context("final barrier")?;
    Ok(0)
}

/// Sum, average and max of an 8 MiB f32 buffer whose values depend on the rank and the index;
/// all exact in f32, so any wrong element is a bug, not rounding.
fn check_large(pg: &tandem::comm::ProcessGroup) -> Result<(), String> {
    // 8 MiB + 3 elements: several pipeline pieces of the hierarchical all-reduce, the last one
    // tiny, and a length no local group size divides.
    const LEN: usize = (1 << 21) + 3;
    let (rank, size) = (pg.rank() as f32, pg.size() as f32);
    let value = |i: usize| rank + (i % 7) as f32;
    let ranks_sum = size * (size - 1.0) / 2.0;
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let mut buf: Vec<f32> = (0..LEN).map(value).collect();
        pg.all_reduce(&mut buf, op).map_err(|e| format!("8 MiB all_reduce({op:?}): {e}"))?;
        for (i, &got) in buf.iter().enumerate() {
            let k = (i % 7) as f32;
            let want = match op {
                ReduceOp::Sum => ranks_sum + size * k,
                ReduceOp::Avg => (ranks_sum + size * k) / size,
                _ => size - 1.0 + k,
            };
            if got != want {
                return Err(format!(
                    "8 MiB all_reduce({op:?}): element {i} is {got}, expected {want}"
                ));
            }
        }
    }
    Ok(())
}

/// reduce, all_to_all_single with uneven splits (some empty), a ring shift by
/// batch_isend_irecv, all_gather_object and monitored_barrier, with results every rank checks.
fn check_more(pg: &tandem::comm::ProcessGroup) -> Result<(), String> {
    let (r, n) = (pg.rank(), pg.size());
    let fail = |what: &str, e: tandem::comm::CommError| format!("{what}: {e}");
    let mut v = vec![r as i64 + 1; 1001];
    pg.reduce(&mut v, ReduceOp::Sum, n - 1).map_err(|e| fail("reduce", e))?;
    let want = if r == n - 1 { (n * (n + 1) / 2) as i64 } else { r as i64 + 1 };
    if v.iter().any(|x| *x != want) {
        return Err(format!("reduce: {} instead of {want}", v[0]));
    }
    // Rank f sends (f + t) % 3 elements of value 100 f + t to rank t.
    let ins: Vec<usize> = (0..n).map(|t| (r + t) % 3).collect();
    let outs: Vec<usize> = (0..n).map(|f| (f + r) % 3).collect();
    let input: Vec<i64> = (0..n).flat_map(|t| vec![(100 * r + t) as i64; (r + t) % 3]).collect();
    let mut output = vec![-1i64; outs.iter().sum()];
    pg.all_to_all_single(&input, &mut output, Some(&ins), Some(&outs))
        .map_err(|e| fail("all_to_all_single", e))?;
    let want: Vec<i64> = (0..n).flat_map(|f| vec![(100 * f + r) as i64; (f + r) % 3]).collect();
    if output != want {
        return Err(format!("all_to_all_single: {output:?} instead of {want:?}"));
    }
    if n > 1 {
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let ops = vec![
            tandem::comm::P2POp::isend(vec![r as f32; 1 << 18], right),
            tandem::comm::P2POp::irecv(vec![-1f32; 1 << 18], left),
        ];
        let done = pg.batch_isend_irecv(ops).wait().map_err(|e| fail("batch_isend_irecv", e))?;
        if done[1].buf.iter().any(|x| *x != left as f32) {
            return Err(format!("batch_isend_irecv: got {} from rank {left}", done[1].buf[0]));
        }
    }
    let names =
        pg.all_gather_object(&format!("rank {r}")).map_err(|e| fail("all_gather_object", e))?;
    if names.iter().enumerate().any(|(q, s)| *s != format!("rank {q}")) {
        return Err(format!("all_gather_object: {names:?}"));
    }
    pg.monitored_barrier(None).map_err(|e| fail("monitored_barrier", e))
}
