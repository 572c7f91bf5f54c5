//! `tandem train`'s flags are the library's `TrainConfig` (the command flattens it): every
//! setting the library names — in an error, or read from arcface_torch's configs — is one of
//! them, and the flags' defaults are `TrainConfig::default()`. (The binary's error line then
//! names such a setting by its flag: tests/face_recipe.rs and tests/launch.rs run it.)
use clap::{Args, FromArgMatches};
use tandem::recipes::TrainConfig;

/// `tandem train`'s arguments.
fn train_command() -> clap::Command {
    TrainConfig::augment_args(clap::Command::new("train"))
}

/// Whether `key` (snake_case, as the library names a setting) is a `tandem train` flag.
fn is_flag(command: &clap::Command, key: &str) -> bool {
    let long = key.replace('_', "-");
    command.get_arguments().any(|a| a.get_long() == Some(long.as_str()))
}

/// Every option key the training library names in an error is a `tandem train` flag (read
/// from its sources: `option("key"`, `bail_option!("key"`).
#[test]
fn every_option_key_of_the_library_is_a_train_flag() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tandem-recipes/src");
    let mut keys = Vec::new();
    for (path, text) in tandem_testutil::files_with_text(&src) {
        for marker in ["option(\"", "bail_option!(\""] {
            for (at, _) in text.match_indices(marker) {
                let rest = &text[at + marker.len()..];
                let key = &rest[..rest.find('"').unwrap()];
                if key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    keys.push((key.to_string(), path.display().to_string()));
                }
            }
        }
    }
    assert!(keys.len() >= 20, "the scan found too few keys: {keys:?}");
    let command = train_command();
    for (key, file) in keys {
        assert!(is_flag(&command, &key), "{file}: option `{key}` is no `tandem train` flag");
    }
}

/// `tandem train` with no flags is the library's `TrainConfig::default()`, field for field
/// (the flags take their defaults from it; a flag without one must agree with it).
#[test]
fn train_without_flags_is_the_librarys_default_config() {
    let matches = train_command().try_get_matches_from(["train"]).unwrap();
    assert_eq!(TrainConfig::from_arg_matches(&matches).unwrap(), TrainConfig::default());
}

/// Every setting the library reads from arcface_torch's configs (its `configs/` folder, as test
/// fixtures) is a `tandem train` flag, so `--config FILE.py` never meets a key it cannot place.
#[test]
fn every_setting_of_an_arcface_config_is_a_train_flag() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tandem-recipes/tests/fixtures/arcface_configs");
    let command = train_command();
    let mut mapped = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "py") || path.ends_with("make_expected.py") {
            continue;
        }
        // (Configs on random images or DALI's augmentation are refused by the library.)
        let Ok(settings) = tandem::recipes::face::config::read_settings(&path) else {
            continue;
        };
        mapped += 1;
        for (key, _) in settings {
            assert!(
                is_flag(&command, key),
                "{}: `{key}` is no `tandem train` flag",
                path.display()
            );
        }
    }
    assert!(mapped >= 39, "{mapped} configs mapped");
}
