//! `tandem bench allreduce` (not implemented yet).

#[derive(clap::Args)]
pub struct Args {}

pub fn main(_args: Args) -> anyhow::Result<i32> {
    eprintln!("tandem bench allreduce: not yet implemented");
    Ok(2)
}
