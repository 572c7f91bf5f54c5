//! `tandem bench allreduce`: spawns N local ranks (copies of this executable on loopback) and
//! reports, per collective (all_reduce, reduce_scatter, all_to_all) and message size, the time,
//! algbw, busbw (nccl-tests' definitions: all_reduce algbw × 2(n-1)/n, reduce_scatter and
//! all_to_all algbw × (n-1)/n, where the size is each rank's input buffer), the memcpy bandwidth
//! of a same-size buffer measured by this process in the same run, busbw/memcpy and — with
//! `--torch` — PyTorch gloo's busbw on the same collective and size, measured in the same run
//! (`scripts/peers/torch_collectives_bench.py`), and tandem/gloo. Every rank warms up on the
//! largest size before the first one is timed (a cold first size measured a third of its warm
//! bandwidth). Bandwidths are in GB/s (1e9 bytes/s); times are each run's median over its
//! iterations (the slowest rank's); `--repeats` runs the whole sweep again and reports the
//! median with min–max.
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::local_ranks::{emit, median, results, run_workers, Bench, LocalRanks, JOB_VAR};
use tandem::comm::{ProcessGroup, ReduceOp};

const OPS: [&str; 3] = ["all_reduce", "reduce_scatter", "all_to_all"];

#[derive(clap::Args)]
pub struct Args {
    /// Number of local ranks.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Message sizes in bytes (suffixes K, M, G are powers of 1024), comma-separated: each
    /// rank's input buffer.
    #[arg(long, default_value = "4,4K,1M,16M,64M")]
    sizes: String,
    /// Collectives to measure, comma-separated: all_reduce, reduce_scatter, all_to_all.
    #[arg(long, default_value = "all_reduce,reduce_scatter,all_to_all")]
    ops: String,
    /// Transport (default: shared memory when all ranks are on this host). `mpi` starts the
    /// ranks with mpirun and uses MPI's all_reduce (a build with the `mpi` feature).
    #[arg(long, value_parser = ["tcp", "shm", "mpi"])]
    backend: Option<String>,
    /// A Python with torch: also measure PyTorch's gloo on the same collectives and sizes.
    #[arg(long)]
    torch: Option<PathBuf>,
    /// Runs of the whole sweep (tandem's and gloo's, interleaved).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// One JSON object per collective and size on its own line.
    #[arg(long)]
    json: bool,
    /// Seconds each size should take (sets the iteration count).
    #[arg(long, default_value_t = 0.5)]
    seconds_per_size: f64,
    /// Seconds of warm-up on the largest size before the first size is timed.
    #[arg(long, default_value_t = 0.3)]
    warmup_seconds: f64,
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num.parse().with_context(|| format!("--sizes: cannot parse {s:?}"))?;
    let bytes = n * mult;
    if !bytes.is_multiple_of(4) || bytes == 0 {
        bail!("--sizes: {s} is not a positive multiple of 4 bytes (the benchmark uses f32)");
    }
    Ok(bytes)
}

fn parse_ops(s: &str) -> anyhow::Result<Vec<&'static str>> {
    s.split(',')
        .map(|op| {
            let op = op.trim();
            OPS.iter()
                .copied()
                .find(|o| *o == op)
                .with_context(|| format!("--ops: {op:?} is not one of {}", OPS.join(", ")))
        })
        .collect()
}

/// busbw / algbw for `op` on `n` ranks (nccl-tests' factors).
fn bus_factor(op: &str, n: f64) -> f64 {
    if n <= 1.0 {
        return 0.0;
    }
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        _ => (n - 1.0) / n,
    }
}

fn iterations(bytes: usize, seconds: f64) -> usize {
    // A rough 1 GB/s guess sets the count; small messages are latency-bound.
    let per = (bytes as f64 / 1e9).max(20e-6);
    ((seconds / per) as usize).clamp(5, 5000)
}

fn memcpy_seconds(bytes: usize, iters: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let times: Vec<f64> = (0..iters.min(200))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(times)
}

/// One call of `op` on each rank's input of `bytes` (elements a multiple of the group size for
/// the splitting collectives: the size is rounded down to one).
struct Buffers {
    input: Vec<f32>,
    output: Vec<f32>,
}

/// Each rank's input bytes for `op` asked for `bytes` on `n` ranks: the splitting collectives
/// need a whole number of f32 per rank, so their size is rounded down to one (at least `n`).
fn op_bytes(op: &str, bytes: usize, n: usize) -> usize {
    let elems = (bytes / 4).max(1);
    4 * if op == "all_reduce" { elems } else { (elems / n).max(1) * n }
}

impl Buffers {
    fn new(op: &str, bytes: usize, n: usize) -> Buffers {
        let elems = op_bytes(op, bytes, n) / 4;
        let out = match op {
            "reduce_scatter" => elems / n,
            "all_to_all" => elems,
            _ => 0,
        };
        Buffers { input: vec![1.0; elems], output: vec![0.0; out] }
    }

