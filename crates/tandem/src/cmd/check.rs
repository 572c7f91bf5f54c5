//! `tandem check` (not implemented yet).

#[derive(clap::Args)]
pub struct Args {}

pub fn main(_args: Args) -> anyhow::Result<i32> {
    eprintln!("tandem check: not yet implemented");
    Ok(2)
}
