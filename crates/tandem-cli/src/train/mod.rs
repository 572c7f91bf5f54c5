//! `tandem train`'s settings on the command line: the `--config` file merged over the flags, the
//! `config.toml`
//! recorded in every run directory. The training itself is the library's
//! (`tandem::recipes`); [`console`] shows its events.
pub mod config;
pub mod console;

pub use config::setting_flag;
