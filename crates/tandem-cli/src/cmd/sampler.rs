//! `tandem sampler`: prints the sample indices one rank sees in one epoch, as a JSON array —
//! exactly `list(iter(DistributedSampler(range(len), R, rank, shuffle, seed, drop_last)))`
//! after `set_epoch(epoch)` in PyTorch, so the two can be diffed.
use anyhow::Context;
use tandem::data::DistributedSampler;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Dataset length (samples).
    #[arg(long = "len", value_name = "N")]
    len: usize,
    /// Number of ranks (num_replicas / world size).
    #[arg(long, value_name = "R")]
    replicas: usize,
    /// The rank whose indices to print (0 <= K < R).
    #[arg(long, value_name = "K")]
    rank: usize,
    /// Shuffle with torch.randperm seeded by seed + epoch (PyTorch's default is on; here it is
    /// off unless given, as the flag form requires).
    #[arg(long)]
    shuffle: bool,
    /// Sampler seed (PyTorch's default 0). Negative seeds wrap to 2^64 + S as in
    /// `torch.Generator.manual_seed`.
    #[arg(long, value_name = "S", default_value = "0", allow_hyphen_values = true, value_parser = parse_seed)]
    seed: u64,
    /// Epoch passed to set_epoch.
    #[arg(long, value_name = "E", default_value_t = 0)]
    epoch: u64,
    /// Trim the tail so every rank gets floor(N / R) samples instead of padding.
    #[arg(long)]
    drop_last: bool,
}

/// A torch seed: any integer in [-2^63, 2^64), negative ones taken modulo 2^64.
fn parse_seed(s: &str) -> Result<u64, String> {
    s.parse::<u64>()
        .or_else(|_| s.parse::<i64>().map(|v| v as u64))
        .map_err(|_| format!("{s:?} is not an integer in [-2^63, 2^64)"))
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let mut sampler = DistributedSampler::new(
        args.len,
        args.replicas,
        args.rank,
        args.shuffle,
        args.seed,
        args.drop_last,
    )
    .context("--rank / --replicas")?;
    sampler.set_epoch(args.epoch);
    let indices = sampler.indices();
    let mut out = String::with_capacity(indices.len() * 8 + 2);
    out.push('[');
    for (i, index) in indices.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&index.to_string());
    }
    out.push_str("]\n");
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(0),
        // `tandem sampler ... | head` closing the pipe is not an error worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(e).context("writing to stdout"),
    }
}