    fn run(&mut self, pg: &ProcessGroup, op: &str) -> anyhow::Result<()> {
        match op {
            "all_reduce" => pg.all_reduce(&mut self.input, ReduceOp::Sum)?,
            "reduce_scatter" => pg.reduce_scatter(&self.input, &mut self.output, ReduceOp::Sum)?,
            _ => pg.all_to_all_single(&self.input, &mut self.output, None, None)?,
        }
        Ok(())
    }
}

/// What a worker rank runs: the sizes in bytes and the collectives, timed as the parent asks.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Job {
    sizes: Vec<usize>,
    ops: Vec<String>,
    seconds_per_size: f64,
    warmup_seconds: f64,
}

/// One collective at one size: the slowest rank's median seconds (rank 0 reports it; the
/// PyTorch peer's lines name no transport).
#[derive(serde::Serialize, serde::Deserialize)]
struct Timing {
    op: String,
    bytes: usize,
    secs: f64,
    #[serde(default)]
    transport: String,
}

/// One rank: warms up, then times every collective at every size.
pub fn worker(job: Job) -> anyhow::Result<i32> {
    let sizes = &job.sizes;
    let ops: Vec<&str> = job.ops.iter().map(String::as_str).collect();
    let ops = &ops[..];
    let pg = tandem::comm::init().context("worker init")?;
    let n = pg.size();
    // Warm-up: the first size timed cold measured a third of its bandwidth (page faults in
    // fresh buffers and shared-memory rings, the sockets' windows still growing).
    if let Some(&largest) = sizes.iter().max() {
        let until = Instant::now() + Duration::from_secs_f64(job.warmup_seconds);
        for op in ops {
            let mut b = Buffers::new(op, largest, n);
            b.run(&pg, op)?;
        }
        let mut b = Buffers::new(ops[0], largest, n);
        let mut done = [0.0f64];
        while done[0] == 0.0 {
            b.run(&pg, ops[0])?;
            // Every rank stops together: the first whose time is up decides.
            done[0] = f64::from(u8::from(Instant::now() >= until));
            pg.all_reduce(&mut done, ReduceOp::Max)?;
        }
    }
    for op in ops {
        for &bytes in sizes {
            let mut b = Buffers::new(op, bytes, n);
            let bytes = b.input.len() * 4;
            for _ in 0..3 {
                b.run(&pg, op)?;
            }
            pg.barrier()?;
            let iters = iterations(bytes, job.seconds_per_size);
            let mut times = Vec::with_capacity(iters);
            for _ in 0..iters {
                let t = Instant::now();
                b.run(&pg, op)?;
                times.push(t.elapsed().as_secs_f64());
            }
            // Every rank reports its median; the slowest rank is the result.
            let mut med = [median(times)];
            pg.all_reduce(&mut med, ReduceOp::Max)?;
            if pg.rank() == 0 {
                let transport = pg.transport().map_or("none", |t| t.name()).to_string();
                emit(&Timing { op: op.to_string(), bytes, secs: med[0], transport })?;
            }
        }
    }
    pg.barrier()?;
    Ok(0)
}

/// (op, bytes) -> seconds of each run.
type Times = BTreeMap<(String, usize), Vec<f64>>;

/// One run of the tandem ranks over `job`: adds its timings to `times`, returns the transport.
fn tandem_run(args: &Args, job: &Job, times: &mut Times) -> anyhow::Result<String> {
    let rows: Vec<Timing> = if args.backend.as_deref() == Some("mpi") {
        let env = [
            ("TANDEM_TRANSPORT", args.backend.clone()),
            (JOB_VAR, Some(serde_json::to_string(job)?)),
        ];
        let worker_args = Bench::Allreduce.worker_args();
        let (mut ranks, mut stdout) =
            LocalRanks::spawn_mpirun(args.nproc, "bench-allreduce", &worker_args, &env)?;
        let mut text = String::new();
        stdout.read_to_string(&mut text)?;
        if !ranks.reap(Duration::from_secs(60), false)? {
            bail!("a benchmark rank failed");
        }
        results(&text, "bench-allreduce under mpirun")?
    } else {
        // (Without --backend the group picks its transport, as a job's own ranks do.)
        let env: Vec<(&str, String)> =
            args.backend.iter().map(|b| ("TANDEM_TRANSPORT", b.clone())).collect();
        run_workers(Bench::Allreduce, args.nproc, job, &env, Duration::from_secs(600))?
    };
    let mut transport = String::from("none");
    for t in rows {
        transport = t.transport;
        times.entry((t.op, t.bytes)).or_default().push(t.secs);
    }
    Ok(transport)
}

fn gloo_run(python: &Path, args: &Args, times: &mut Times) -> anyhow::Result<()> {
    let script =
        crate::report::repo_root().join(crate::PEERS_DIR).join("torch_collectives_bench.py");
    let out = Command::new(python)
        .arg(&script)
        .args([
            args.nproc.to_string(),
            args.ops.clone(),
            args.sizes.clone(),
            args.seconds_per_size.to_string(),
            args.warmup_seconds.to_string(),
        ])
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
    let what = script.display().to_string();
    for t in results::<Timing>(&String::from_utf8_lossy(&out.stdout), &what)? {
        times.entry((t.op, t.bytes)).or_default().push(t.secs);
    }
    Ok(())
}

