//! `tandem ckpt` (not implemented yet).

#[derive(clap::Args)]
pub struct Args {}

pub fn main(_args: Args) -> anyhow::Result<i32> {
    eprintln!("tandem ckpt: not yet implemented");
    Ok(2)
}
