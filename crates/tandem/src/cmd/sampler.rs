//! `tandem sampler` (not implemented yet).

#[derive(clap::Args)]
pub struct Args {}

pub fn main(_args: Args) -> anyhow::Result<i32> {
    eprintln!("tandem sampler: not yet implemented");
    Ok(2)
}