/// One line of `tandem bench allreduce --json`: a collective at one size (what the report
/// reads back, typed).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AllreduceRow {
    pub op: String,
    pub size_bytes: usize,
    pub time_s: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    pub busbw_min_gbs: f64,
    pub busbw_max_gbs: f64,
    pub memcpy_gbs: f64,
    pub busbw_over_memcpy: f64,
    /// gloo's bus bandwidth on the same work, when PyTorch was given.
    pub gloo_busbw_gbs: Option<f64>,
    pub nproc: usize,
    pub transport: String,
    pub runs: usize,
}

/// min, median, max.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[0], median(s.clone()), s[s.len() - 1])
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let sizes = args.sizes.split(',').map(parse_size).collect::<anyhow::Result<Vec<_>>>()?;
    let ops = parse_ops(&args.ops)?;
    if args.nproc == 0 || args.repeats == 0 {
        bail!("--nproc and --repeats must be at least 1");
    }
    // memcpy reference, measured here before the ranks start (no competition for cores).
    let memcpy: Vec<f64> =
        sizes.iter().map(|&b| b as f64 / memcpy_seconds(b, iterations(b, 0.2))).collect();
    let (mut ours, mut gloo) = (Times::new(), Times::new());
    let job = Job {
        sizes: sizes.clone(),
        ops: ops.iter().map(|o| o.to_string()).collect(),
        seconds_per_size: args.seconds_per_size,
        warmup_seconds: args.warmup_seconds,
    };
    let mut transport = String::new();
    for _ in 0..args.repeats {
        transport = tandem_run(&args, &job, &mut ours)?;
        if let Some(python) = &args.torch {
            gloo_run(python, &args, &mut gloo)?;
        }
    }
    let n = args.nproc as f64;
    if !args.json {
        println!(
            "{:>14} {:>10} {:>10} {:>10} {:>20} {:>8} {:>9} {:>10} {:>10}   (nproc {}, f32, \
             GB/s = 1e9 B/s, median [min-max] of {} run(s))",
            "collective",
            "size",
            "time(us)",
            "algbw",
            "busbw",
            "memcpy",
            "bus/mcpy",
            "gloo busbw",
            "x gloo",
            args.nproc,
            args.repeats
        );
    }
    for op in &ops {
        for (i, &asked) in sizes.iter().enumerate() {
            let bytes = op_bytes(op, asked, args.nproc);
            let Some(t) = ours.get(&(op.to_string(), bytes)) else {
                bail!("benchmark incomplete: no {op} result for {bytes} bytes");
            };
            let bus = |secs: f64| bytes as f64 / secs / 1e9 * bus_factor(op, n);
            let (fast, secs, slow) = spread(t);
            let algbw = bytes as f64 / secs / 1e9;
            let mem = memcpy[i] / 1e9;
            let theirs = gloo.get(&(op.to_string(), bytes)).map(|g| spread(g).1);
            if args.json {
                let row = AllreduceRow {
                    op: op.to_string(),
                    size_bytes: bytes,
                    time_s: secs,
                    algbw_gbs: algbw,
                    busbw_gbs: bus(secs),
                    busbw_min_gbs: bus(slow),
                    busbw_max_gbs: bus(fast),
                    memcpy_gbs: mem,
                    busbw_over_memcpy: bus(secs) / mem,
                    gloo_busbw_gbs: theirs.map(bus),
                    nproc: args.nproc,
                    transport: transport.clone(),
                    runs: t.len(),
                };
                println!("{}", serde_json::to_string(&row)?);
            } else {
                let gloo_text = theirs.map_or("-".into(), |g| format!("{:.3}", bus(g)));
                let ratio = theirs.map_or("-".into(), |g| format!("{:.2}", g / secs));
                println!(
                    "{op:>14} {bytes:>10} {:>10.2} {algbw:>10.3} {:>20} {mem:>8.3} {:>9.3} \
                     {gloo_text:>10} {ratio:>10}   [{transport}]",
                    secs * 1e6,
                    format!("{:.3} [{:.3}-{:.3}]", bus(secs), bus(slow), bus(fast)),
                    bus(secs) / mem,
                );
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 4.0), 1.5);
        assert_eq!(bus_factor("reduce_scatter", 4.0), 0.75);
        assert_eq!(bus_factor("all_to_all", 2.0), 0.5);
        assert_eq!(bus_factor("all_reduce", 1.0), 0.0);
        assert_eq!(op_bytes("all_reduce", 4, 4), 4);
        assert_eq!(op_bytes("all_to_all", 4, 4), 16);
        assert_eq!(op_bytes("reduce_scatter", 4100, 4), 4096);
        assert!(parse_ops("all_reduce,broadcast").unwrap_err().to_string().contains("broadcast"));
    }
}
