//! `tandem ckpt`: inspect, convert, diff and load-check checkpoints (.pt / .safetensors, and
//! directories: tandem's sharded ones, PyTorch's distributed checkpoints).
//! Every subcommand reads through tandem-ckpt (never executing pickle code); unreadable input
//! is one `error:` line and a non-zero exit.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Subcommand;
use serde_json::json;
use tandem::ckpt::keys::{find_state_dicts, load_state_dict};
use tandem::ckpt::tree::{self, keys_of};
use tandem::ckpt::{dcp, CkptError, LoadOptions, Value};
use tandem::optim::zero::is_zero1_checkpoint;
use tandem::recipes::face::arcface;
use tandem::train::checkpoint::Saved;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// Container keys, each tensor's dtype/shape/bytes, detected wrapping, non-tensor values;
    /// for a sharded checkpoint (a directory: the face recipe's, ZeRO's), its ranks, the slice
    /// each holds and what each file holds; for a PyTorch distributed checkpoint (a `dcp.save`
    /// directory), its values and how each tensor is chunked over its files.
    Inspect {
        #[arg(value_parser = checkpoint_path)]
        file: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Convert between .pt and .safetensors (by OUT's extension), optionally renaming keys. A
    /// sharded checkpoint (a directory with manifest.json) becomes one .pt dict (every shard
    /// put together: ZeRO's optimizer state in torch's layout).
    /// A face-recipe checkpoint directory becomes arcface_torch's `checkpoint_gpu_{rank}.pt`
    /// files (+ model.pt) in the directory OUT; a directory of those becomes a tandem checkpoint
    /// in the run directory OUT (`tandem train --out OUT --resume` continues it).
    Convert {
        #[arg(value_parser = checkpoint_path)]
        input: PathBuf,
        output: PathBuf,
        /// Remove this prefix from every key of the state dict (e.g. `module.`).
        #[arg(long, conflicts_with = "add_prefix")]
        strip_prefix: Option<String>,
        /// Put this prefix in front of every key of the state dict.
        #[arg(long)]
        add_prefix: Option<String>,
        /// Convert only the value under this key (`model`, or a path like `ckpt/model`).
        #[arg(long)]
        key: Option<String>,
        /// What to write: `pt`, `safetensors` (default: by OUT's extension) or `dcp` (a
        /// directory `dcp.load` reads, as one process's `dcp.save` writes it). A `dcp.save`
        /// directory as INPUT is read whole, its shards put together.
        #[arg(long, value_parser = ["pt", "safetensors", "dcp"])]
        to: Option<String>,
    },
    /// Keys only in one file, shape/dtype differences and the max abs difference of tensors.
    /// Exits 0 when the files hold the same values, 1 when they differ.
    Diff {
        #[arg(value_parser = checkpoint_path)]
        a: PathBuf,
        #[arg(value_parser = checkpoint_path)]
        b: PathBuf,
    },
    /// The load report of loading FILE into a model shaped like REFERENCE's state dict.
    /// Exits 0 when every key fits, 1 otherwise.
    LoadCheck {
        #[arg(value_parser = checkpoint_path)]
        file: PathBuf,
        #[arg(long = "into")]
        reference: PathBuf,
        /// Report as `strict=False` would (the exit code still says whether everything fit).
        #[arg(long)]
        non_strict: bool,
    },
}

/// A checkpoint argument; a run's `latest` file stands for the checkpoint it names.
pub(crate) fn checkpoint_path(arg: &str) -> Result<PathBuf, String> {
    tandem::train::checkpoint::resolve_latest(Path::new(arg)).map_err(|e| e.to_string())
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    match args.which {
        Which::Inspect { file, json } => inspect(&file, json),
        Which::Convert { input, output, strip_prefix, add_prefix, key, to } => {
            let renames = (strip_prefix.as_deref(), add_prefix.as_deref());
            convert(&input, &output, renames, key.as_deref(), to.as_deref())
        }
        Which::Diff { a, b } => diff(&a, &b),
        Which::LoadCheck { file, reference, non_strict } => {
            load_check(&file, &reference, !non_strict)
        }
    }
}

/// Reads with every zip entry's CRC-32 verified: a tool asked whether a file is sound must not
/// report a bit-flipped one as fine. A directory is a sharded checkpoint, read whole
/// (consolidated): tandem's, or the earlier ZeRO-only format's. `keep_ordered_dicts` keeps
/// OrderedDicts and their `_metadata` (for `convert`: a faithful re-save).
pub(crate) fn read(path: &Path, keep_ordered_dicts: bool) -> anyhow::Result<Value> {
    if path.is_dir() {
        if dcp::is_dcp_dir(path) {
            return Ok(dcp::load(path)?);
        }
        if is_zero1_checkpoint(path) {
            return Ok(tandem::optim::zero::consolidate_sharded(path)?);
        }
        let saved = Saved::open(path)?; // (an Fsdp model's rows and buffers: a full `model`)
        let whole = tandem::train::fsdp_consolidated(&saved)?;
        return Ok(whole.map_or_else(|| saved.consolidated(), Ok)?);
    }
    let opts = LoadOptions { verify_checksums: true, keep_ordered_dicts, ..Default::default() };
    Ok(tandem::ckpt::load_with(path, &opts)?)
}

/// A sharded checkpoint ([`Saved::inspect`]); the face recipe's also says its head's shape.
fn inspect_sharded_state(saved: &Saved, as_json: bool) -> anyhow::Result<i32> {
    let (inspection, head) = (saved.inspect()?, tandem::recipes::face::head_shape(saved));
    if as_json {
        let mut j = serde_json::to_value(&inspection)?;
        (j["num_classes"], j["embedding_size"]) =
            (json!(head.map(|h| h.0)), json!(head.map(|h| h.1)));
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(0);
    }
    print!("{inspection}");
    let dir = saved.path().display();
    match head {
        Some((c, e)) => println!(
            "face-recipe checkpoint: a head of {c} classes x {e} (`tandem ckpt convert {dir} \
             OUT_DIR` writes arcface_torch's checkpoint_gpu_{{rank}}.pt files)"
        ),
        _ => println!("(`tandem ckpt convert {dir} whole.pt` writes it as one dict)"),
    }
    Ok(0)
}

/// Face-recipe checkpoints to arcface_torch's per-rank files, or back.
fn convert_face(input: &Path, output: &Path) -> anyhow::Result<i32> {
    if arcface::is_face_dir(input) {
        for w in arcface::to_arcface(input, output)? {
            println!("wrote {}", w.display());
        }
    } else {
        let dir = arcface::from_arcface(input, output)?;
        println!(
            "wrote {}: continue it with `tandem train --out {} --resume` and the run's flags (any --nproc-per-node)",
            dir.display(),
            output.display()
        );
    }
    Ok(0)
}

/// Prints an inspection as JSON or as text.
fn show<T: serde::Serialize + std::fmt::Display>(inspection: &T, json: bool) -> anyhow::Result<()> {
    match json {
        true => println!("{}", serde_json::to_string_pretty(inspection)?),
        false => print!("{inspection}"),
    }
    Ok(())
}

fn inspect(file: &Path, as_json: bool) -> anyhow::Result<i32> {
    if file.is_dir() && is_zero1_checkpoint(file) {
        // A ZeRO checkpoint of the earlier format: each rank's file, parameters and state bytes.
        show(&tandem::optim::zero::inspect_sharded(file)?, as_json)?;
        let (dir, hint) = (file.display(), "the consolidated, torch-loadable state dict");
        if !as_json {
            println!("(`tandem ckpt convert {dir} optim.pt` writes {hint})");
        }
    } else if file.is_dir() && !dcp::is_dcp_dir(file) {
        return inspect_sharded_state(&Saved::open(file)?, as_json);
    } else {
        show(&tree::inspect(file, &read(file, false)?)?, as_json)?;
    }
    Ok(0)
}

fn convert(
    input: &Path,
    output: &Path,
    (strip, add): (Option<&str>, Option<&str>),
    key: Option<&str>,
    to: Option<&str>,
) -> anyhow::Result<i32> {
    if input.is_dir() && (arcface::is_face_dir(input) || arcface::is_arcface_dir(input)) {
        if strip.is_some() || add.is_some() || key.is_some() {
            bail!("--strip-prefix/--add-prefix/--key: not for face-recipe checkpoint directories");
        }
        return convert_face(input, output);
    }
    // An Fsdp checkpoint goes to DCP in FSDP2's own layout (`model`, `optim` keyed by name).
    let state_dir = input.is_dir() && !dcp::is_dcp_dir(input) && !is_zero1_checkpoint(input);
    let fsdp2 = match to == Some("dcp") && key.is_none() && state_dir {
        true => tandem::train::fsdp2_state_dict(&Saved::open(input)?)?,
        false => None,
    };
    let v = fsdp2.map_or_else(|| read(input, true), Ok)?;
    let to_safetensors = match to {
        Some(t) => t == "safetensors",
        None => output.extension().is_some_and(|e| e == "safetensors"),
    };
    let mut selected = match key {
        Some(k) => tree::select(&v, k).context("--key")?.clone(),
        None => v,
    };
    let is_sd = tandem::ckpt::keys::is_state_dict(&selected);
    if (to_safetensors || strip.is_some() || add.is_some()) && !is_sd {
        // A training checkpoint: use its state dict when there is exactly one.
        let found = find_state_dicts(&selected);
        match found.as_slice() {
            [(at, _)] if at != "(bare)" => {
                eprintln!("note: converting the state dict under `{at}` (use --key to pick another value)");
                let path = at.replace('.', "/");
                selected = tree::select(&selected, &path)?.clone();
            }
            _ => bail!(
                "{}: not a plain state dict; pick one with --key (top-level keys: {})",
                input.display(),
                keys_of(&selected).join(", ")
            ),
        }
    }
    if let Some(p) = strip {
        let stripped;
        (selected, stripped) = tree::strip_prefix(&selected, p)?;
        if stripped == 0 {
            eprintln!("warning: no key starts with `{p}`; nothing stripped");
        }
    }
    if let Some(p) = add {
        selected = tree::add_prefix(&selected, p)?;
    }
    if to == Some("dcp") {
        if !matches!(selected, Value::Dict(_) | Value::OrderedDict { .. }) {
            bail!("--to dcp: a distributed checkpoint holds a dict; pick one with --key");
        }
        dcp::save(output, &selected.into_plain())?;
    } else if to_safetensors {
        // safetensors holds tensors only: no OrderedDict, no module versions.
        tandem::ckpt::safetensors::save(output, &selected.into_plain())?;
    } else {
        tandem::ckpt::save(output, &selected)?;
    }
    eprintln!("wrote {}", output.display());
    Ok(0)
}

fn diff(a: &Path, b: &Path) -> anyhow::Result<i32> {
    let d = tree::diff(&read(a, false)?, &read(b, false)?);
    print!("{}", d.report(&a.display().to_string(), &b.display().to_string()));
    Ok(if d.differences() == 0 { 0 } else { 1 })
}

fn load_check(file: &Path, reference: &Path, strict: bool) -> anyhow::Result<i32> {
    let (src, rf) = (read(file, false)?, read(reference, false)?);
    let found = find_state_dicts(&rf);
    let Some((_, target)) = found.first() else {
        bail!("{}: holds no state dict to check against", reference.display())
    };
    let target: Vec<(String, Vec<usize>, tandem::ckpt::ElemType)> =
        target.iter().map(|(k, t)| (k.clone(), t.shape.clone(), t.dtype)).collect();
    match load_state_dict(&src, &target, strict) {
        Ok((_, report)) => {
            print!("{report}");
            Ok(if report.is_complete() { 0 } else { 1 })
        }
        Err(CkptError::StateDictMismatch(report)) => {
            print!("{report}");
            Ok(1)
        }
        Err(e) => Err(e.into()),
    }
}
