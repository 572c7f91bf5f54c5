//! `tandem bench allreduce`: spawns N local ranks (copies of this executable on loopback) and
//! reports, per message size, the all_reduce time, algbw, busbw = algbw * 2(n-1)/n, the memcpy
//! bandwidth of a same-size buffer measured by this process in the same run, and busbw/memcpy.
//! Bandwidths are in GB/s (1e9 bytes/s); times are medians over the iterations.
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use super::local_ranks::{median, LocalRanks};
use tandem_comm::ReduceOp;

#[derive(clap::Args)]
pub struct Args {
    /// Number of local ranks.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Message sizes in bytes (suffixes K, M, G are powers of 1024), comma-separated.
    #[arg(long, default_value = "4,4K,1M,16M,64M")]
    sizes: String,
    /// Transport (default: shared memory when all ranks are on this host). `mpi` starts the
    /// ranks with mpirun and uses MPI's all_reduce (a build with the `mpi` feature).
    #[arg(long, value_parser = ["tcp", "shm", "mpi"])]
    backend: Option<String>,
    /// One JSON object per size on its own line.
    #[arg(long)]
    json: bool,
    /// Seconds each size should take (sets the iteration count).
    #[arg(long, default_value_t = 0.5)]
    seconds_per_size: f64,
    /// Internal: run as one rank of the benchmark (set by the parent).
    #[arg(long, hide = true)]
    worker: bool,
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

fn worker(args: &Args, sizes: &[usize]) -> anyhow::Result<i32> {
    let pg = tandem_comm::init().context("worker init")?;
    for &bytes in sizes {
        let mut buf = vec![1.0f32; bytes / 4];
        for _ in 0..3 {
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        pg.barrier()?;
        let iters = iterations(bytes, args.seconds_per_size);
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            pg.all_reduce(&mut buf, ReduceOp::Sum)?;
            times.push(t.elapsed().as_secs_f64());
        }
        // Every rank reports its median; the slowest rank is the result.
        let mut med = [median(times)];
        pg.all_reduce(&mut med, ReduceOp::Max)?;
        if pg.rank() == 0 {
            println!("RESULT {bytes} {} {iters} {:?}", med[0], pg.transport().map(|t| t.name()));
        }
    }
    pg.barrier()?;
    Ok(0)
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let sizes = args.sizes.split(',').map(parse_size).collect::<anyhow::Result<Vec<_>>>()?;
    if args.worker {
        return worker(&args, &sizes);
    }
    if args.nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    // memcpy reference, measured here before the ranks start (no competition for cores).
    let memcpy: Vec<f64> =
        sizes.iter().map(|&b| b as f64 / memcpy_seconds(b, iterations(b, 0.2))).collect();

    let args_vec = ["allreduce", "--worker", "--sizes", &args.sizes, "--seconds-per-size"]
        .iter()
        .map(|s| s.to_string())
        .chain([args.seconds_per_size.to_string()])
        .collect::<Vec<_>>();
    let env = [("TANDEM_TRANSPORT", args.backend.clone())];
    let (mut ranks, stdout) = if args.backend.as_deref() == Some("mpi") {
        LocalRanks::spawn_mpirun(args.nproc, "bench-allreduce", &args_vec, &env)?
    } else {
        LocalRanks::spawn(args.nproc, "bench-allreduce", &args_vec, &env)?
    };
    let n = args.nproc as f64;
    let mut seen = 0;
    if !args.json {
        println!(
            "{:>10} {:>12} {:>11} {:>11} {:>12} {:>14}   (nproc {}, f32 sum, GB/s = 1e9 B/s)",
            "size",
            "time(us)",
            "algbw GB/s",
            "busbw GB/s",
            "memcpy GB/s",
            "busbw/memcpy",
            args.nproc
        );
    }
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Some(rest) = line.strip_prefix("RESULT ") else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let (bytes, secs): (usize, f64) = (f[0].parse()?, f[1].parse()?);
        let transport = f
            .get(3)
            .copied()
            .unwrap_or("None")
            .trim_start_matches("Some(")
            .trim_end_matches(')')
            .trim_matches('"');
        let algbw = bytes as f64 / secs / 1e9;
        let busbw = if args.nproc > 1 { algbw * 2.0 * (n - 1.0) / n } else { 0.0 };
        let mem = memcpy
            .get(sizes.iter().position(|&s| s == bytes).unwrap_or(0))
            .copied()
            .unwrap_or(f64::NAN)
            / 1e9;
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "size_bytes": bytes, "time_s": secs, "algbw_gbs": algbw, "busbw_gbs": busbw,
                    "memcpy_gbs": mem, "busbw_over_memcpy": busbw / mem, "nproc": args.nproc,
                    "transport": transport, "iters": f[2].parse::<usize>().unwrap_or(0),
                })
            );
        } else {
            println!(
                "{:>10} {:>12.2} {:>11.3} {:>11.3} {:>12.3} {:>14.3}   [{transport}]",
                bytes,
                secs * 1e6,
                algbw,
                busbw,
                mem,
                busbw / mem
            );
        }
        seen += 1;
    }
    let failed = !ranks.reap(Duration::from_secs(60), false)?;
    if failed || seen != sizes.len() {
        bail!("benchmark incomplete: {seen} of {} sizes reported", sizes.len());
    }
    Ok(0)
}
