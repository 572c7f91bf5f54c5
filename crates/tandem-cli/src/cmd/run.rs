//! `tandem run [OPTIONS] -- PROGRAM [ARGS]`: torchrun's command line
//! ([`tandem::launch::LaunchArgs`]) over `tandem::launch`.

/// The flags, defined once in tandem-launch.
pub type Args = tandem::launch::LaunchArgs;

pub fn main(args: Args) -> anyhow::Result<i32> {
    let mut cfg = args.into_config()?;
    cfg.on_event = super::launcher_events_on_stderr();
    let outcome = tandem::launch::launch(&cfg)?;
    Ok(outcome.exit_code)
}
