//! `tandem train`'s flags: their parsing, validation, the `--config` file and the `config.toml`
//! recorded in every run directory. The training itself is the library's
//! (`tandem::train::recipes`).
pub mod arcface_config;
pub mod config;
