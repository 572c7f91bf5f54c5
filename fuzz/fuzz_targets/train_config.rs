//! `tandem train --config FILE.toml`: the file's keys merged over the flags' defaults, then
//! validated and mapped to the library's options. Any bytes give settings or an error naming
//! the file and key, never a panic. The module is the CLI's own source, included here; the
//! settings themselves are the library's `TrainConfig` (its clap derive).
#![no_main]
use clap::{CommandFactory, FromArgMatches, Parser};
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../crates/tandem-cli/src/train/config.rs"]
mod config;

#[derive(Parser)]
struct Train {
    #[command(flatten)]
    cfg: config::TrainConfig,
}

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a scratch directory");
    let path = dir.path().join("config.toml");
    std::fs::write(&path, data).expect("writing the input");
    let args = ["train", "--config", path.to_str().expect("a UTF-8 path")];
    let Ok(matches) = Train::command().try_get_matches_from(args) else { return };
    let Ok(train) = Train::from_arg_matches(&matches) else { return };
    if let Ok(cfg) = config::apply_config_file(train.cfg, &matches) {
        if cfg.validate().is_ok() {
            let _ = cfg.options(dir.path().join("run"));
        }
    }
});
