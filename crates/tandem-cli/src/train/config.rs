//! The `tandem train` settings' command-line side: the flags are the library's
//! [`TrainConfig`] (its `clap` derive); here a `--config` file is merged over them and the
//! settings are written as the run's `config.toml`.
use anyhow::{bail, Context};
use tandem::recipes::face;
pub use tandem::recipes::options::TrainConfig;

/// The `tandem train` flag of a training-library option key (`TrainError::Option`'s): each
/// key is its `--config` key, and each flag that key with dashes.
pub fn flag_of(key: &str) -> String {
    format!("--{}", key.replace('_', "-"))
}

/// The `tandem train` flag of `key` when it is one of its settings (`None` for any other word).
pub fn setting_flag(key: &str) -> Option<String> {
    let command = <TrainConfig as clap::Args>::augment_args(clap::Command::new("train"));
    let long = key.replace('_', "-");
    let known = command.get_arguments().any(|a| a.get_long() == Some(long.as_str()));
    known.then(|| flag_of(key))
}

/// The settings as the run's `config.toml` (every setting, so a run can be reproduced).
pub fn to_toml(cfg: &TrainConfig) -> anyhow::Result<String> {
    toml::to_string_pretty(cfg).context("serialising config.toml")
}

/// `--config FILE.toml`: settings whose keys are the flags' long names (`batch-size = 128`;
/// the snake_case names of a run's own `config.toml` work too), or `--config FILE.py`:
/// arcface_torch's Python config (see `tandem::recipes::face::config`). A flag given on the command
/// line wins over the file; an unknown key, a nested `config` or a value of the wrong type is
/// an error naming the file and the key.
pub fn apply_config_file(
    cfg: TrainConfig,
    matches: &clap::ArgMatches,
) -> anyhow::Result<TrainConfig> {
    use clap::parser::ValueSource;
    let Some(path) = cfg.config.clone() else { return Ok(cfg) };
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {shown}"))?;
    // arcface_torch's Python configs, or TOML whose keys are the flags' names.
    let file: Vec<(String, toml::Value)> = if path.extension().is_some_and(|e| e == "py") {
        let settings = face::config::read_settings(&path).context("--config")?;
        let toml = |(key, v): (&str, _)| Ok((key.to_string(), toml::Value::try_from(v)?));
        settings.into_iter().map(toml).collect::<anyhow::Result<_>>().context("--config")?
    } else {
        let table: toml::Table =
            text.parse().with_context(|| format!("--config {shown}: not valid TOML"))?;
        table.into_iter().collect()
    };
    let command = <TrainConfig as clap::Args>::augment_args(clap::Command::new("train"));
    let file = flatten_sections(file);
    let mut table = match toml::Value::try_from(&cfg).context("serialising the settings")? {
        toml::Value::Table(t) => t,
        _ => bail!("the settings did not serialise to a table"),
    };
    for (key, value) in file {
        let arg = command.get_arguments().find(|a| {
            a.get_long() == Some(key.as_str()) || a.get_id().as_str() == key.replace('-', "_")
        });
        let Some(arg) = arg else {
            bail!(
                "--config {shown}: unknown key `{key}` (keys are `tandem train` flags without \
                 the dashes, such as `batch-size` or `lr-scheduler`)"
            );
        };
        let id = arg.get_id().as_str();
        if id == "config" {
            bail!("--config {shown}: a config file cannot name another (`{key}`)");
        }
        if matches.value_source(id) == Some(ValueSource::CommandLine) {
            continue;
        }
        // An integer where the flag takes a float (`lr = 1`) is that float.
        let value = match (table.get(id), value) {
            (Some(toml::Value::Float(_)), toml::Value::Integer(i)) => toml::Value::Float(i as f64),
            (_, v) => v,
        };
        let mut probe = table.clone();
        probe.insert(id.to_string(), value.clone());
        if let Err(e) = toml::Value::Table(probe).try_into::<TrainConfig>() {
            let why = e.to_string().lines().next().unwrap_or_default().to_string();
            bail!("--config {shown}: `{key}`: {why}");
        }
        table.insert(id.to_string(), value);
    }
    let mut merged: TrainConfig =
        toml::Value::Table(table).try_into().with_context(|| format!("--config {shown}"))?;
    merged.config = Some(path);
    Ok(merged)
}

/// A TOML config's section (`[fsdp]`) as the flags it stands for: the flag `fsdp` (on, unless
/// `enabled = false` inside) and each key inside the flag `fsdp-KEY`.
fn flatten_sections(file: Vec<(String, toml::Value)>) -> Vec<(String, toml::Value)> {
    let flat = |(key, value): (String, toml::Value)| match value {
        toml::Value::Table(mut section) => {
            let on = section.remove("enabled").unwrap_or(toml::Value::Boolean(true));
            let inside =
                section.into_iter().map(|(k, v)| (format!("{key}-{}", k.replace('_', "-")), v));
            std::iter::once((key.clone(), on)).chain(inside.collect::<Vec<_>>()).collect()
        }
        value => vec![(key, value)],
    };
    file.into_iter().flat_map(flat).collect()
}
