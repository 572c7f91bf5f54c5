//! `tandem bench ...`: runs the `tandem-bench` program installed beside this executable with the
//! same arguments (it replaces this process, so exit codes and signals are its own). The
//! benchmarks are a program of their own so that `tandem` does not compile their plotting and
//! report code; see crates/tandem-bench.
use std::ffi::OsString;
use std::os::unix::process::CommandExt;

use anyhow::Context;

#[derive(clap::Args)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// `tandem bench --help` lists the benchmarks.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<OsString>,
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    let me = std::env::current_exe().context("locating the tandem executable")?;
    let bench = me.with_file_name(format!("tandem-bench{}", std::env::consts::EXE_SUFFIX));
    if !bench.is_file() {
        anyhow::bail!(
            "`tandem bench` runs {}, which is not built (cargo build --release -p tandem-bench)",
            bench.display()
        );
    }
    // The benchmarks start `tandem train`/`run` children: this executable, not one on $PATH.
    let err = std::process::Command::new(&bench).args(&args.args).env("TANDEM_EXE", &me).exec();
    Err(err).with_context(|| format!("running {}", bench.display()))
}
