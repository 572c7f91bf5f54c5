//! `tandem train`'s flags: their parsing, validation, the `--config` file and the `config.toml`
//! recorded in every run directory. The training itself is the library's
//! (`tandem::recipes`); [`console`] shows its events.
pub mod config;
pub mod console;

pub use config::flag_of;
