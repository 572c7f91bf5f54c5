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
use tandem::comm::{Element, ProcessGroup, ReduceOp};

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
    fn sum_of<T: Element + ToString>(pg: &ProcessGroup, x: T) -> anyhow::Result<String> {
        let mut buf = [x];
        pg.all_reduce(&mut buf, ReduceOp::Sum).context("all_reduce of the ranks")?;
        Ok(buf[0].to_string())
    }
    let sum = match args.dtype {
        Dtype::I64 => sum_of(&pg, rank as i64)?,
        Dtype::F64 => sum_of(&pg, rank as f64)?,
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
    if let Err(why) = pg.self_check() {
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
